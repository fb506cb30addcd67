"""The coordinator's index over the snapshot arena: which slots hold which prefix.

Pure policy: no sockets, no shared memory; it deals in slot numbers of a
shared/shm_arena.SnapshotArena and is not thread-safe (the coordinator's event
loop owns it).

Why snapshots: the Gated DeltaNet state is only valid at the end of a sequence, so
plain KV prefix caching cannot resume a prompt. We store states at positions instead.
Prompts are cut in blocks of `block` tokens; a snapshot at position p is a KV slot
with the KV of its own block (positions [block_start, p)) and, where p is a resume
point, a state slot with the recurrent state and the logits of position p-1
(shared/state.py writes them). Resuming at p needs the KV of every block before p but
the recurrent state at p only, and a state is far larger than a block's KV on the
models we run: so the two live in two pools of slots, and most entries of a long
prompt's chain are KV links without a state.

Keys (blake2b, 16-byte digests; tokens as little-endian int32):
    chain key_0 = b""                                   the empty prefix
    chain key_i = H(key_{i-1} || tokens of block i)     the prefix of i full blocks
    end key     = H(key_k || b"end" || tokens after block k)   an exact unaligned sequence
Equal prefixes give equal keys; different ones differ (chaining fixes the block split
and the input lengths differ mod 4, so chain and end keys never meet).

Resuming at p needs the chain entries of blocks 1..p//block (their KV) plus, when p is
not aligned, the end entry at p; the last of them must hold a state. A lookup takes the
deepest such point the prompt's cached chain reaches: a block entry with a state, or
an end entry (which always has one) after the chain's first k blocks.

Which snapshots get a state: the prompt's end, the marks (where a chat's turns begin),
the last block boundary of the prompt, and a decoding sequence's snapshots (its
generation's end) take one, evicting the least recently used state if none is free;
other block boundaries of a prompt only take a free one, so a long one-off prompt does
not flush the resume points of other conversations; the block boundaries a generation
crosses take a free one or one of a block entry no lookup resumed from (the spare states
prompts took), so the next turn resumes close to where a re-rendered answer diverges.
A cached block entry lacking its state gets one written (a "state only" plan) when it
is one of the first kind.

Life of a slot:
    free --plan--> planned (pinned, invisible to lookup) --commit--> cached (LRU)
                      \\--abort--> free
    free --reserve--> reserved (a decoding sequence's, key unknown) --adopt--> cached
                      \\--unreserve--> free
    cached --lookup--> pinned by a Resume --release--> cached, most recent
    cached, unpinned --evicted by plan--> removed from the index, then re-planned
A decoding sequence's snapshots are taken where its tokens are not known in advance
(block boundaries while it decodes, its final state): the worker gets (KV slot, state
slot) pairs to write, one with a state kept for the end (a boundary gets a state only
if one is free or held by a block entry no lookup resumed from), and the coordinator
adopts each written one under the key of the tokens it then holds. An entry (or its state) leaves the index before its slot is
handed out again, and pinned or planned slots are never evicted, so a lookup can never
return a reused slot. A Resume pins the KV of its every entry and the state of its last.

Eviction, two pools. A KV slot goes with its entry (and the entry's state with it),
least recently used within each tier, tiers in this order:
    0. end entries no client lookup has reused: the last snapshot of a one-off prompt
    1. block entries no client lookup has reused: shared by every extension of a prompt
    2. entries a client lookup has reused
so a stream of one-off short prompts recycles its own slots and never pushes out a
long prompt's blocks, and what was reused once (a system prompt, a conversation)
outlives what never was; a chain's parents are kept at least as recent as its children,
so chains are trimmed from the deep end. A state slot goes by its own LRU in the same
tiers, where "reused" means a client lookup resumed from that state: the entry then
stays as a KV link of its chain, except an end entry, which is useless without its
state and goes whole. A turn start a later prompt marks again (the coordinator names the
first answer after the last user message in every prompt until the next user message)
counts as resumed from, in both pools. A replay's lookup (a request restarted after its worker died)
reuses the request's own snapshots: it is counted apart and promotes nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from shared.state import DEFAULT_BLOCK

KEY_BYTES = 16


@dataclass(frozen=True)
class Entry:
    """A cached snapshot's KV slot (whether it has a state is the index's to say).
    parent = chain key of the block before this entry's own block (None when its block
    is the first)."""
    key: bytes
    slot: int
    position: int
    parent: bytes | None


@dataclass(frozen=True)
class Planned:
    """A snapshot to take during a prefill: the state at `position`, its block's KV into
    `slot` and its recurrent part into `state` (-1: none, a KV link of the chain; slot
    -1: the KV is cached already and only the state is written); then commit() it (or
    abort() if the write failed)."""
    key: bytes
    slot: int
    position: int
    parent: bytes | None
    state: int = -1


@dataclass
class _Wanted:
    """A snapshot SnapshotIndex.plan considers: its key, position and parent (as Planned's),
    whether it is a resume point (one that gets a state, evicting for it), and the KV slot
    it gets (-1: none yet, or a cached entry that only takes a state)."""
    key: bytes
    position: int
    parent: bytes | None
    resume_point: bool = False
    slot: int = -1


@dataclass(frozen=True)
class Resume:
    """Where a request can start: restore `entries` (chain blocks 1..k in order, then
    the end entry if any: the KV of each) and the state slot `state` of the last one,
    and prefill tokens[position:]. exact: position == len(tokens), the snapshot's logits
    give the first token. Its slots stay pinned until SnapshotIndex.release(resume)."""
    position: int
    exact: bool
    chain: tuple[Entry, ...]
    end: Entry | None
    state: int = -1
    ticket: int = field(compare=False, repr=False, default=0)

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self.chain + ((self.end,) if self.end is not None else ())


def token_bytes(tokens) -> bytes:
    """Token ids as little-endian int32 bytes (the hashed form); rejects non-ids."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a flat sequence of integers, got {arr.dtype} "
                         f"with shape {arr.shape}")
    if int(arr.min()) < 0 or int(arr.max()) >= 2**31:
        raise ValueError(f"token ids must be in [0, 2**31), got {int(arr.min())}..{int(arr.max())}")
    return arr.astype("<i4").tobytes()


