"""coordinator/snapshots.py's restore() (entries brought back from the disk tier), keep(), the
accessors and stats(), compared exactly: what is refused and what it leaves untouched, the
state-only plan of a cached last entry, the chain's own entries kept out of eviction and put
back, the turn start kept in its new tier. The index's lookups, plans and eviction are tested
in test_snapshots.py."""
import pytest

from coordinator.snapshots import Entry, Planned, SnapshotIndex
from tests.support.deadline import deadline


@pytest.fixture(autouse=True)
def _fail_fast_if_the_index_loops():
    """A chain whose parents loop would make commit's walk up the chain spin: fail in 30 s
    naming that, instead of hanging (each test takes well under a second)."""
    with deadline(30, "an index walk that never ends: a chain's parents form a loop?"):
        yield


def _chain_of(idx, tokens):
    """(key, parent, position) of tokens' block entries, then of its end entry if unaligned."""
    keys = idx.chain_keys(tokens)
    chain = [(k, keys[i - 1] if i else None, (i + 1) * idx.block) for i, k in enumerate(keys)]
    if len(tokens) % idx.block:
        chain.append((idx.end_key(tokens), keys[-1] if keys else None, len(tokens)))
    return chain


def _cache(idx, tokens, marks=()):
    planned = idx.plan(tokens, 0, marks)
    idx.commit(planned)
    return planned


def _position(idx, tokens):
    res = idx.lookup(tokens, counted=False)
    idx.release(res)
    return res.position if res else 0


def test_restore_refuses_an_empty_chain_and_one_being_written():
    """Fault guarded: a chain of which an entry is being written planned again (two writers of
    one key), or an empty chain read past its end."""
    idx = SnapshotIndex(8, block=4)
    tokens = list(range(10))
    assert idx.restore([]) == []
    pending = idx.plan(tokens, 0)
    assert idx.restore(_chain_of(idx, tokens)) == [] and idx.stats()["free_slots"] == 5
    idx.commit(pending)
    idx.check_invariants()


def test_restore_of_a_chain_cached_whole_with_its_state_plans_nothing():
    """Fault guarded: a second state given to a last entry that has one."""
    idx = SnapshotIndex(8, block=4)
    tokens = list(range(10))
    _cache(idx, tokens)
    assert idx.restore(_chain_of(idx, tokens)) == []
    idx.check_invariants()


def test_restore_without_a_state_to_give_frees_everything_it_took():
    """All or nothing: no state slot can be had (all pinned), so the plan is dropped and its KV
    slots (slot 0 among them) go back (fault: the chain restored without a state, or slots lost)."""
    idx = SnapshotIndex(6, block=4, n_state_slots=1)
    _cache(idx, [7, 7])                                          # the one state, then pinned
    res = idx.lookup([7, 7])
    tokens = list(range(10))
    before = idx.stats()
    assert idx.restore(_chain_of(idx, tokens)) == []
    assert idx.stats() == before
    idx.check_invariants()
    idx.release(res)
    idx = SnapshotIndex(3, block=4, n_state_slots=0)
    assert idx.restore(_chain_of(idx, list(range(8)))) == [] and idx.stats()["free_slots"] == 3
    idx.check_invariants()


def test_restore_that_cannot_fit_evicts_nothing():
    """Fault guarded: others evicted for a chain that then fails (the chain's own held entries
    counted as room)."""
    idx = SnapshotIndex(3, block=4)
    tokens = list(range(16))
    _cache(idx, tokens[:4])
    other = list(range(50, 58))
    _cache(idx, other)                                           # full: 1 own entry, 2 others
    assert idx.restore(_chain_of(idx, tokens)) == []             # 3 missing, room for 2
    assert _position(idx, other) == 8 and idx.stats()["evictions"] == 0
    idx.check_invariants()


def test_restore_keeps_its_own_oldest_entry_and_puts_it_back():
    """The chain's cached first block is the least recently used, yet others are evicted (fault:
    it left in the eviction order and evicted, a gap); it is evictable again afterwards."""
    idx = SnapshotIndex(3, block=4)
    tokens = list(range(12))
    (own,) = _cache(idx, tokens[:4])
    _cache(idx, list(range(50, 58)))
    planned = idx.restore(_chain_of(idx, tokens))
    assert [(p.position, p.state >= 0) for p in planned] == [(8, False), (12, True)]
    assert idx.entry(own.key) == Entry(own.key, own.slot, 4, None)
    idx.check_invariants()
    idx.commit(planned)
    assert _position(idx, tokens) == 12
    idx.check_invariants()


