"""The prefix snapshot cache's building blocks: the coordinator's index (pure) and the
shared-memory arena (real processes)."""
from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from coordinator.snapshots import Planned, SnapshotIndex
from shared.shm_arena import HEADER_BYTES, SHM_DIR, ArenaError, SnapshotArena
from tests.support.deadline import deadline
from tests.support.smaps import mapping_rss

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fail_fast_if_the_index_loops():
    """A chain whose parents loop (an entry its own ancestor) would make commit's walk up the
    chain spin: the test fails in 30 s naming that, instead of hanging (each test takes < 3 s)."""
    with deadline(30, "an index walk that never ends: a chain's parents form a loop?"):
        yield


def cache(idx: SnapshotIndex, tokens, start: int = 0) -> list[Planned]:
    """Plan and commit every snapshot of a prefill of tokens[start:]."""
    planned = idx.plan(tokens, start)
    idx.commit(planned)
    return planned


def lookup_position(idx, tokens) -> int:
    res = idx.lookup(tokens)
    idx.release(res)
    return res.position if res else 0


# ---- keys --------------------------------------------------------------------
def test_equal_prefixes_give_equal_keys():
    idx = SnapshotIndex(4, block=4)
    a = idx.chain_keys(list(range(8)) + [50, 51, 52, 53, 54])
    b = idx.chain_keys(list(range(8)) + [60, 61, 62, 63])
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(len(k) == 16 for k in a)
    assert idx.chain_keys([1, 2, 3]) == [] and idx.chain_keys([]) == []
    assert idx.end_key(np.array([1, 2, 3, 4, 5], np.int32)) == idx.end_key([1, 2, 3, 4, 5])


def test_one_changed_token_changes_its_block_and_every_later_key():
    idx = SnapshotIndex(4, block=4)
    tokens = list(range(100, 120))
    changed = list(tokens)
    changed[9] += 1                       # block 3 (positions 8..11)
    a, b = idx.chain_keys(tokens), idx.chain_keys(changed)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))
    assert idx.end_key(tokens[:18]) != idx.end_key(changed[:18])
    assert idx.end_key(tokens[:6]) == idx.end_key(changed[:6])


def test_no_collisions_between_splits_blocks_and_end_keys():
    # Every key of every prefix of every short token list, for several block sizes:
    # a key may only ever name one (block size, kind, exact token prefix).
    def record(key, what):
        assert named.setdefault(key, what) == what, f"{what} collides with {named[key]}"

    for block in (1, 2, 3):
        named: dict[bytes, tuple] = {}                 # one index has one block size
        idx = SnapshotIndex(1, block=block)
        for n in range(1, 7):
            for tokens in itertools.product((0, 1, 2), repeat=n):
                for i, key in enumerate(idx.chain_keys(tokens)):
                    record(key, (block, "chain", tokens[:(i + 1) * block]))
                if n % block:
                    record(idx.end_key(tokens), (block, "end", tokens))
    # The classic split ambiguity, spelled out.
    two = SnapshotIndex(1, block=2)
    assert two.end_key([1, 2, 3]) not in SnapshotIndex(1, block=1).chain_keys([1, 2, 3])
    assert two.chain_keys([1, 2, 3, 4])[0] != SnapshotIndex(1, block=1).chain_keys([1, 2])[1]


def test_bad_tokens_refused():
    idx = SnapshotIndex(4, block=4)
    for bad in ([1.5, 2.0], [-1, 3], [2**31], [[1, 2], [3, 4]], ["a"]):
        with pytest.raises(ValueError):
            idx.chain_keys(bad)


# ---- lookup ------------------------------------------------------------------
def test_lookup_longest_prefix_and_exact_hits():
    idx = SnapshotIndex(16, block=4)
    prompt = list(range(14))
    planned = idx.plan(prompt, 0)
    assert [p.position for p in planned] == [4, 8, 12, 14]
    assert [p.parent for p in planned] == [None] + idx.chain_keys(prompt)
    assert idx.lookup(prompt) is None                  # planned is invisible
    idx.commit(planned)

    exact = idx.lookup(prompt)
    assert exact.exact and exact.position == 14
    assert [e.position for e in exact.entries] == [4, 8, 12, 14]
    assert [e.key for e in exact.chain] == idx.chain_keys(prompt)
    assert exact.end.key == idx.end_key(prompt)
    assert [e.slot for e in exact.entries] == [p.slot for p in planned]
    idx.release(exact)

    branch = idx.lookup(prompt[:10] + [99, 98, 97])
    assert (branch.position, branch.exact, branch.end) == (8, False, None)
    idx.release(branch)
    aligned = idx.lookup(prompt[:12])                  # the last chain entry has logits
    assert (aligned.position, aligned.exact, aligned.end) == (12, True, None)
    idx.release(aligned)
    longer = idx.lookup(prompt + [5, 6, 7])            # the next turn extends the prompt
    assert (longer.position, longer.exact) == (14, False)
    idx.release(longer)
    assert idx.plan(prompt, 14) == []
    assert [p.position for p in idx.plan(prompt + [5, 6, 7], 14)] == [16, 17]

    assert idx.lookup([7, 7, 7]) is None and idx.lookup([]) is None
    s = idx.stats()
    assert (s["hits"], s["misses"], s["pinned"]) == (4, 3, 2)


def test_short_prompt_exact_hit_and_release_rules():
    idx = SnapshotIndex(4, block=4)
    (p,) = cache(idx, [5, 6])
    assert (p.position, p.parent) == (2, None)
    res = idx.lookup([5, 6])
    assert res.exact and res.chain == () and res.end.slot == p.slot
    idx.release(res)
    with pytest.raises(ValueError):
        idx.release(res)
    idx.release(None)
    with pytest.raises(ValueError):
        idx.plan([1, 2, 3], 4)


