"""The coordinator's index over the snapshot arena: which slot holds which prefix.

Pure policy: no sockets, no shared memory; it deals in slot numbers of a
shared/shm_arena.SnapshotArena and is not thread-safe (the coordinator's event
loop owns it).

Why snapshots: the Gated DeltaNet state is only valid at the end of a sequence, so
plain KV prefix caching cannot resume a prompt. We store the whole state at
positions instead. Prompts are cut in blocks of `block` tokens; a slot holds one
snapshot at position p: the recurrent state, the KV of its own block (positions
[block_start, p)) and the logits of position p-1 (shared/state.py writes it).

Keys (blake2b, 16-byte digests; tokens as little-endian int32):
    chain key_0 = b""                                   the empty prefix
    chain key_i = H(key_{i-1} || tokens of block i)     the prefix of i full blocks
    end key     = H(key_k || b"end" || tokens after block k)   an exact unaligned sequence
Equal prefixes give equal keys; different ones differ (chaining fixes the block split
and the input lengths differ mod 4, so chain and end keys never meet).

Resuming at p needs the chain entries of blocks 1..p//block (their KV pages) plus,
when p is not aligned, the end entry at p, whose recurrent state is the one to load.

Life of a slot:
    free --plan--> planned (pinned, invisible to lookup) --commit--> cached (LRU)
                      \\--abort--> free
    free --reserve--> reserved (a decoding sequence's, key unknown) --adopt--> cached
                      \\--unreserve--> free
    cached --lookup--> pinned by a Resume --release--> cached, most recent
    cached, unpinned --evicted by plan--> removed from the index, then re-planned
A decoding sequence's snapshots are taken where its tokens are not known in advance
(block boundaries while it decodes, its final state): the worker gets slots to write,
and the coordinator adopts each written one under the key of the tokens it then holds.
An entry leaves the index before its slot is handed out again, and pinned or
planned slots are never evicted, so a lookup can never return a reused slot.

What is evicted first (least recently used within each tier, tiers in this order):
    0. end entries no client lookup has reused: the last snapshot of a one-off prompt
    1. block entries no client lookup has reused: shared by every extension of a prompt
    2. entries a client lookup has reused
so a stream of one-off short prompts recycles its own slots and never pushes out a
long prompt's blocks, and what was reused once (a system prompt, a conversation)
outlives what never was. A replay's lookup (a request restarted after its worker
died) reuses the request's own snapshots: it is counted apart and promotes nothing.
"""
from __future__ import annotations

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
    """A cached snapshot. parent = chain key of the block before this entry's own
    block (None when its block is the first)."""
    key: bytes
    slot: int
    position: int
    parent: bytes | None


@dataclass(frozen=True)
class Planned:
    """A snapshot to take during a prefill: write the state at `position` into `slot`,
    then commit() it (or abort() if the write failed)."""
    key: bytes
    slot: int
    position: int
    parent: bytes | None


