"""A two-way mailbox between two processes of one host, in shared memory.

What a GPU worker and a CPU worker would trade once a layer in a hybrid decode step
(the hidden states and chosen experts one way, the routed experts' sum the other): a
few kilobytes each way, dozens of times a token, where a ZeroMQ round trip a layer
costs more than moving the bytes. `fermoe bench exchange` measures both.

The segment is a SnapshotArena of two slots, one a direction; a slot holds

    offset 0    sequence number  u64   the count of messages sent this way
           8    payload bytes    u64
          64    payload

The sender writes the payload, then its length, then the new sequence number; the
receiver waits for the number to change, then reads the length and the payload. On
x86-64 stores become visible in program order and loads are not reordered with older
loads, so the payload is whole once the number is seen. The receiver spins (reading
one word), then yields the CPU, then sleeps in short steps: both sides are busy in a
decode step, so the spin is what answers; the sleeps keep an idle peer cheap.
"""
from __future__ import annotations

import time

import numpy as np

from .errors import FermoeError
from .shm_arena import SnapshotArena

HEADER = 64
SPIN_S = 50e-6          # spin this long before yielding: a layer's reply comes within it
YIELD_S = 2e-3          # then yield the CPU this long before sleeping
SLEEP_S = 50e-6         # then sleep in steps of this


class ExchangeError(FermoeError):
    """A message too large for the mailbox, or no reply in time."""


class ExchangeTimeout(ExchangeError):
    """No message in time: nothing was consumed, so a receive() may wait again."""


class Exchange:
    """One end of a two-way mailbox: `send` writes to the peer, `receive` waits for it."""

    def __init__(self, arena: SnapshotArena, side: int):
        self.arena, self.capacity = arena, arena.slot_bytes - HEADER
        out, into = (0, 1) if side == 0 else (1, 0)
        self._out, self._in = arena.slot(out), arena.slot(into)
        self._out_head = np.frombuffer(self._out, np.uint64, 2)
        self._in_head = np.frombuffer(self._in, np.uint64, 2)
        # counted from the mailbox's creation: the other end may have sent before this one attached
        self._sent = self._seen = 0

    @classmethod
    def create(cls, capacity: int, prefix: str = "fermoe_xchg") -> "Exchange":
        """A new mailbox of `capacity` payload bytes each way; this end is side 0."""
        if capacity < 1:
            raise ExchangeError(f"an exchange of {capacity} bytes: needs 1 at least")
        return cls(SnapshotArena.create(HEADER + capacity, 2, prefix=prefix), 0)

    @classmethod
    def attach(cls, name: str, capacity: int) -> "Exchange":
        """The other end (side 1) of the mailbox `name` made by create(capacity)."""
        return cls(SnapshotArena.attach(name, HEADER + capacity, 2), 1)

    @property
    def name(self) -> str:
        return self.arena.name

    def send(self, *parts) -> None:
        """Write `parts` (bytes or contiguous arrays), one after the other, as one message
        for the peer's next receive(): each is copied once, straight into the mailbox."""
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(v.nbytes for v in views)
        if n > self.capacity:
            raise ExchangeError(f"a message of {n} bytes: the exchange holds {self.capacity}")
        at = HEADER
        for v in views:
            self._out[at:at + v.nbytes] = v
            at += v.nbytes
        self._out_head[1] = n
        self._sent += 1
        self._out_head[0] = self._sent          # last: the payload is whole once this is seen

    def receive(self, timeout_s: float = 10.0) -> memoryview:
        """The peer's next message: a view of the mailbox, valid until the peer sends again
        (copy it to keep it). Raises ExchangeError after `timeout_s` without one."""
        head = self._in_head
        if int(head[0]) == self._seen:
            start = time.perf_counter()
            while int(head[0]) == self._seen:
                waited = time.perf_counter() - start
                if waited < SPIN_S:
                    continue
                if waited > timeout_s:
                    raise ExchangeTimeout(f"no message from the other end of {self.name} in {timeout_s:g} s")
                time.sleep(0 if waited < YIELD_S else SLEEP_S)
        self._seen += 1
        if int(head[0]) != self._seen:
            raise ExchangeError(f"{self.name}: the other end sent {int(head[0]) - self._seen} messages more than were "
                                f"received (each send waits for a reply)")
        n = int(head[1])
        return self._in[HEADER:HEADER + n]

    def close(self) -> None:
        """Unmap; the end that created the mailbox also removes its name."""
        self._out_head = self._in_head = None
        self._out = self._in = None
        if self.arena.creator and not self.arena.closed:
            self.arena.unlink()
        self.arena.close()

    def __enter__(self) -> "Exchange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


WATCH_SLICE_S = 0.2         # a wait on a peer that can be checked on looks at it this often


class PeerLost(ExchangeError):
    """No reply: the peer is gone (`reason` says how) or took longer than the wait allows."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def receive_watching(exchange: Exchange, timeout_s: float, gone=None) -> memoryview:
    """exchange.receive() for up to timeout_s, asking gone() (why the peer cannot answer, or
    None) every WATCH_SLICE_S meanwhile; PeerLost with its answer, or with the timeout."""
    deadline = time.perf_counter() + timeout_s
    while True:
        left = deadline - time.perf_counter()
        try:
            return exchange.receive(timeout_s=max(0.0, min(left, WATCH_SLICE_S) if gone else left))
        except ExchangeTimeout:
            why = gone() if gone else None
            if why is None and time.perf_counter() < deadline:
                continue
            raise PeerLost(why or f"no reply in {timeout_s:g} s") from None