def test_concurrent_prefills_share_no_slot_and_no_key():
    idx = SnapshotIndex(16, block=4)
    prompt = list(range(16))
    first = idx.plan(prompt[:8], 0)
    second = idx.plan(prompt, 0)                       # blocks 1-2 are being written
    assert [p.position for p in first] == [4, 8]
    assert [p.position for p in second] == [12, 16]
    idx.commit(second)
    assert idx.lookup(prompt) is None                  # a gap at blocks 1-2
    idx.abort(first)                                   # the first writer died
    assert idx.lookup(prompt) is None
    assert [p.position for p in cache(idx, prompt)] == [4, 8]
    assert lookup_position(idx, prompt) == 16
    idx.check_invariants()


# ---- eviction and pinning ----------------------------------------------------
def test_lru_eviction_order():
    idx = SnapshotIndex(3, block=4)
    a, b, c, d = ([k] * 4 for k in (1, 2, 3, 4))
    for p in (a, b, c):
        cache(idx, p)
    assert lookup_position(idx, a) == 4                # a is now the most recent
    cache(idx, d)                                      # evicts b, the oldest
    assert [lookup_position(idx, p) for p in (a, b, c, d)] == [4, 0, 4, 4]
    assert idx.stats()["evictions"] == 1


def test_chain_evicted_from_its_deep_end():
    idx = SnapshotIndex(3, block=4)
    chain = list(range(12))
    cache(idx, chain)
    cache(idx, [9] * 4)
    cache(idx, [8] * 4)
    assert lookup_position(idx, chain) == 4
    assert lookup_position(idx, [9] * 4) == 4


def test_reused_entries_outlive_those_never_reused():
    idx = SnapshotIndex(4, block=4)
    chain = list(range(12))
    cache(idx, chain)
    assert lookup_position(idx, chain) == 12           # reused: now behind everything never reused
    cache(idx, [9] * 4)
    cache(idx, [8] * 4)                                # evicts [9] * 4, the oldest never reused
    assert lookup_position(idx, [9] * 4) == 0
    assert lookup_position(idx, chain) == 12
    cache(idx, [7] * 4)                                # evicts [8] * 4 ([9] * 4's miss cached nothing)
    cache(idx, [6] * 4)
    assert lookup_position(idx, chain) == 12 and idx.stats()["evictions"] == 3
    idx.check_invariants()


def test_one_off_short_prompts_never_evict_a_long_prompts_blocks():
    """A long prompt's block snapshots are shared by every extension of it; the end
    snapshots of a stream of one-off short prompts (none ever asked for again) take
    each other's slots, never those blocks, however many of them come."""
    block, slots = 8, 24
    idx = SnapshotIndex(slots, block=block)
    rng = random.Random(5)
    long_prompt = [rng.randrange(1000) for _ in range(block * 16 + 3)]     # 16 blocks and an end
    cache(idx, long_prompt)
    for i in range(500):                                                   # each one new
        short = [1000 + i] + [rng.randrange(1000) for _ in range(rng.randrange(block - 1))]
        res = idx.lookup(short)
        cache(idx, short, res.position if res else 0)
        idx.release(res)
    extension = long_prompt + [rng.randrange(1000) for _ in range(20)]
    assert lookup_position(idx, extension) == block * 16
    s = idx.stats()
    assert s["entries"] == slots and s["evictions"] == 500 - (slots - 17)     # the long prompt's end went too
    idx.check_invariants()


def test_a_replays_lookup_is_no_cache_hit():
    idx = SnapshotIndex(4, block=4)
    prompt = list(range(6))
    assert idx.lookup(prompt) is None                  # the request's own lookup: a miss
    cache(idx, prompt)
    res = idx.lookup(prompt, replay=True)              # its replay finds what it wrote itself
    assert res.position == 6
    idx.release(res)
    s = idx.stats()
    assert (s["hits"], s["misses"], s["hit_tokens"], s["replays"], s["replay_hit_tokens"]) == (0, 1, 0, 1, 6)
    for k in (9, 8, 7):
        cache(idx, [k] * 4)                            # the last evicts the prompt's end entry: a replay
    assert lookup_position(idx, prompt) == 4           # promoted nothing (a reused one would stay)
    idx.check_invariants()


def test_a_prompt_never_evicts_its_own_blocks():
    idx = SnapshotIndex(3, block=4)
    prompt = list(range(20))
    cache(idx, prompt[:8])
    planned = idx.plan(prompt, 0)                      # only one slot left, nothing evictable
    assert [p.position for p in planned] == [12]
    assert idx.stats()["skipped"] == 2
    idx.commit(planned)
    assert lookup_position(idx, prompt) == 12


def test_pinned_entries_are_never_evicted():
    idx = SnapshotIndex(2, block=4)
    a = [1] * 4
    cache(idx, a)
    res = idx.lookup(a)
    planned = idx.plan([2] * 8, 0)
    assert [p.position for p in planned] == [4]        # one free slot; a is pinned
    assert idx.plan([3] * 4, 0) == []                  # every slot pinned: plan nothing
    s = idx.stats()
    assert (s["pinned"], s["writing"], s["free_slots"], s["entries"]) == (2, 1, 0, 1)
    again = idx.lookup(a)                              # pinned twice now
    idx.commit(planned)
    idx.release(res)
    (p,) = idx.plan([3] * 4, 0)                        # a is still pinned by `again`
    assert p.slot == planned[0].slot
    idx.release(again)
    idx.check_invariants()


def test_budget_full_of_planned_entries():
    idx = SnapshotIndex(3, block=4)
    held = idx.plan(list(range(12)), 0)
    assert len(held) == 3 and idx.plan(list(range(50, 70)), 0) == []
    assert idx.stats()["free_slots"] == 0
    empty = SnapshotIndex(0, block=4)
    assert empty.plan(list(range(12)), 0) == [] and empty.lookup([1]) is None


def test_abort_frees_and_double_commit_is_refused():
    idx = SnapshotIndex(4, block=4)
    planned = idx.plan(list(range(10)), 0)
    assert idx.stats()["free_slots"] == 1
    assert idx.planned_in(planned[0].slot) == planned[0]
    idx.abort(planned)
    assert idx.stats()["free_slots"] == 4 and idx.planned_in(planned[0].slot) is None
    assert idx.lookup(list(range(10))) is None
    with pytest.raises(ValueError):
        idx.commit(planned[0])
    again = idx.plan(list(range(10)), 0)
    idx.commit(again[0])
    with pytest.raises(ValueError):
        idx.commit(again)                              # again[0] already committed: nothing changes
    assert idx.stats()["writing"] == 2
    idx.check_invariants()