def test_restore_gives_a_cached_link_its_state_alone():
    """The plan of a cached last entry without a state, exactly: no KV slot, the chain's
    position and parent (fault: another entry's position or parent in it)."""
    idx = SnapshotIndex(8, block=4, n_state_slots=1)
    tokens = list(range(12))
    _cache(idx, tokens)                                          # 4, 8 links; 12 has the state
    keys = idx.chain_keys(tokens)
    chain = _chain_of(idx, tokens[:8])
    assert idx.restore(chain) == [Planned(keys[1], -1, 8, keys[0], 0)]
    idx.check_invariants()                                       # the link is pinned, not evictable


def test_restore_gives_the_last_of_a_longer_chain_its_state_alone():
    """The state-only plan takes the chain's last entry's position and parent, not the second
    one's (fault: `chain[1]` for `chain[-1]`, the same entry in a chain of two)."""
    idx = SnapshotIndex(8, block=4, n_state_slots=1)
    tokens = list(range(16))
    _cache(idx, tokens)                                          # 4, 8, 12 links; 16 has the state
    keys = idx.chain_keys(tokens)
    chain = _chain_of(idx, tokens[:12])
    assert len(chain) == 3
    assert idx.restore(chain) == [Planned(keys[2], -1, 12, keys[1], 0)]
    idx.check_invariants()


def test_check_invariants_catches_a_planned_entry_made_visible():
    """Fault guarded: check_invariants passing an index where an entry still being written is
    already visible to lookups (its KV read before it is there)."""
    import dataclasses
    idx = SnapshotIndex(8, block=4)
    (p,) = idx.plan(list(range(4)), 0)
    idx.check_invariants()
    slot = idx._free.pop()                                       # the entry needs a slot of its own
    idx._entries[p.key] = Entry(p.key, slot, 4, None)
    idx._lru.add(p.key, idx._tier(p.key))
    with pytest.raises(AssertionError, match="^a planned entry is visible$"):
        idx.check_invariants()


def test_check_invariants_catches_a_bad_state_only_plan():
    """Fault guarded: check_invariants passing a state-only plan that holds no state (or whose
    entry has one already), each condition checked, not just one of them."""
    import dataclasses
    idx = SnapshotIndex(8, block=4, n_state_slots=1)
    tokens = list(range(12))
    _cache(idx, tokens)
    keys = idx.chain_keys(tokens)
    (p,) = idx.restore(_chain_of(idx, tokens[:8]))
    idx.check_invariants()
    idx._planned[p.key] = dataclasses.replace(p, state=-1)       # its state slot given back
    idx._free_states.append(p.state)
    with pytest.raises(AssertionError, match="^a state-only plan of no cached entry without a state$"):
        idx.check_invariants()
    assert p.key == keys[1]


def test_keep_moves_a_turn_start_to_the_reused_tier():
    """Fault guarded: a kept turn start not put back in the order under its new tier."""
    idx = SnapshotIndex(8, block=4)
    tokens = list(range(10))
    _cache(idx, tokens, marks=[6])
    idx.keep(tokens, [6])
    idx.check_invariants()
    res = idx.lookup(tokens[:6], counted=False)                  # pinned: kept, not made evictable
    idx.keep(tokens, [6])
    idx.check_invariants()
    idx.release(res)


def test_accessors_and_stats():
    """Fault guarded: a stat misnamed or miscounted (reserved pairs are pinned), an accessor
    looking up the wrong key."""
    idx = SnapshotIndex(6, block=4, n_state_slots=3)
    assert idx.stats() == dict(slots=6, state_slots=3, block=4, entries=0, states=0, free_slots=6,
                               free_state_slots=3, pinned=0, writing=0, hits=0, misses=0, hit_tokens=0,
                               evictions=0, state_evictions=0, skipped=0, replays=0, replay_hit_tokens=0)
    (p,) = _cache(idx, [1, 2, 3, 4])
    assert idx.entry(p.key) == Entry(p.key, p.slot, 4, None) and idx.state_of(p.key) == p.state
    assert idx.entry(b"x" * 16) is None and idx.state_of(b"x" * 16) is None
    pairs = idx.reserve(2)                                       # the 2 free states
    pending = idx.plan([9, 9, 9, 9, 9], 0)                      # its end takes p's state
    s = idx.stats()
    assert (s["entries"], s["states"], s["state_evictions"], s["pinned"], s["writing"], s["free_slots"]) == (
        1, 0, 1, 4, 2, 1)
    idx.unreserve(pairs)
    idx.abort(pending)
    idx.check_invariants()