@dataclass(frozen=True)
class Resume:
    """Where a request can start: restore `entries` (chain blocks 1..k in order, then
    the end entry if any; the last one carries the recurrent state) and prefill
    tokens[position:]. exact: position == len(tokens), the snapshot's logits give the
    first token. Its entries stay pinned until SnapshotIndex.release(resume)."""
    position: int
    exact: bool
    chain: tuple[Entry, ...]
    end: Entry | None
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
    """Maps token prefixes to snapshot slots, with LRU eviction within n_slots."""

    def __init__(self, n_slots: int, block: int = DEFAULT_BLOCK):
        if n_slots < 0 or block < 1:
            raise ValueError(f"need n_slots >= 0 and block >= 1, got {n_slots}, {block}")
        self.n_slots = n_slots
        self.block = block
        self._entries: dict[bytes, Entry] = {}            # committed, visible
        self._lru = _EvictionOrder()                     # committed and unpinned, by tier, oldest first
        self._reused: set[bytes] = set()                 # committed keys a client lookup returned
        self._pins: dict[bytes, int] = {}                # committed key -> Resumes holding it
        self._planned: dict[bytes, Planned] = {}         # being written, pinned, invisible
        self._planned_slots: dict[int, Planned] = {}
        self._ends: dict[bytes, dict[int, int]] = {}     # base chain key -> {tail length: count}
        self._resumes: dict[int, Resume] = {}
        self._tickets = itertools.count(1)
        self._free = list(range(n_slots - 1, -1, -1))   # pop() hands out slot 0 first
        self._reserved: set[int] = set()                 # handed to a decoding sequence, not yet written
        self._counts = dict(hits=0, misses=0, hit_tokens=0, evictions=0, skipped=0, replays=0, replay_hit_tokens=0)

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
        resume = Resume(position, position == n, chain, end, next(self._tickets))
        for e in resume.entries:
            self._pin(e.key)
            if promote:
                self._reused.add(e.key)
        self._resumes[resume.ticket] = resume
        return resume

    def cached(self, tokens) -> int:
        """The position lookup() would resume tokens from, without pinning or counting."""
        return self._find(tokens)[0]

    def _find(self, tokens):
        """(position, n tokens, the chain's keys, how many of them are cached, the end entry)."""
        data = token_bytes(tokens)
        n = len(data) // 4
        keys = self._chain(data)
        m = 0
        while m < len(keys) and keys[m] in self._entries:
            m += 1
        position, end = m * self.block, None
        if position < n:
            end = self._longest_end(keys[m - 1] if m else b"", data, position, n)
            if end is not None:
                position = end.position
        return position, n, keys, m, end

    def _longest_end(self, base: bytes, data: bytes, begin: int, n: int) -> Entry | None:
        # An end entry of a prefix of tokens that starts after the chain run: the
        # exact prompt, or a shorter one this prompt extends (the next chat turn).
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
        # Deepest first, so the chain's first blocks end up the most recent.
        for e in reversed(resume.entries):
            self._unpin(e.key)

    def _pin(self, key: bytes) -> None:
        if key not in self._pins:
            self._lru.remove(key)
            self._pins[key] = 0
        self._pins[key] += 1

    def _unpin(self, key: bytes) -> None:
        self._pins[key] -= 1
        if self._pins[key] == 0:
            del self._pins[key]
            self._lru.add(key, self._tier(key))

    def _tier(self, key: bytes) -> int:
        """Eviction tier of a committed entry (see the module's docstring)."""
        if key in self._reused:
            return 2
        return 1 if self._entries[key].position % self.block == 0 else 0

    # ---- writing -------------------------------------------------------------
    def plan(self, tokens, start: int, marks=()) -> list[Planned]:
        """Slots for the snapshots a prefill of tokens[start:] should take: each block
        boundary in (start, len], the unaligned end, and each of `marks` in (start, len)
        (where a chat's turns begin: the next turn may diverge right after one), unless
        cached or already being written. Evicts least-recently-used unpinned entries; when
        nothing more can be evicted the rest are skipped (a request never fails for lack
        of cache)."""
        data = token_bytes(tokens)
        n = len(data) // 4
        if not 0 <= start <= n:
            raise ValueError(f"start {start} is outside the {n} tokens")
        keys = self._chain(data)
        wanted = [(keys[i - 1], i * self.block, keys[i - 2] if i >= 2 else None)
                  for i in range(start // self.block + 1, len(keys) + 1)]
        end = self._end(keys[-1] if keys else b"", data, len(keys) * self.block, n)
        if n % self.block and n > start:
            wanted.append((end, n, keys[-1] if keys else None))
        for m in sorted({int(m) for m in marks if start < m < n and m % self.block}):
            base = m // self.block                 # the mark's own end entry, after `base` full blocks
            wanted.append((self._end(keys[base - 1] if base else b"", data, base * self.block, m), m,
                           keys[base - 1] if base else None))
        wanted.sort(key=lambda w: w[1])            # in position order, the prompt's end last
        wanted = [w for w in wanted if w[0] not in self._entries and w[0] not in self._planned]
        # This prompt's own cached snapshots must not be evicted to make room for its
        # later ones (a gap would make those useless): hold them out of the LRU.
        held = [k for k in keys + [end] if k in self._lru]
        for k in held:
            self._lru.remove(k)
        planned = []
        for key, position, parent in wanted:
            slot = self._take_slot()
            if slot is None:
                self._counts["skipped"] += len(wanted) - len(planned)
                break
            p = Planned(key, slot, position, parent)
            self._planned[key] = self._planned_slots[slot] = p
            planned.append(p)
        for k in reversed(held):
            self._lru.add(k, self._tier(k))
        return planned

    def reserve(self, n: int) -> list[int]:
        """Up to n slots for a decoding sequence's snapshots (evicting as plan() does)."""
        slots = []
        while len(slots) < n and (slot := self._take_slot()) is not None:
            slots.append(slot)
        self._reserved.update(slots)
        return slots

    def unreserve(self, slots: Iterable[int]) -> None:
        """Reserved slots not written after all: free again."""
        for slot in slots:
            self._reserved.remove(slot)
            self._free.append(slot)

    def adopt(self, slot: int, tokens) -> bool:
        """A reserved slot now holds the snapshot at the end of `tokens`: cache it under their
        key (a block entry on a block boundary, else an end entry). False, and the slot
        freed, if that key is cached or being written already."""
        self._reserved.remove(slot)
        data = token_bytes(tokens)
        n = len(data) // 4
        keys = self._chain(data)
        if n % self.block == 0:
            key, parent = keys[-1], keys[-2] if len(keys) >= 2 else None
        else:
            key, parent = self._end(keys[-1] if keys else b"", data, len(keys) * self.block, n), \
                (keys[-1] if keys else None)
        if n == 0 or key in self._entries or key in self._planned:
            self._free.append(slot)
            return False
        p = Planned(key, slot, n, parent)
        self._planned[key] = self._planned_slots[slot] = p
        self.commit(p)
        return True

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        key = self._lru.pop_oldest()
        entry = self._entries.pop(key)
        self._reused.discard(key)
        if entry.position % self.block:
            self._forget_end(entry)
        self._counts["evictions"] += 1
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
            entry = Entry(p.key, p.slot, p.position, p.parent)
            self._entries[p.key] = entry
            self._lru.add(p.key, self._tier(p.key))
            if p.position % self.block:
                base, r = self._end_base(entry)
                tails = self._ends.setdefault(base, {})
                tails[r] = tails.get(r, 0) + 1
            self._touch_ancestors(entry)

    def abort(self, planned: Planned | Iterable[Planned]) -> None:
        """The write failed (worker died, request cancelled): free the slots."""
        for p in self._claim(planned):
            self._free.append(p.slot)

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

    def planned_in(self, slot: int) -> Planned | None:
        """The pending planned snapshot writing `slot`, if any (for SnapshotWritten)."""
        return self._planned_slots.get(slot)

    # ---- reporting -----------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return dict(slots=self.n_slots, block=self.block, entries=len(self._entries),
                    free_slots=len(self._free), pinned=len(self._pins) + len(self._planned) + len(self._reserved),
                    writing=len(self._planned), **self._counts)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests, debugging)."""
        slots = ([e.slot for e in self._entries.values()] + [p.slot for p in self._planned.values()]
                 + sorted(self._reserved))
        assert len(slots) + len(self._free) == self.n_slots, "slots lost or duplicated"
        assert len(set(slots) | set(self._free)) == self.n_slots, "a slot is used twice"
        assert all(0 <= s < self.n_slots for s in slots + self._free)
        assert set(self._lru) | set(self._pins) == set(self._entries)
        assert not set(self._lru) & set(self._pins), "a pinned entry is evictable"
        assert self._reused <= set(self._entries), "a reuse mark outlived its entry"
        assert all(self._lru.tier_of(k) == self._tier(k) for k in self._lru), "an entry in the wrong tier"
        assert not set(self._planned) & set(self._entries)
        assert {p.slot: p for p in self._planned.values()} == self._planned_slots
        pins: dict[bytes, int] = {}
        for r in self._resumes.values():
            for e in r.entries:
                assert self._entries.get(e.key) == e, "a pinned entry changed"
                pins[e.key] = pins.get(e.key, 0) + 1
        assert pins == self._pins, "pin counts disagree with live resumes"
        ends: dict[bytes, dict[int, int]] = {}
        for e in self._entries.values():
            if e.position % self.block:
                base, r = self._end_base(e)
                ends.setdefault(base, {})[r] = ends.get(base, {}).get(r, 0) + 1
        assert ends == self._ends, "end-entry index out of date"


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

    def pop_oldest(self) -> bytes:
        """The key to evict: the least recently used of the lowest non-empty tier."""
        for tier in self._tiers:
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