def test_eviction_inside_a_chain_truncates_lookups():
    idx = SnapshotIndex(4, block=4)
    prompt = list(range(16))
    planned = cache(idx, prompt)
    idx._lru.touch(planned[1].key, last=False)   # force block 2 to go first
    (other,) = idx.plan([7] * 4, 0)
    assert other.slot == planned[1].slot               # its slot is reused ...
    res = idx.lookup(prompt)                           # ... and never returned for block 2
    assert res.position == 4 and [e.slot for e in res.entries] == [planned[0].slot]
    idx.release(res)
    idx.commit(other)
    refill = idx.plan(prompt, 4)                       # the gap is filled, blocks 3-4 kept
    assert [p.position for p in refill] == [8]
    idx.commit(refill)
    assert lookup_position(idx, prompt) == 16
    idx.check_invariants()


# ---- model-based random test -------------------------------------------------
def _expected_position(idx, tokens) -> int:
    """Brute force: the longest p whose chain entries and own entry are all cached, its
    own with a state (an end entry always has one)."""
    cached = idx._entries
    data = np.asarray(tokens, "<i4").tobytes()
    keys = idx.chain_keys(tokens)
    for p in range(len(tokens), 0, -1):
        k = p // idx.block
        if not all(key in cached for key in keys[:k]):
            continue
        if p % idx.block == 0:
            if keys[k - 1] in idx._states:
                return p
            continue
        base = keys[k - 1] if k else b""
        if idx._end(base, data, k * idx.block, p) in cached:
            return p
    return 0


@pytest.mark.parametrize("n_state_slots", [None, 5])
def test_random_operations_keep_the_index_sound(n_state_slots):
    rng = random.Random(1234)
    block, n_slots = 4, 16
    idx = SnapshotIndex(n_slots, block=block, n_state_slots=n_state_slots)
    docs = [[rng.randrange(5) for _ in range(30)] for _ in range(3)]

    asked: list[list[int]] = []

    def prompt():
        if asked and rng.random() < 0.4:               # a repeated or extended request
            return rng.choice(asked[-8:]) + [rng.randrange(5)] * rng.choice((0, 0, 2))
        doc = rng.choice(docs)
        tokens = doc[:rng.randrange(1, len(doc) + 1)]
        asked.append(tokens + [rng.randrange(5) for _ in range(rng.choice((0, 0, 1, 3)))])
        return asked[-1]

    content: dict[int, object] = {}        # what the simulated arena's KV slots hold
    states: dict[int, object] = {}         # ... and its state slots
    resumes, pending = [], []

    def check_resume(res, tokens):
        for e in res.entries:
            assert content.get(e.slot) == e.key, "a resume points at a stale slot"
        assert states.get(res.state) == res.entries[-1].key, "a resume points at a stale state"
        assert [e.position for e in res.chain] == [block * (i + 1) for i in range(len(res.chain))]
        assert [e.key for e in res.chain] == idx.chain_keys(tokens)[:len(res.chain)]
        if res.end is not None:
            assert res.end.key == idx.end_key(tokens[:res.position])

    exact_hits = 0
    for _ in range(4000):
        op = rng.random()
        if len(resumes) > 3:                            # keep a steady state: requests end
            op = 0.4
        elif len(pending) > 6:
            op = 0.85
        if op < 0.35:
            tokens = prompt()
            expected = _expected_position(idx, tokens)
            res = idx.lookup(tokens)
            assert (res.position if res else 0) == expected
            if res:
                assert res.exact == (res.position == len(tokens))
                exact_hits += res.exact
                check_resume(res, tokens)
                resumes.append((res, tokens))
        elif op < 0.55 and resumes:
            res, tokens = resumes.pop(rng.randrange(len(resumes)))
            check_resume(res, tokens)                  # nothing overwrote it while pinned
            idx.release(res)
        elif op < 0.8:
            tokens = prompt()
            start = rng.choice((0, _expected_position(idx, tokens)))
            for p in idx.plan(tokens, start, marks=[rng.randrange(len(tokens) + 1)]):
                assert (p.key in idx._entries) == (p.slot < 0) and start < p.position <= len(tokens)
                if p.slot >= 0:
                    content[p.slot] = ("writing", p.key)   # the worker scribbles at once
                if p.state >= 0:
                    states[p.state] = ("writing", p.key)
                pending.append(p)
        elif op < 0.83:                                 # a decoding sequence's snapshots
            for pair in idx.reserve(rng.choice((1, 2)), end=rng.random() < 0.7):
                tokens = prompt()
                content[pair[0]], states[pair[1]] = ("writing", None), ("writing", None)
                key = idx.chain_keys(tokens)[-1] if len(tokens) % block == 0 else idx.end_key(tokens)
                if idx.adopt(pair, tokens):
                    if idx._entries[key].slot == pair[0]:
                        content[pair[0]] = key
                    if pair[1] >= 0:
                        states[pair[1]] = key
        elif pending:
            p = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.8:
                if p.slot >= 0:
                    content[p.slot] = p.key
                if p.state >= 0:
                    states[p.state] = p.key
                idx.commit(p)
            else:
                content[p.slot] = states[p.state] = None
                idx.abort(p)
        idx.check_invariants()
        s = idx.stats()
        assert s["entries"] + s["writing"] + s["free_slots"] == n_slots
    s = idx.stats()
    assert min(s["hits"], s["misses"], s["evictions"], s["skipped"]) > 15, s
    assert exact_hits > (15 if n_state_slots is None else 2), exact_hits   # few states: fewer exact hits
    if n_state_slots:
        assert s["state_evictions"] > 15 and s["entries"] > s["states"], s