# ---- adopt, reserve, the eviction order -------------------------------------------------------
def test_adopt_names_the_parent_and_refuses_an_empty_sequence():
    """Fault guarded: an adopted block entry after two blocks without its parent (its chain
    broken), an empty sequence cached at position 0, or the refused pair's state slot 0 lost."""
    idx = SnapshotIndex(6, block=4, n_state_slots=3)
    tokens = list(range(10, 18))
    keys = idx.chain_keys(tokens)
    (pair,) = idx.reserve(1)
    assert pair == (0, 0) and idx.adopt(pair, []) is False
    assert (idx.stats()["free_slots"], idx.stats()["free_state_slots"]) == (6, 3)
    for n, parent in ((4, None), (8, keys[0])):
        (pair,) = idx.reserve(1)
        assert idx.adopt(pair, tokens[:n]) is True
        assert idx.entry(keys[n // 4 - 1]).parent == parent
    (pair,) = idx.reserve(1)
    assert idx.adopt(pair, [5]) is True and _position(idx, [5]) == 1      # one token: an end entry
    idx.check_invariants()


def test_adopt_gives_a_cached_link_state_slot_0():
    """A pair whose state is slot 0 gives a cached link its state (fault: slot 0 read as none)."""
    idx = SnapshotIndex(6, block=4, n_state_slots=1)
    tokens = list(range(12))
    _cache(idx, tokens)                                          # 4, 8 links; 12 has state 0
    (pair,) = idx.reserve(1)                                     # takes 12's state
    assert pair[1] == 0 and idx.adopt(pair, tokens[:8]) is True
    assert idx.state_of(idx.chain_keys(tokens)[1]) == 0 and _position(idx, tokens) == 8
    idx.check_invariants()


def test_reserves_more_pairs_take_block_states_only():
    """After the end's pair, a pair takes a state only from a block entry no lookup resumed
    from, never a one-off prompt's end (fault: the tiers ignored, another prompt's end evicted)."""
    idx = SnapshotIndex(8, block=4, n_state_slots=3)
    a, b = list(range(6)), [40, 41, 42]
    _cache(idx, a)                                               # 4: block state; 6: end state
    _cache(idx, b)                                               # 3: end state
    pairs = idx.reserve(2)
    assert [s >= 0 for _, s in pairs] == [True, True]
    assert _position(idx, b) == 3 and _position(idx, a) == 0     # a's end went first, then a's block state
    idx.check_invariants()


def test_an_empty_eviction_order_says_so():
    from coordinator.snapshots import _EvictionOrder
    with pytest.raises(KeyError, match="nothing to evict"):
        _EvictionOrder().pop_oldest()


def _corrupt(how):
    idx = SnapshotIndex(6, block=4, n_state_slots=4)
    (end,) = _cache(idx, [1, 2, 3])                              # an end entry with its state
    if how == "slot lost":
        idx._free.pop()
    elif how == "slot twice":
        idx._free[-1] = idx._free[0]
    elif how == "slot out of range":
        idx._free[-1] = 6
    elif how == "state lost":
        idx._free_states.pop()
    elif how == "state twice":
        idx._free_states[-1] = idx._free_states[0]
    elif how == "state out of range":
        idx._free_states[-1] = 4
    elif how == "state outlived":
        del idx._entries[end.key]
        idx._free.append(end.slot)
    elif how == "end without state":
        del idx._states[end.key]
        idx._free_states.append(end.state)
    elif how in ("reuse outlived", "resume outlived"):
        (idx._reused if how == "reuse outlived" else idx._resumed).add(b"x" * 16)
    elif how == "entry tier":
        idx._lru.add(end.key, 2)
    elif how == "state tier":
        idx._state_lru.add(end.key, 2)
    elif how == "ends index":
        idx._ends[b"x" * 16] = {1: 1}
    else:                                                        # corruptions of a pinned entry
        res = idx.lookup([1, 2, 3])
        if how == "pinned evictable":
            idx._lru.add(end.key, 0)
        elif how == "pinned state evictable":
            idx._state_lru.add(end.key, 0)
        elif how == "state pinned alone":
            del idx._pins[end.key]
            idx._lru.add(end.key, 2)
        elif how == "pinned changed":
            idx._entries[end.key] = Entry(end.key, end.slot, 3, b"x" * 16)
            idx._ends = {b"x" * 16: {3: 1}}
        elif how == "pinned state changed":
            idx._states[end.key] = idx._free_states.pop()
            idx._free_states.append(end.state)
        elif how == "pin count":
            idx._pins[end.key] += 1
        elif how == "state pin count":
            idx._state_pins[end.key] += 1
        assert res is not None
    return idx


@pytest.mark.parametrize("how, message", [
    ("slot lost", "^slots lost or duplicated"), ("slot twice", "^a slot is used twice"),
    ("slot out of range", "^$"), ("state lost", "^state slots lost or duplicated"),
    ("state twice", "^a state slot is used twice"), ("state out of range", "^$"),
    ("state outlived", "^a state outlived its entry"), ("end without state", "^an end entry without its state"),
    ("reuse outlived", "^a reuse mark outlived its entry"), ("resume outlived", "^a resume mark outlived its state"),
    ("entry tier", "^an entry in the wrong tier"), ("state tier", "^a state in the wrong tier"),
    ("ends index", "^end-entry index out of date"), ("pinned evictable", "^a pinned entry is evictable"),
    ("pinned state evictable", "^a pinned state is evictable"), ("state pinned alone", "^a state pinned without its entry"),
    ("pinned changed", "^a pinned entry changed"), ("pinned state changed", "^a pinned state changed"),
    ("pin count", "^pin counts disagree with live resumes"),
    ("state pin count", "^state pin counts disagree with live resumes"),
])
def test_check_invariants_names_what_is_broken(how, message):
    """The debugging check finds each corruption and says which (fault: a check that passes a
    slot id one past the end, or a message that names nothing)."""
    with pytest.raises(AssertionError, match=message):
        _corrupt(how).check_invariants()


def test_replays_are_counted_apart_and_summed():
    """Fault guarded: the replay counters set rather than added to."""
    idx = SnapshotIndex(6, block=4)
    _cache(idx, [1, 2, 3, 4, 5])
    for tokens in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 9], [8]):
        idx.release(idx.lookup(tokens, replay=True))
    s = idx.stats()
    assert (s["replays"], s["replay_hit_tokens"], s["hits"], s["misses"]) == (3, 9, 0, 0)