def _hash(*parts) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


class SnapshotIndex:
    """Maps token prefixes to snapshot slots, with LRU eviction within n_slots KV slots
    and n_state_slots state slots (default: as many, so that every entry can have one)."""

    def __init__(self, n_slots: int, block: int = DEFAULT_BLOCK, n_state_slots: int | None = None):
        n_state_slots = n_slots if n_state_slots is None else n_state_slots
        if n_slots < 0 or n_state_slots < 0 or block < 1:
            raise ValueError(f"need n_slots >= 0, n_state_slots >= 0 and block >= 1, got {n_slots}, "
                             f"{n_state_slots}, {block}")
        self.n_slots = n_slots
        self.n_state_slots = n_state_slots
        self.block = block
        self._entries: dict[bytes, Entry] = {}            # committed, visible
        self._states: dict[bytes, int] = {}               # committed key -> its state slot, if it has one
        self._lru = _EvictionOrder()                     # committed and unpinned, by tier, oldest first
        self._state_lru = _EvictionOrder()               # keys with a state not pinned, by state tier
        self._reused: set[bytes] = set()                 # committed keys a client lookup returned
        self._resumed: set[bytes] = set()                # keys whose state a client lookup resumed from (or _keep)
        self._pins: dict[bytes, int] = {}                # committed key -> Resumes (and state-only plans) holding it
        self._state_pins: dict[bytes, int] = {}          # committed key -> Resumes holding its state
        self._planned: dict[bytes, Planned] = {}         # being written, pinned, invisible (state only: visible)
        self._planned_slots: dict[int, Planned] = {}
        self._ends: dict[bytes, dict[int, int]] = {}     # base chain key -> {tail length: count}
        self._resumes: dict[int, Resume] = {}
        self._tickets = itertools.count(1)
        self._free = list(range(n_slots - 1, -1, -1))   # pop() hands out slot 0 first
        self._free_states = list(range(n_state_slots - 1, -1, -1))
        self._reserved: set[tuple[int, int]] = set()     # (KV, state) handed to a decoding sequence, not yet written
        self._counts = dict(hits=0, misses=0, hit_tokens=0, evictions=0, state_evictions=0, skipped=0, replays=0,
                            replay_hit_tokens=0)

    # ---- keys ----------------------------------------------------------------
    def chain_keys(self, tokens) -> list[bytes]:
        """Keys of every full-block prefix of tokens (len(tokens) // block of them)."""
        return self._chain(token_bytes(tokens))

    def end_key(self, tokens) -> bytes:
        """Key of the exact sequence `tokens` (meant for lengths not a multiple of block)."""
        data = token_bytes(tokens)
        keys = self._chain(data)
        return self._end(keys[-1] if keys else b"", data, len(keys) * self.block, len(data) // 4)

    def _chain(self, data: bytes) -> list[bytes]:
        step = 4 * self.block
        view = memoryview(data)
        keys, prev = [], b""
        for i in range(len(data) // step):
            prev = _hash(prev, view[i * step:(i + 1) * step])
            keys.append(prev)
        return keys

    @staticmethod
    def _end(base: bytes, data: bytes, begin: int, stop: int) -> bytes:
        return _hash(base, b"end", memoryview(data)[4 * begin:4 * stop])

    # ---- lookup --------------------------------------------------------------
    def lookup(self, tokens, replay: bool = False, counted: bool = True) -> Resume | None:
        """The longest usable cached prefix of tokens, pinned until release(); None if none.
        replay: the lookup of a request restarted after its worker died, counted as
        `replays` and `replay_hit_tokens`, not as a hit or a miss, and promoting nothing.
        counted=False: a request's own snapshots handed from a GPU worker to a CPU worker,
        neither counted nor promoting anything."""
        position, n, keys, m, end = self._find(tokens)
        if counted and replay:
            self._counts["replays"] += 1
            self._counts["replay_hit_tokens"] += position
        elif counted and position == 0:
            self._counts["misses"] += 1
        elif counted:
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += position
        promote = counted and not replay            # a client's reuse protects what it reused
        if position == 0:
            return None
        chain = tuple(self._entries[k] for k in keys[:m])
        last = end if end is not None else chain[-1]
        resume = Resume(position, position == n, chain, end, self._states[last.key], next(self._tickets))
        for e in resume.entries:
            self._pin(e.key)
            if promote:
                self._reused.add(e.key)
        self._pin_state(last.key)
        if promote:
            self._resumed.add(last.key)
        self._resumes[resume.ticket] = resume
        return resume

    def cached(self, tokens) -> int:
        """The position lookup() would resume tokens from, without pinning or counting."""
        return self._find(tokens)[0]

    def _find(self, tokens):
        """(position, n tokens, the chain's keys, how many of them the resume takes, the
        end entry): the deepest point with a state the cached chain reaches."""
        data = token_bytes(tokens)
        n = len(data) // 4
        keys = self._chain(data)
        m = 0
        while m < len(keys) and keys[m] in self._entries:
            m += 1
        for k in range(m, -1, -1):
            if k * self.block < n:
                end = self._longest_end(keys[k - 1] if k else b"", data, k * self.block, n)
                if end is not None:
                    return end.position, n, keys, k, end
            if k and keys[k - 1] in self._states:
                return k * self.block, n, keys, k, None
        return 0, n, keys, 0, None

    def _longest_end(self, base: bytes, data: bytes, begin: int, n: int) -> Entry | None:
        # An end entry of a prefix of tokens that starts after the chain's first blocks:
        # the exact prompt, or a shorter one this prompt extends (the next chat turn).
        tails = self._ends.get(base)
        for r in sorted(tails or (), reverse=True):
            if begin + r <= n:
                entry = self._entries.get(self._end(base, data, begin, begin + r))
                if entry is not None:
                    return entry
        return None

    def release(self, resume: Resume | None) -> None:
        """Unpin a lookup's entries (None is accepted and ignored). Twice is an error."""
        if resume is None:
            return
        if self._resumes.pop(resume.ticket, None) is None:
            raise ValueError(f"resume at position {resume.position} was already released "
                             "or does not come from this index")
        self._unpin_state(resume.entries[-1].key)
        # Deepest first, so the chain's first blocks end up the most recent.
        for e in reversed(resume.entries):
            self._unpin(e.key)

    def _pin(self, key: bytes) -> None:
        _hold(self._pins, self._lru, key)

    def _unpin(self, key: bytes) -> None:
        _let_go(self._pins, self._lru, key, self._tier)

    def _pin_state(self, key: bytes) -> None:
        _hold(self._state_pins, self._state_lru, key)

    def _unpin_state(self, key: bytes) -> None:
        _let_go(self._state_pins, self._state_lru, key, self._state_tier)

    def _tier(self, key: bytes) -> int:
        """Eviction tier of a committed entry's KV (see the module's docstring)."""
        if key in self._reused:
            return 2
        return 1 if self._entries[key].position % self.block == 0 else 0

    def _state_tier(self, key: bytes) -> int:
        """Eviction tier of a committed entry's state."""
        if key in self._resumed:
            return 2
        return 1 if self._entries[key].position % self.block == 0 else 0

    # ---- writing -------------------------------------------------------------
    def plan(self, tokens, start: int, marks=()) -> list[Planned]:
        """Slots for the snapshots a prefill of tokens[start:] should take: each block
        boundary in (start, len], the unaligned end, and each of `marks` in (start, len)
        (where a chat's turns begin: the next turn may diverge right after one), unless
        cached or already being written; in position order. The end, the marks and the
        last block boundary get a state slot (a cached block entry there without one gets
        a state-only plan), other boundaries only a free one. A mark the prompt has already
        passed (at or before `start`) that is cached is kept as if a client had resumed
        from it (_keep): a turn start the coordinator names again is where a later turn's
        template may rewrite, however many turns on. Evicts least-recently-used
        unpinned entries (and states); when nothing more can be evicted the rest are
        skipped (a request never fails for lack of cache)."""
        data = token_bytes(tokens)
        n = len(data) // 4
        if not 0 <= start <= n:
            raise ValueError(f"start {start} is outside the {n} tokens")
        keys = self._chain(data)
        end = self._end(keys[-1] if keys else b"", data, len(keys) * self.block, n)
        wanted = self._wanted(data, keys, end, start, marks)
        kept = self._keep_marks(data, keys, [m for m in marks if m <= start])
        state_only = [w for w in wanted if w.resume_point and w.key in self._entries
                      and w.key not in self._states and w.key not in self._planned]
        wanted = [w for w in wanted if w.key not in self._entries and w.key not in self._planned]
        # This prompt's own cached snapshots must not be evicted to make room for its
        # later ones (a gap would make those useless): hold them out of the LRU, and the
        # states of its kept turn starts out of the states' LRU.
        held = [k for k in keys + [end] + kept if k in self._lru]
        held_states = [k for k in kept if k in self._state_lru]
        for k in held:
            self._lru.remove(k)
        for k in held_states:
            self._state_lru.remove(k)
        planned = self._with_states(self._with_slots(wanted) + state_only)
        self._pending(planned)
        for k in reversed(held):
            if k in self._entries and k not in self._pins:
                self._lru.add(k, self._tier(k))
        for k in held_states:
            self._state_lru.add(k, self._state_tier(k))
        return planned

    def _wanted(self, data: bytes, keys: list[bytes], end: bytes, start: int, marks) -> list["_Wanted"]:
        """The snapshots a prefill of the tokens of `data` (chain keys `keys`, end key `end`)
        from `start` could take, in position order: the block boundaries after `start`, the
        unaligned end, the unaligned marks in (start, n). The end, the marks and the last
        block boundary are resume points."""
        n = len(data) // 4
        resume_points = {n, len(keys) * self.block}
        wanted = [_Wanted(keys[i - 1], i * self.block, keys[i - 2] if i >= 2 else None)
                  for i in range(start // self.block + 1, len(keys) + 1)]
        if n % self.block and n > start:
            wanted.append(_Wanted(end, n, keys[-1] if keys else None))
        for m in sorted({int(m) for m in marks if start < m < n and m % self.block}):
            base = m // self.block                 # the mark's own end entry, after `base` full blocks
            wanted.append(_Wanted(self._end(keys[base - 1] if base else b"", data, base * self.block, m), m,
                                  keys[base - 1] if base else None))
            resume_points.add(m)
        for w in wanted:
            w.resume_point = w.position in resume_points
        return sorted(wanted, key=lambda w: w.position)      # the prompt's end last

    def _with_slots(self, wanted: list["_Wanted"]) -> list["_Wanted"]:
        """A KV slot for each, in order, evicting; those left when none can be had are skipped."""
        taken = []
        for w in wanted:
            slot = self._take_slot()
            if slot is None:
                self._counts["skipped"] += len(wanted) - len(taken)
                break
            w.slot = slot
            taken.append(w)
        return taken

    def _with_states(self, wanted: list["_Wanted"]) -> list[Planned]:
        """The plans, in position order: a state for each resume point first (deepest first),
        evicting; then for the other block boundaries (deepest first) while one is free. An
        end entry, or a state-only plan, that gets none is dropped (useless without it)."""
        planned = []
        for w in sorted(wanted, key=lambda w: (not w.resume_point, -w.position)):
            state = self._take_state(evict=w.resume_point)
            if state is None and (w.slot < 0 or w.position % self.block):
                if w.slot >= 0:                     # an end entry is useless without its state
                    self._free.append(w.slot)
                    self._counts["skipped"] += 1
                continue
            planned.append(Planned(w.key, w.slot, w.position, w.parent, -1 if state is None else state))
        return sorted(planned, key=lambda p: p.position)

    def _pending(self, planned: list[Planned]) -> None:
        """Plans handed out: pinned until commit() or abort()."""
        for p in planned:
            self._planned[p.key] = p
            if p.slot >= 0:
                self._planned_slots[p.slot] = p
            else:
                self._pin(p.key)                    # the cached KV it gives a state to stays

    def keep(self, tokens, marks) -> None:
        """Keep the cached snapshots at these turn starts of tokens as ones a client resumed
        from (see plan): called before a request's decode pairs are reserved, which may evict."""
        data = token_bytes(tokens)
        self._keep_marks(data, self._chain(data), marks)

    def _keep_marks(self, data: bytes, keys: list[bytes], marks) -> list[bytes]:
        """_keep the cached end entries at `marks` (positions in the tokens of `data`, whose
        chain keys are `keys`); returns their keys."""
        kept = []
        for m in sorted({int(m) for m in marks if 0 < m <= len(data) // 4 and m % self.block}):
            base = m // self.block
            key = self._end(keys[base - 1] if base else b"", data, base * self.block, m)
            if key in self._entries:
                self._keep(key)
                kept.append(key)
        return kept

    def _keep(self, key: bytes) -> None:
        """A later prompt marks this snapshot as a turn start again (where a template may
        rewrite what follows, however many turns later): keep it, KV and state, as one a
        client resumed from, and make it the most recent. Nothing if it is not cached."""
        if key not in self._entries:
            return
        self._reused.add(key)
        self._resumed.add(key)                     # an end entry's state is there while it is
        if key in self._lru:
            self._lru.add(key, self._tier(key))
        if key in self._state_lru:
            self._state_lru.add(key, self._state_tier(key))

    def reserve(self, n: int, end: bool = True) -> list[tuple[int, int]]:
        """Up to n (KV slot, state slot) pairs for a decoding sequence's snapshots, evicting
        as plan() does: the first with a state for where the generation ends, the others,
        for the block boundaries the generation crosses, with a state if one is free or held
        by a block entry no lookup resumed from (else -1: a KV link). end=False: more pairs
        for a sequence that holds its end's already, a state only if one is free (one taken
        from a block entry could be the state it just wrote). None when the end's state
        cannot be had."""
        pairs = []
        while len(pairs) < n and (slot := self._take_slot()) is not None:
            state = self._take_state(evict=end, tiers=None if not pairs else (1,))
            if state is None and end and not pairs:
                self._free.append(slot)
                break
            pairs.append((slot, -1 if state is None else state))
        self._reserved.update(pairs)
        return pairs

    def unreserve(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Reserved pairs not written after all: free again."""
        for pair in pairs:
            self._reserved.remove(tuple(pair))
            self._free.append(pair[0])
            if pair[1] >= 0:
                self._free_states.append(pair[1])

    def adopt(self, pair: tuple[int, int], tokens) -> bool:
        """A reserved (KV slot, state slot) pair now holds the snapshot at the end of
        `tokens`: cache it under their key (a block entry on a block boundary, else an end
        entry; a pair without a state, a KV link, on a block boundary only); a cached block
        entry without a state takes the state alone. False, and the slots freed, if that key
        is cached (with a state, for a pair with one) or being written already, or an end
        entry would have no state."""
        pair = tuple(pair)
        self._reserved.remove(pair)
        slot, state = pair
        data = token_bytes(tokens)
        n = len(data) // 4
        keys = self._chain(data)
        if n % self.block == 0:
            key, parent = (keys[-1], keys[-2] if len(keys) >= 2 else None) if keys else (b"", None)
        else:
            key, parent = self._end(keys[-1] if keys else b"", data, len(keys) * self.block, n), \
                (keys[-1] if keys else None)
        if (n == 0 or key in self._planned or key in self._states or (state < 0 and n % self.block)
                or (state < 0 and key in self._entries)):
            self._free.append(slot)
            if state >= 0:
                self._free_states.append(state)
            return False
        if key in self._entries:                    # a KV link of a chain: now a resume point too
            self._free.append(slot)
            slot = -1
            self._pin(key)
        p = Planned(key, slot, n, parent, state)
        self._planned[key] = p
        if slot >= 0:
            self._planned_slots[slot] = p
        self.commit(p)
        return True

    def restore(self, chain: list[tuple[bytes, bytes | None, int]]) -> list[Planned]:
        """Slots for snapshots brought back from the disk tier (coordinator/disk_tier.py): a
        chain's entries in order, (key, parent, position) each, the last one the resume point.
        Each one not cached gets a KV slot, and the last a state unless it has one, evicting as
        plan() does (never this chain's own cached entries); the others are KV links. All or
        nothing: [] when a slot cannot be had (a chain with a gap is useless); else the plans,
        to commit() once their slots are written, or abort()."""
        keys = [k for k, _, _ in chain]
        if not chain or any(k in self._planned for k in keys):
            return []
        held = [k for k in keys if k in self._lru]
        missing = sum(k not in self._entries for k in keys)
        if missing > len(self._free) + len(self._lru) - len(held):
            return []                               # evicting others for a chain that cannot fit: no
        for k in held:
            self._lru.remove(k)
        last = keys[-1]
        planned, ok = [], True
        for key, parent, position in chain:
            if key in self._entries:
                continue
            slot = self._take_slot()
            if slot is None:
                ok = False
                break
            planned.append(Planned(key, slot, position, parent))
        if ok and last not in self._states:
            state = self._take_state(evict=True)
            if state is None:
                ok = False
            elif planned and planned[-1].key == last:
                planned[-1] = dataclasses.replace(planned[-1], state=state)
            else:                                   # the cached last entry takes a state alone
                planned.append(Planned(last, -1, chain[-1][2], chain[-1][1], state))
        if not ok:
            for p in planned:
                if p.slot >= 0:
                    self._free.append(p.slot)
                if p.state >= 0:
                    self._free_states.append(p.state)
            planned = []
        self._pending(planned)
        for k in reversed(held):
            if k in self._entries and k not in self._pins:
                self._lru.add(k, self._tier(k))
        return planned

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        key = self._lru.pop_oldest()
        self._counts["evictions"] += 1
        return self._remove(key)

    def _take_state(self, evict: bool, tiers=None) -> int | None:
        """A free state slot, or with `evict` the least recently used state of the lowest
        of `tiers` (default: all) that has one; None if none."""
        if self._free_states:
            return self._free_states.pop()
        if not evict or not self._state_lru.has(tiers):
            return None
        key = self._state_lru.pop_oldest(tiers)
        state = self._states.pop(key)
        self._resumed.discard(key)
        self._counts["state_evictions"] += 1
        if self._entries[key].position % self.block:
            # an end entry is useless without its state: it goes whole (never pinned
            # without its state: only a Resume's last entry is an end entry)
            self._lru.remove(key)
            self._free.append(self._remove(key))
        return state

    def _remove(self, key: bytes) -> int:
        """Drop an unpinned entry from the index (its state freed); returns its KV slot."""
        entry = self._entries.pop(key)
        self._reused.discard(key)
        self._resumed.discard(key)
        state = self._states.pop(key, None)
        if state is not None:
            self._state_lru.remove(key)
            self._free_states.append(state)
        if entry.position % self.block:
            self._forget_end(entry)
        return entry.slot

    def _end_base(self, entry) -> tuple[bytes, int]:
        return entry.parent or b"", entry.position % self.block

    def _forget_end(self, entry: Entry) -> None:
        base, r = self._end_base(entry)
        tails = self._ends[base]
        tails[r] -= 1
        if tails[r] == 0:
            del tails[r]
            if not tails:
                del self._ends[base]

    def commit(self, planned: Planned | Iterable[Planned]) -> None:
        """The worker wrote these snapshots: make them visible, unpinned, recent."""
        for p in self._claim(planned):
            if p.slot < 0:                          # a state for a cached entry
                entry = self._entries[p.key]
                self._unpin(p.key)
            else:
                entry = Entry(p.key, p.slot, p.position, p.parent)
                self._entries[p.key] = entry
                self._lru.add(p.key, self._tier(p.key))
                if p.position % self.block:
                    base, r = self._end_base(entry)
                    tails = self._ends.setdefault(base, {})
                    tails[r] = tails.get(r, 0) + 1
            if p.state >= 0:
                self._states[p.key] = p.state
                self._state_lru.add(p.key, self._state_tier(p.key))
            self._touch_ancestors(entry)

    def abort(self, planned: Planned | Iterable[Planned]) -> None:
        """The write failed (worker died, request cancelled): free the slots."""
        for p in self._claim(planned):
            if p.slot >= 0:
                self._free.append(p.slot)
            else:
                self._unpin(p.key)
            if p.state >= 0:
                self._free_states.append(p.state)

    def _claim(self, planned) -> list[Planned]:
        # Validate the whole batch before changing anything.
        batch = [planned] if isinstance(planned, Planned) else list(planned)
        seen = set()
        for p in batch:
            if not isinstance(p, Planned) or self._planned.get(p.key) != p or p.key in seen:
                raise ValueError(f"{p!r} is not a pending planned snapshot of this index "
                                 "(committed or aborted already?)")
            seen.add(p.key)
        for p in batch:
            del self._planned[p.key]
            if p.slot >= 0:
                del self._planned_slots[p.slot]
        return batch

    def _touch_ancestors(self, entry: Entry) -> None:
        # Keep a chain's parents at least as recent as its children, so eviction
        # trims chains from the deep end.
        key = entry.parent
        while key is not None and key in self._entries:
            if key in self._lru:
                self._lru.touch(key)
            key = self._entries[key].parent

    def entry(self, key: bytes) -> Entry | None:
        """The committed entry of `key`, if cached."""
        return self._entries.get(key)

    def state_of(self, key: bytes) -> int | None:
        """The state slot of a committed entry, if it has one."""
        return self._states.get(key)

    def planned_in(self, slot: int) -> Planned | None:
        """The pending planned snapshot writing KV slot `slot`, if any."""
        return self._planned_slots.get(slot)

    # ---- reporting -----------------------------------------------------------
    def stats(self) -> dict[str, int]:
        state_only = sum(p.slot < 0 for p in self._planned.values())
        return dict(slots=self.n_slots, state_slots=self.n_state_slots, block=self.block,
                    entries=len(self._entries), states=len(self._states), free_slots=len(self._free),
                    free_state_slots=len(self._free_states),
                    pinned=len(self._pins) - state_only + len(self._planned) + len(self._reserved),
                    writing=len(self._planned) - state_only, **self._counts)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests, debugging)."""
        planned = list(self._planned.values())
        slots = ([e.slot for e in self._entries.values()] + [p.slot for p in planned if p.slot >= 0]
                 + sorted(kv for kv, _ in self._reserved))
        assert len(slots) + len(self._free) == self.n_slots, "slots lost or duplicated"
        assert len(set(slots) | set(self._free)) == self.n_slots, "a slot is used twice"
        assert all(0 <= s < self.n_slots for s in slots + self._free)
        states = (list(self._states.values()) + [p.state for p in planned if p.state >= 0]
                  + sorted(s for _, s in self._reserved if s >= 0))
        assert len(states) + len(self._free_states) == self.n_state_slots, "state slots lost or duplicated"
        assert len(set(states) | set(self._free_states)) == self.n_state_slots, "a state slot is used twice"
        assert all(0 <= s < self.n_state_slots for s in states + self._free_states)
        assert set(self._states) <= set(self._entries), "a state outlived its entry"
        assert all(e.key in self._states for e in self._entries.values() if e.position % self.block), \
            "an end entry without its state"
        assert set(self._lru) | set(self._pins) == set(self._entries)
        assert not set(self._lru) & set(self._pins), "a pinned entry is evictable"
        assert set(self._state_lru) | set(self._state_pins) == set(self._states)
        assert not set(self._state_lru) & set(self._state_pins), "a pinned state is evictable"
        assert set(self._state_pins) <= set(self._pins), "a state pinned without its entry"
        assert self._reused <= set(self._entries), "a reuse mark outlived its entry"
        assert self._resumed <= set(self._states), "a resume mark outlived its state"
        assert all(self._lru.tier_of(k) == self._tier(k) for k in self._lru), "an entry in the wrong tier"
        assert all(self._state_lru.tier_of(k) == self._state_tier(k) for k in self._state_lru), \
            "a state in the wrong tier"
        for p in planned:
            if p.slot >= 0:
                assert p.key not in self._entries, "a planned entry is visible"
            else:
                assert p.key in self._entries and p.key not in self._states and p.state >= 0, \
                    "a state-only plan of no cached entry without a state"
        assert {p.slot: p for p in planned if p.slot >= 0} == self._planned_slots
        pins: dict[bytes, int] = {p.key: 1 for p in planned if p.slot < 0}
        state_pins: dict[bytes, int] = {}
        for r in self._resumes.values():
            for e in r.entries:
                assert self._entries.get(e.key) == e, "a pinned entry changed"
                pins[e.key] = pins.get(e.key, 0) + 1
            last = r.entries[-1].key
            assert self._states.get(last) == r.state, "a pinned state changed"
            state_pins[last] = state_pins.get(last, 0) + 1
        assert pins == self._pins, "pin counts disagree with live resumes"
        assert state_pins == self._state_pins, "state pin counts disagree with live resumes"
        ends: dict[bytes, dict[int, int]] = {}
        for e in self._entries.values():
            if e.position % self.block:
                base, r = self._end_base(e)
                ends.setdefault(base, {})[r] = ends.get(base, {}).get(r, 0) + 1
        assert ends == self._ends, "end-entry index out of date"


def _hold(pins: dict[bytes, int], order: "_EvictionOrder", key: bytes) -> None:
    """One more holder of key: out of the eviction order while any holds it."""
    if key not in pins:
        order.remove(key)
        pins[key] = 0
    pins[key] += 1


def _let_go(pins: dict[bytes, int], order: "_EvictionOrder", key: bytes, tier_of) -> None:
    """One holder less: back into the eviction order, most recent in its tier, with the last."""
    pins[key] -= 1
    if pins[key] == 0:
        del pins[key]
        order.add(key, tier_of(key))


class _EvictionOrder:
    """Unpinned committed keys in eviction tiers, each least recently used first."""

    TIERS = 3

    def __init__(self):
        self._tiers = [OrderedDict() for _ in range(self.TIERS)]
        self._tier: dict[bytes, int] = {}

    def add(self, key: bytes, tier: int) -> None:
        """Put key last (most recent) in `tier`."""
        self.remove(key)
        self._tiers[tier][key] = None
        self._tier[key] = tier

    def remove(self, key: bytes) -> None:
        tier = self._tier.pop(key, None)
        if tier is not None:
            del self._tiers[tier][key]

    def touch(self, key: bytes, last: bool = True) -> None:
        """Make key the most (last=False: the least) recent of its tier."""
        self._tiers[self._tier[key]].move_to_end(key, last)

    def tier_of(self, key: bytes) -> int:
        return self._tier[key]

    def has(self, tiers=None) -> bool:
        """Whether a key is in one of `tiers` (default: any)."""
        return any(self._tiers[t] for t in (range(self.TIERS) if tiers is None else tiers))

    def pop_oldest(self, tiers=None) -> bytes:
        """The key to evict: the least recently used of the lowest non-empty tier (of
        `tiers`, default all)."""
        for tier in (self._tiers if tiers is None else [self._tiers[t] for t in tiers]):
            if tier:
                key, _ = tier.popitem(last=False)
                del self._tier[key]
                return key
        raise KeyError("nothing to evict")

    def __contains__(self, key) -> bool:
        return key in self._tier

    def __len__(self) -> int:
        return len(self._tier)

    def __iter__(self):
        return iter(list(self._tier))