# ---- shared-memory arena -----------------------------------------------------
def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_arena_shared_between_processes():
    with SnapshotArena.create(slot_bytes=1000, n_slots=4, prefix="fermoetest") as arena:
        assert arena.stride == 1024 and shm_exists(arena.name)
        assert arena.name.startswith(f"fermoetest-{os.getpid()}-")
        np.frombuffer(arena.slot(2), np.uint8)[:] = np.arange(1000) % 251
        child = run_python("""
            import sys
            import numpy as np
            from shared.shm_arena import SnapshotArena
            arena = SnapshotArena.attach(sys.argv[1], 1000, 4)
            got = np.frombuffer(arena.slot(2), np.uint8)
            assert (got == np.arange(1000) % 251).all()
            arena.slot(3)[:5] = b"child"
            del got
            arena.close()
            print("ok")
            """, arena.name)
        assert child.returncode == 0, child.stderr
        assert child.stdout == "ok\n" and child.stderr == ""    # no resource_tracker noise
        assert shm_exists(arena.name)                  # the attacher exiting unlinked nothing
        assert bytes(arena.slot(3)[:5]) == b"child"
        name = arena.name
    assert not shm_exists(name)


def test_arena_slots_are_aligned_and_bounded():
    with SnapshotArena.create(slot_bytes=100, n_slots=3, prefix="fermoetest", reserve=True) as arena:
        assert os.path.getsize(os.path.join(SHM_DIR, arena.name)) == HEADER_BYTES + 3 * 128
        for i in range(3):
            view = arena.slot(i)
            assert len(view) == 100 and arena.offset(i) % 64 == 0
            assert np.frombuffer(view, np.uint8).ctypes.data % 64 == 0
        assert arena.offset(np.int64(2)) == HEADER_BYTES + 256
        for bad in (3, -1, True, 1.0):
            with pytest.raises(ValueError, match=f"slot {bad!r}"):
                arena.slot(bad)


def test_arena_attach_refuses_a_wrong_geometry():
    with SnapshotArena.create(slot_bytes=1000, n_slots=4, prefix="fermoetest") as arena:
        with pytest.raises(ArenaError, match="bytes"):
            SnapshotArena.attach(arena.name, 1000, 5)
        with pytest.raises(ArenaError, match="header"):
            SnapshotArena.attach(arena.name, 1001, 4)  # same size once padded
        with SnapshotArena.attach(arena.name, 1000, 4) as same:
            with pytest.raises(ArenaError, match="only the creating process"):
                same.unlink()
        assert shm_exists(arena.name)
    with pytest.raises(ArenaError, match="no such segment"):
        SnapshotArena.attach(arena.name, 1000, 4)
    with pytest.raises(ArenaError):
        SnapshotArena.attach("../etc/passwd", 1000, 4)


def test_arena_state_slots_follow_the_kv_slots():
    """A second region of state slots of their own size after the KV slots, each 64-byte
    aligned, bounded apart; an attach must name both geometries; a state region needs a
    size and a count."""
    with SnapshotArena.create(slot_bytes=100, n_slots=3, prefix="fermoetest", state_slot_bytes=1000,
                              n_state_slots=2) as arena:
        assert os.path.getsize(os.path.join(SHM_DIR, arena.name)) == HEADER_BYTES + 3 * 128 + 2 * 1024
        assert [arena.state_offset(j) for j in range(2)] == [HEADER_BYTES + 384, HEADER_BYTES + 384 + 1024]
        for i in range(3):
            arena.slot(i)[:] = bytes([i + 1]) * 100
        for j in range(2):
            view = arena.state_slot(j)
            assert len(view) == 1000 and np.frombuffer(view, np.uint8).ctypes.data % 64 == 0
            view[:] = bytes([10 + j]) * 1000
        whole = bytes(arena.memory())
        assert [whole[arena.offset(i):arena.offset(i) + 100] for i in range(3)] == [bytes([i + 1]) * 100
                                                                                  for i in range(3)]
        assert whole[arena.state_offset(1):arena.state_offset(1) + 1000] == bytes([11]) * 1000
        with pytest.raises(ArenaError, match="state slot 2 is out of range: .* has state slots 0..1"):
            arena.state_slot(2)
        with SnapshotArena.attach(arena.name, 100, 3, 1000, 2) as same:
            assert bytes(same.state_slot(0)) == bytes([10]) * 1000 and bytes(same.slot(2)) == bytes([3]) * 100
        with pytest.raises(ArenaError, match="header says .* state_slot_bytes=1000 n_state_slots=2"):
            SnapshotArena.attach(arena.name, 100, 3, 1001, 2)     # the same size once padded
        with pytest.raises(ArenaError, match="state slots"):
            SnapshotArena.attach(arena.name, 100, 3)
    with SnapshotArena.create(slot_bytes=100, n_slots=1, prefix="fermoetest") as plain:
        with pytest.raises(ArenaError, match="has no state slots"):
            plain.state_slot(0)
    with pytest.raises(ArenaError, match="state slots need both a size and a count"):
        SnapshotArena.create(slot_bytes=100, n_slots=1, prefix="fermoetest", state_slot_bytes=100)
    with pytest.raises(ArenaError, match="n_state_slots must be a non-negative integer"):
        SnapshotArena.create(slot_bytes=100, n_slots=1, prefix="fermoetest", state_slot_bytes=100,
                             n_state_slots=-1)


def _rss_of_mapping(address: int) -> int:
    """Bytes of this process's mapping that starts at `address` that are in its page tables."""
    return mapping_rss("self", lambda line: line.split("-", 1)[0] == f"{address:x}")


def _kernel_populates() -> bool:
    import mmap
    from shared.shm_arena import MADV_POPULATE_WRITE
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)
        return True
    except OSError:
        return False
    finally:
        probe.close()