def test_a_second_release_names_the_resume():
    idx = SnapshotIndex(6, block=4)
    _cache(idx, [1, 2, 3])
    res = idx.lookup([1, 2, 3])
    idx.release(res)
    with pytest.raises(ValueError, match="^resume at position 3 was already released or does not come from "
                                         "this index$"):
        idx.release(res)


def test_hit_tokens_are_summed():
    idx = SnapshotIndex(6, block=4)
    _cache(idx, [1, 2, 3, 4, 5])
    for tokens in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 9]):
        idx.release(idx.lookup(tokens))
    assert (idx.stats()["hits"], idx.stats()["hit_tokens"]) == (2, 9)


def test_plan_refuses_a_start_past_the_tokens_naming_both():
    with pytest.raises(ValueError, match="^start 4 is outside the 3 tokens$"):
        SnapshotIndex(6, block=4).plan([1, 2, 3], 4)


def test_a_turn_start_at_the_resume_point_is_kept():
    """A mark exactly at `start` (the prompt resumes from it) is kept as resumed from (fault:
    only marks before `start` kept, the one a next turn rewrites after left to age out)."""
    idx = SnapshotIndex(8, block=4)
    tokens = list(range(10))
    _cache(idx, tokens[:6])
    key = idx.end_key(tokens[:6])
    assert idx._lru.tier_of(key) == 0
    idx.commit(idx.plan(tokens, 6, marks=[6]))
    assert idx._lru.tier_of(key) == 2 and idx._state_lru.tier_of(key) == 2
    idx.check_invariants()


def test_a_batch_naming_one_plan_twice_is_refused_whole():
    idx = SnapshotIndex(6, block=4)
    (p,) = idx.plan([1, 2, 3], 0)
    with pytest.raises(ValueError, match=r"is not a pending planned snapshot of this index \(committed or aborted "
                                         r"already\?\)$"):
        idx.commit([p, p])
    idx.commit(p)
    idx.check_invariants()


def test_plan_takes_nothing_at_or_before_its_start():
    """Fault guarded: the end or a mark at `start` itself planned (the prefill writes nothing
    there: a snapshot of state never computed)."""
    idx = SnapshotIndex(6, block=4)
    assert idx.plan([1, 2, 3], 3) == []
    assert [p.position for p in idx.plan(list(range(10)), 6, marks=[6, 9])] == [8, 9, 10]


def test_a_mark_in_the_first_block_is_found_by_its_prompt():
    """Fault guarded: a first-block mark's end entry keyed off another base than the empty
    prefix (never found)."""
    idx = SnapshotIndex(8, block=4)
    tokens = list(range(10))
    _cache(idx, tokens, marks=[2])
    assert _position(idx, tokens[:2] + [99]) == 2


def test_an_end_without_a_state_to_take_is_skipped_once():
    idx = SnapshotIndex(4, block=4, n_state_slots=0)
    assert idx.plan([1, 2, 3], 0) == []
    assert (idx.stats()["skipped"], idx.stats()["free_slots"]) == (1, 4)


def test_keep_ignores_marks_outside_the_tokens():
    """Fault guarded: a mark past the tokens (or at 0) looked up in a chain it is not in."""
    idx = SnapshotIndex(4, block=4)
    _cache(idx, [1, 2, 3])
    idx.keep([1, 2, 3], [0, 7, 9])
    idx.check_invariants()


def test_keep_reaches_a_mark_at_one_token_and_one_at_the_end():
    """Fault guarded: the bounds of the marks keep() takes (a mark at 1, in the first block,
    or at the tokens' very end left out)."""
    idx = SnapshotIndex(8, block=4)
    tokens = list(range(10))
    _cache(idx, tokens, marks=[1, 9])
    idx.keep(tokens[:9], [1, 9])
    assert [idx._lru.tier_of(idx.end_key(tokens[:m])) for m in (1, 9, 10)] == [2, 2, 0]
    idx.check_invariants()


def test_keys_are_the_documented_hashes():
    """chain key_i = H(key_{i-1} || block i), end key = H(key_k || b"end" || tail), blake2b of 16
    bytes over little-endian int32 tokens (fault: the end marker changed or dropped, which would
    also let chain and end keys meet)."""
    import hashlib
    import numpy as np

    def h(*parts):
        d = hashlib.blake2b(digest_size=16)
        for p in parts:
            d.update(p)
        return d.digest()
    idx = SnapshotIndex(4, block=2)
    b = lambda t: np.asarray(t, "<i4").tobytes()                  # noqa: E731
    k1 = h(b"", b([7, 8]))
    assert idx.chain_keys([7, 8, 9]) == [k1] and idx.end_key([7, 8, 9]) == h(k1, b"end", b([9]))
    assert idx.end_key([7]) == h(b"", b"end", b([7]))


def test_token_bytes_refuses_what_is_no_token_sequence_naming_it():
    from coordinator.snapshots import token_bytes
    import numpy as np
    assert token_bytes([]) == b"" and token_bytes(np.array([1, 2], np.uint16)) == b"\x01\x00\x00\x00\x02\x00\x00\x00"
    with pytest.raises(ValueError, match=r"^tokens must be a flat sequence of integers, got float64 with shape \(2,\)$"):
        token_bytes([1.0, 2.0])
    with pytest.raises(ValueError, match=r"^token ids must be in \[0, 2\*\*31\), got -1\.\.5$"):
        token_bytes([5, -1])


@pytest.mark.parametrize("args", [(-1, 4, None), (4, 4, -1), (4, 0, None)])
def test_a_bad_size_is_refused_naming_all_three(args):
    n_slots, block, n_state_slots = args
    with pytest.raises(ValueError, match=r"^need n_slots >= 0, n_state_slots >= 0 and block >= 1, got %d, %d, %d$"
                       % (n_slots, n_slots if n_state_slots is None else n_state_slots, block)):
        SnapshotIndex(n_slots, block, n_state_slots)