@pytest.mark.skipif(not _kernel_populates(), reason="the kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")
def test_arena_prefault_maps_the_state_slots_without_writing():
    """prefault() steps through the state region a chunk at a time; afterwards this
    process's mapping holds every page of the state slots (and of the KV slots only what it
    touched), and every byte is what it was."""
    kv_bytes, state_bytes = 64 << 10, 1 << 20
    with SnapshotArena.create(slot_bytes=kv_bytes, n_slots=4, prefix="fermoetest", state_slot_bytes=state_bytes,
                              n_state_slots=3) as arena:
        arena.state_slot(1)[:] = bytes(range(256)) * (state_bytes // 256)
        arena.slot(0)[:] = b"\x07" * kv_bytes
        with SnapshotArena.attach(arena.name, kv_bytes, 4, state_bytes, 3) as same:
            whole = np.frombuffer(same.memory(), np.uint8)
            address = whole.ctypes.data
            del whole
            before = _rss_of_mapping(address)
            steps = list(same.prefault(chunk=256 << 10))
            region = 3 * state_bytes
            assert len(steps) == -(-(region + arena.state_offset(0) % 4096) // (256 << 10))
            after = _rss_of_mapping(address)
            assert before < region <= after < region + 4 * kv_bytes
            assert bytes(same.state_slot(1)) == bytes(range(256)) * (state_bytes // 256)
            assert bytes(same.slot(0)) == b"\x07" * kv_bytes and not any(bytes(same.state_slot(2)))
    with SnapshotArena.create(slot_bytes=100, n_slots=1, prefix="fermoetest") as plain:
        assert list(plain.prefault()) == []                   # no state slots: nothing to map


def test_arena_larger_than_dev_shm_is_refused():
    before = set(os.listdir(SHM_DIR))
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    with pytest.raises(ArenaError, match="do not fit"):
        SnapshotArena.create(slot_bytes=1 << 30, n_slots=free // (1 << 30) + 2, prefix="fermoetest")
    assert set(os.listdir(SHM_DIR)) <= before
    with pytest.raises(ArenaError, match="n_slots"):
        SnapshotArena.create(slot_bytes=64, n_slots=0)
    with pytest.raises(ArenaError, match="prefix"):
        SnapshotArena.create(slot_bytes=64, n_slots=1, prefix="a/b")


def test_arena_close_with_live_arrays_and_views():
    arena = SnapshotArena.create(slot_bytes=64, n_slots=2, prefix="fermoetest")
    arr = np.frombuffer(arena.slot(0), np.uint8)
    view = arena.slot(1)
    arr[:] = 7
    arena.close()
    assert arena.closed and (arr == 7).all()           # still mapped while the array lives
    with pytest.raises(ValueError):
        view[0]                                         # a released view refuses use
    with pytest.raises(ArenaError, match="closed"):
        arena.slot(0)
    arena.unlink()
    assert not shm_exists(arena.name)
    arena.close()                                      # idempotent


@pytest.mark.parametrize("how", ["exit", "with", "fork"])
def test_arena_creator_exit_leaves_nothing(how):
    child = run_python("""
        import os, sys
        from shared.shm_arena import SHM_DIR, SnapshotArena
        how = sys.argv[1]
        path = lambda name: os.path.join(SHM_DIR, name)
        if how == "with":
            with SnapshotArena.create(4096, 4, prefix="fermoetest") as arena:
                print(arena.name)
        else:
            arena = SnapshotArena.create(4096, 4, prefix="fermoetest")
            print(arena.name)
            arena.slot(0)[:3] = b"abc"
        if how == "fork":
            pid = os.fork()
            if pid == 0:
                sys.exit(0)                            # runs atexit hooks in the child
            os.waitpid(pid, 0)
            assert os.path.exists(path(arena.name)), "a forked child unlinked the arena"
            print("kept")
        """, how)
    assert child.returncode == 0, child.stderr
    assert child.stderr == ""
    name = child.stdout.split()[0]
    assert name.startswith("fermoetest-") and not shm_exists(name)
    if how == "fork":
        assert child.stdout.split()[1] == "kept"


def test_remove_stale_reclaims_dead_creators_only():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = f"fermoetest-{dead}-deadbeef"
    with open(os.path.join(SHM_DIR, stale), "wb"):
        pass
    with SnapshotArena.create(64, 1, prefix="fermoetest") as live:
        removed = SnapshotArena.remove_stale("fermoetest")
        assert stale in removed and live.name not in removed
        assert shm_exists(live.name) and not shm_exists(stale)


def test_decode_snapshots_are_adopted_under_the_tokens_they_hold():
    """Slots reserved for a decoding sequence: each one written is cached under the key of
    the tokens there (block or end entry); a duplicate frees its slot; unwritten ones
    come back."""
    idx = SnapshotIndex(n_slots=6, block=4)
    tokens = list(range(1, 20))
    idx.commit(idx.plan(tokens[:6], 0))                 # a prompt of 6: block 4 and end 6
    slots = idx.reserve(4)
    assert len(slots) == 4 and idx.stats()["free_slots"] == 0
    idx.check_invariants()
    assert idx.adopt(slots[0], tokens[:8])               # a block boundary while decoding
    assert idx.adopt(slots[1], tokens[:11])              # where it ended
    assert not idx.adopt(slots[2], tokens[:8])           # written again (a replay): the slot is free
    idx.unreserve(slots[3:])
    idx.check_invariants()
    assert idx.cached(tokens[:11] + [99, 98]) == 11 and idx.stats()["free_slots"] == 2
    resume = idx.lookup(tokens[:11] + [99])
    assert [e.position for e in resume.entries] == [4, 8, 11]
    idx.release(resume)
    with pytest.raises(KeyError):
        idx.unreserve([slots[0]])                          # adopted: no longer reserved
    more = idx.reserve(10)                                 # the free slots, then every unpinned entry evicted
    assert len(more) == 6 and idx.stats()["entries"] == 0
    idx.check_invariants()


def test_marks_inside_a_prompt_are_snapshots_a_diverging_prompt_resumes_from():
    """A chat's turn starts (marks) get end entries of their own: a prompt that shares
    the tokens only up to one of them resumes there, not at the block before."""
    idx = SnapshotIndex(n_slots=16, block=4)
    prompt = list(range(1, 15))                            # 14 tokens; marks at 6 and 9
    planned = idx.plan(prompt, 0, marks=[6, 9, 8, 0, 14, 20])
    assert [p.position for p in planned] == [4, 6, 8, 9, 12, 14]     # aligned and outside ones not doubled
    idx.commit(planned)
    idx.check_invariants()
    rewritten = prompt[:9] + [99, 98, 97]                  # the same up to the second mark
    assert idx.cached(rewritten) == 9
    assert idx.cached(prompt[:7] + [99]) == 6


# ---- two pools: KV slots and state slots ----------------------------------------------
def test_a_long_prompts_states_go_to_its_resume_points_only():
    """Its end, its marks and its last block boundary take a state; the other boundaries
    only while one is free, deepest first: the rest are KV links of the chain."""
    idx = SnapshotIndex(32, block=4, n_state_slots=4)
    prompt = list(range(1, 31))                            # 7 blocks and an end at 30; a mark at 13
    planned = idx.plan(prompt, 0, marks=[13])
    assert [p.position for p in planned] == [4, 8, 12, 13, 16, 20, 24, 28, 30]
    assert [p.position for p in planned if p.state >= 0] == [13, 24, 28, 30]
    idx.commit(planned)
    idx.check_invariants()
    assert idx.stats()["states"] == 4 and idx.stats()["free_state_slots"] == 0
    assert idx.cached(prompt[:22] + [99]) == 13            # diverging at 22: the mark, not a link
    assert idx.cached(prompt + [99]) == 30


def test_evicting_a_state_keeps_the_kv_chain_for_a_deeper_resume():
    """Block entries that lose their states stay as KV links: an end entry past them still
    resumes from the whole chain."""
    idx = SnapshotIndex(16, block=4, n_state_slots=3)
    a = list(range(1, 15))                                 # blocks 4, 8, 12 and its end 14
    cache(idx, a)                                          # states at 14, 12 and (the free one) 8
    assert lookup_position(idx, a + [99]) == 14            # its end resumed: the most protected state
    eight, twelve = idx.chain_keys(a)[1:3]
    assert eight in idx._states and twelve in idx._states
    cache(idx, [50, 51, 52, 53, 54, 55])                   # another prompt takes two states
    idx.check_invariants()
    assert idx.stats()["state_evictions"] == 2 and idx.stats()["entries"] == 6
    assert twelve in idx._entries and twelve not in idx._states and eight not in idx._states
    res = idx.lookup(a + [99, 98])
    assert res.position == 14 and [e.position for e in res.entries] == [4, 8, 12, 14]
    assert res.state == idx._states[res.end.key]
    idx.release(res)
    assert idx.cached(a[:12] + [99]) == 0                  # at 12 itself there is nothing to resume


def test_an_end_entry_losing_its_state_disappears():
    """An end entry is useless without its state: it goes whole, its KV slot freed; the
    block entries before it stay."""
    idx = SnapshotIndex(16, block=4, n_state_slots=2)
    a = [1, 2, 3, 4, 5, 6]
    cache(idx, a)                                          # block 4 and end 6: both with a state
    free = idx.stats()["free_slots"]
    cache(idx, [7, 8, 9, 10, 11, 12])                      # two more states: both of a's go
    idx.check_invariants()
    assert idx.end_key(a) not in idx._entries and idx.chain_keys(a)[0] in idx._entries
    assert idx.stats()["free_slots"] == free - 2 + 1       # b's two slots, a's end slot back
    assert idx.cached(a) == 0 and idx.stats()["state_evictions"] == 2


def test_a_long_one_off_prompt_keeps_other_conversations_resume_points():
    """A one-off prompt of twenty blocks takes one state, at its end (evicting the least
    useful one: a block's no lookup resumed from), not one a block: the resume points of
    two conversations before it stay."""
    idx = SnapshotIndex(64, block=4, n_state_slots=6)
    talks = [[1, 2] * 5, [3, 4] * 5]
    for talk in talks:
        cache(idx, talk)                                   # states at 4, 8 and 10: all six taken
        assert lookup_position(idx, talk + [9]) == 10
    cache(idx, list(range(100, 180)))                      # 80 tokens
    idx.check_invariants()
    assert idx.stats()["state_evictions"] == 1 and idx.stats()["states"] == 6
    assert [idx.cached(talk + [9]) for talk in talks] == [10, 10]
    assert idx.cached(list(range(100, 180)) + [9]) == 80


def _conversation(idx: SnapshotIndex, turns: int, block: int) -> list[int]:
    """A chat of `turns` turns, each prompt the last one, its answer and a new message,
    served as the coordinator does (lookup, plan with the turn's start as a mark, the
    answer's end adopted from a decode pair): the cached position of each turn's prompt."""
    rng = random.Random(7)
    history, cached = [], []
    for _ in range(turns):
        mark = len(history)
        prompt = history + [rng.randrange(1000) for _ in range(3 * block + 1)]
        res = idx.lookup(prompt)
        cached.append(res.position if res else 0)
        idx.commit(idx.plan(prompt, cached[-1], marks=[mark]))
        answer = prompt + [rng.randrange(1000) for _ in range(block - 1)]     # to the next block boundary
        pairs = idx.reserve(1)
        if pairs:
            idx.adopt(pairs[0], answer)
        idx.release(res)
        idx.check_invariants()
        history = answer
    return cached


def test_the_same_bytes_hold_a_far_longer_conversation():
    """A budget of 16 whole snapshots (a state and a block's KV each, a state 13 times a
    block's KV as on the full-size model) split into the two pools: a conversation of 30
    turns (120 blocks) still resumes each turn at the last one's answer, where 16
    whole snapshots lose it past 16 blocks."""
    from coordinator.memory import snapshot_pools
    block, kv, state = 4, 1, 13
    n_kv, n_states = snapshot_pools(16 * (kv + state), kv, state)
    assert (n_kv, n_states) == (172, 4)
    whole = _conversation(SnapshotIndex(16, block=block), 30, block)
    split = _conversation(SnapshotIndex(n_kv, block=block, n_state_slots=n_states), 30, block)
    # each turn's prompt: the last turn's answer (its end cached) and 3 blocks and a token more
    ends = [0] + [(t + 1) * 4 * block for t in range(29)]
    assert split == ends
    assert whole[:5] == ends[:5] and max(whole) == 16 * block and ends[-1] > 7 * 16 * block


def test_a_decoding_sequence_keeps_a_state_for_its_end_and_links_its_boundaries():
    """Decode pairs: the first with a state (evicting one), the others with one if free or
    a block entry's no lookup resumed from, else KV links (state -1) for the block
    boundaries the generation crosses; a link is adopted on a boundary only, and the
    replacement pair of a sequence that holds its end's takes no state by eviction."""
    idx = SnapshotIndex(16, block=4, n_state_slots=3)
    cache(idx, [9, 9, 9, 9, 9, 9])                         # states at 4 and 6: one free
    assert lookup_position(idx, [9] * 7) == 6              # the end resumed from: kept
    pairs = idx.reserve(3)                                 # the free state, block 4's, then none
    assert [s >= 0 for _, s in pairs] == [True, True, False] and idx.stats()["state_evictions"] == 1
    assert idx.cached([9] * 5) == 0 and idx.cached([9] * 7) == 6
    tokens = list(range(1, 20))
    assert idx.adopt(pairs[2], tokens[:4])                 # a boundary: a KV link
    assert idx.adopt(pairs[1], tokens[:8])                 # a boundary, with a state
    more = idx.reserve(2, end=False)                       # none free: links only
    assert [s for _, s in more] == [-1, -1] and idx.stats()["state_evictions"] == 1
    assert not idx.adopt(more[0], tokens[:9])              # no state, not a boundary: useless
    assert idx.adopt(pairs[0], tokens[:10])                # the end, after the chain's blocks 4 and 8
    idx.unreserve(more[1:])
    idx.check_invariants()
    assert [idx.cached(tokens[:n] + [99]) for n in (5, 9, 10)] == [0, 8, 10]
    assert idx.cached([9] * 7) == 6 and idx.stats()["free_state_slots"] == 0
    none = SnapshotIndex(4, block=4, n_state_slots=1)
    res = none.lookup(cache(none, [1, 2, 3]) and [1, 2, 3])
    assert res is not None and none.reserve(2) == []       # the one state pinned: no end, no pairs
    none.release(res)
    none.check_invariants()


def test_a_cached_block_without_its_state_gets_a_state_only_snapshot():
    """A prompt ending on a block boundary whose KV is cached but whose state was evicted
    plans a state alone there (no KV slot), pinning the entry until written; committed, the
    prompt resumes at its end."""
    idx = SnapshotIndex(16, block=4, n_state_slots=2)
    a = list(range(1, 9))
    cache(idx, a)                                          # blocks 4 and 8, both with a state
    cache(idx, [50, 51, 52, 53, 54, 55])                   # takes both states
    assert idx.cached(a) == 0 and idx.chain_keys(a)[1] in idx._entries
    free = idx.stats()["free_slots"]
    (p,) = idx.plan(a, 0)
    assert (p.slot, p.position) == (-1, 8) and p.state >= 0 and p.key == idx.chain_keys(a)[1]
    # no KV slot taken; the end entry whose state it took went whole
    assert (idx.stats()["pinned"], idx.stats()["writing"], idx.stats()["free_slots"]) == (1, 0, free + 1)
    cache(idx, list(range(100, 140)))                      # evicting KV: never the pinned entry
    idx.check_invariants()
    assert p.key in idx._entries
    idx.commit(p)
    idx.check_invariants()
    assert idx.cached(a) == 8 and idx.cached(a + [1]) == 8
    assert idx.plan(a, 0) == []                            # nothing left to write


def _agent_steps(idx: SnapshotIndex, steps: int, block: int, keep: bool) -> tuple[list[int], list[int]]:
    """An agent's turns after one user message: each prompt is the last one, its answer and
    a tool result, marked at its own turn start and (keep=True, as the coordinator does)
    at the first answer's start. Returns that first answer's start and the prompt."""
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(2 * block + 3)]   # system and user message
    first_answer = len(prompt)
    for _ in range(steps):                 # served as the coordinator serves them
        res = idx.lookup(prompt)
        marks = [len(prompt)] + ([first_answer] if keep else [])
        idx.keep(prompt, marks)
        pairs = idx.reserve(2)
        idx.commit(idx.plan(prompt, res.position if res else 0, marks=marks))
        answer = prompt + [rng.randrange(1000) for _ in range(block + 2)]
        if pairs:
            idx.adopt(pairs[0], answer)
            idx.unreserve(pairs[1:])
        idx.release(res)
        idx.check_invariants()
        prompt = answer + [rng.randrange(1000) for _ in range(block)]      # the tool's result
    return first_answer, prompt


@pytest.mark.parametrize("keep", [True, False])
def test_the_first_answers_start_outlives_many_agent_steps_when_marked_again(keep):
    """A new user message makes the template rewrite every answer since the last one from
    the first answer's first token: its snapshot must outlive the agent's steps between.
    Marked again in each step's prompt it is kept (as resumed from); marked once, the few
    state slots of a long agent loop evict it."""
    idx = SnapshotIndex(256, block=4, n_state_slots=6)
    first_answer, prompt = _agent_steps(idx, 12, 4, keep)
    rewritten = prompt[:first_answer] + [7777, 7778]        # the reasoning dropped from there on
    if keep:
        assert idx.cached(rewritten) == first_answer
    else:
        assert idx.cached(rewritten) < first_answer



def _served_turn(idx: SnapshotIndex, prompt: list[int], marks: list[int], answer: list[int]) -> int:
    """A prompt served as the coordinator and a CPU worker serve it (coordinator/daemon.py
    assign, cpu_worker/worker.py): lookup, keep the marks passed, reserve the decode pairs,
    plan and write the prompt's snapshots; then the answer's, into the pairs (a block
    boundary into a second pair with a state, else a link; the end into one with a
    state). The position the prompt resumed from."""
    block = idx.block
    res = idx.lookup(prompt)
    idx.keep(prompt, marks)
    pairs = idx.reserve(min(4, (len(answer) - len(prompt)) // block + 2))
    idx.commit(idx.plan(prompt, res.position if res else 0, marks))
    for n in range(len(prompt) + 1, len(answer) + 1):
        with_state, links = [p for p in pairs if p[1] >= 0], [p for p in pairs if p[1] < 0]
        pair = None
        if n % block == 0:
            pair = with_state[0] if len(with_state) >= 2 else links[0] if links and with_state else None
            if pair is None:
                break                                   # a gap: nothing after it could be resumed
        elif n == len(answer) and with_state:
            pair = with_state[0]
        if pair is not None:
            pairs.remove(pair)
            idx.adopt(pair, answer[:n])
    idx.unreserve(pairs)
    idx.release(res)
    idx.check_invariants()
    return res.position if res else 0


def test_a_kept_turn_start_keeps_its_state_in_a_small_state_pool():
    """Faults guarded: the state of a turn start that later prompts mark again evicted
    by a prompt's own snapshots (plan not holding it out of the states' LRU), or by its
    decode pairs (not kept before they are reserved), or left among the states no client
    resumed from (evicted first there, as the oldest), or not kept at all. Four state
    slots; an agent's twelve steps after one user message, each resumed from the last
    answer's end (never from the turn start), each wanting states for its end, its last
    block boundary and its answer's end; then four one-off prompts of other clients taking
    two states each. The prompt rewritten after the first answer's start resumes there."""
    idx, block, rng = SnapshotIndex(256, block=4, n_state_slots=4), 4, random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(2 * block + 3)]       # system and user message
    first_answer, resumed = len(prompt), []
    for _ in range(12):
        answer = prompt + [rng.randrange(1000) for _ in range(block + 2)]
        resumed.append(_served_turn(idx, prompt, [first_answer, len(prompt)], answer))
        prompt = answer + [rng.randrange(1000) for _ in range(block)]    # the tool's result
    assert resumed == [0] + [17 + 10 * i for i in range(11)]             # each at the last answer's end
    evictions = idx.stats()["state_evictions"]
    for i in range(4):
        cache(idx, [2000 + 10 * i + j for j in range(6)])               # a block boundary and an end
        idx.check_invariants()
    assert idx.stats()["state_evictions"] - evictions == 8 and idx.stats()["free_state_slots"] == 0
    res = idx.lookup(prompt[:first_answer] + [7777, 7778])
    assert res is not None, "the kept turn start's state was evicted"
    assert (res.position, res.end.position, first_answer) == (11, 11, 11)
    assert res.state == idx._states[idx.end_key(prompt[:11])]
    idx.release(res)


# ---- restore (entries brought back from the disk tier) ------------------------------------------------
def _chain_of(idx: SnapshotIndex, tokens) -> list[tuple[bytes, bytes | None, int]]:
    """(key, parent, position) of tokens' block entries, then of its end entry if unaligned."""
    keys = idx.chain_keys(tokens)
    chain = [(k, keys[i - 1] if i else None, (i + 1) * idx.block) for i, k in enumerate(keys)]
    if len(tokens) % idx.block:
        chain.append((idx.end_key(tokens), keys[-1] if keys else None, len(tokens)))
    return chain


def test_restore_makes_a_chain_resumable_at_its_last_entry_only():
    """Guards: restored links given states (garbage: their state bytes were never written),
    the last entry left without one (nothing to resume from), or the plans' positions and
    parents not the chain's (a lookup would not find them)."""
    idx = SnapshotIndex(8, block=4, n_state_slots=2)
    tokens = list(range(10))
    planned = idx.restore(_chain_of(idx, tokens))
    assert [(p.position, p.state >= 0) for p in planned] == [(4, False), (8, False), (10, True)]
    assert lookup_position(idx, tokens + [99]) == 0              # invisible until committed
    idx.commit(planned)
    assert lookup_position(idx, tokens + [99]) == 10
    assert lookup_position(idx, tokens[:9]) == 0                 # the links have no state
    idx.check_invariants()


def test_restore_fills_a_gap_and_gives_a_cached_last_entry_a_state():
    """Guards: cached entries planned again (a slot leaked, or a pinned one overwritten), or a
    cached block entry without a state left so (the chain restored, nothing to resume from)."""
    idx = SnapshotIndex(8, block=4, n_state_slots=4)
    tokens = list(range(12))
    cache(idx, tokens[:4])                                       # block 1, with a state
    chain = _chain_of(idx, tokens)
    planned = idx.restore(chain)
    assert [(p.position, p.slot >= 0, p.state >= 0) for p in planned] == [(8, True, False), (12, True, True)]
    idx.commit(planned)
    assert lookup_position(idx, tokens) == 12
    idx.check_invariants()
    # the chain's cached last entry is a link (no state): it takes a state alone
    idx2 = SnapshotIndex(8, block=4, n_state_slots=1)
    cache(idx2, tokens)                                          # entries 4, 8, 12: the one state at 12
    planned = idx2.restore(_chain_of(idx2, tokens[:8]))
    assert [(p.position, p.slot, p.state >= 0) for p in planned] == [(8, -1, True)]
    idx2.commit(planned)
    assert lookup_position(idx2, tokens[:8]) == 8 and lookup_position(idx2, tokens) == 8   # 12's state went
    idx2.check_invariants()


def test_restore_is_all_or_nothing_and_evicts_others_not_its_own():
    """Guards: half a chain restored when the store is full (a gap: useless, and slots lost),
    or the chain's own cached entries evicted to make room for the rest of it."""
    idx = SnapshotIndex(3, block=4, n_state_slots=1)
    tokens = list(range(12))
    cache(idx, tokens[:4])                                       # the chain's first block
    assert idx.restore(_chain_of(idx, list(range(100, 116)))) == []   # 4 entries, 3 slots: nothing
    assert idx.stats()["free_slots"] == 2 and lookup_position(idx, tokens[:4]) == 4
    other = list(range(50, 58))
    cache(idx, other)                                            # 2 more entries: the store is full
    planned = idx.restore(_chain_of(idx, tokens))
    assert [p.position for p in planned] == [8, 12]              # evicted `other`, kept block 1
    idx.commit(planned)
    assert lookup_position(idx, tokens) == 12 and lookup_position(idx, other) == 0
    idx.check_invariants()
