"""The HTTP process's one connection to the coordinator (a zmq.asyncio DEALER).

One reader task receives every reply and routes it by request_id to that request's
bounded queue (a RequestStream); status replies go to the callers of status() in
the order they asked (the coordinator answers one client's messages in order). A
request whose client reads too slowly to keep its queue below the bound is
cancelled upstream and ends with an error, so one slow client never stalls the
reader. A watchdog fails every open request when the coordinator stops answering.
A request cancelled here may still have its Done handed to whoever cancelled it
(for /metrics: the tokens an aborted request had).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable

import zmq
import zmq.asyncio

from shared import protocol as P
from shared.curve import client_keys
from shared.errors import ProtocolError

log = logging.getLogger("fermoe.http")

# Replies a request may have waiting for its HTTP client: far more than a client that
# keeps reading falls behind by, far less memory than a runaway buffer.
QUEUE_BOUND = 1024
# The coordinator answers a Status within its 200 ms poll even while it decodes; this
# long without any reply while requests are open means it is gone.
COORDINATOR_TIMEOUT_S = 30.0
WATCH_INTERVAL_S = 2.0
# Cancelled requests whose Done is awaited; past this many (a coordinator that stopped
# answering), the oldest are forgotten
MAX_DRAINING = 4096


class RequestStream:
    """The replies of one request in arrival order: Token..., then one Done, or one Error."""

    def __init__(self, request_id: str, bound: int = QUEUE_BOUND):
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue(bound)
        self.failure: str | None = None     # set when the request ends without a Done of its own
        self.answered = False               # a first reply came (it no longer waits)
        self.done: P.Done | None = None     # the coordinator's Done, once it came
        self.started: P.Started | None = None   # the prompt's size, once it went to a worker
        self.error: P.Error | None = None       # the coordinator's refusal, if it refused it

    def push(self, msg) -> bool:
        """From the reader; False when the queue is full (the client is not reading)."""
        self.answered = True
        if isinstance(msg, P.Done):
            self.done = msg
        elif isinstance(msg, P.Error):
            self.error = msg
        try:
            self.queue.put_nowait(msg)
            return True
        except asyncio.QueueFull:
            return False

    def fail(self, reason: str) -> None:
        """End the stream with an error Done (a waiting get() wakes up)."""
        if self.failure is None:
            self.failure = reason
            try:
                self.queue.put_nowait(None)
            except asyncio.QueueFull:
                pass                        # get() sees the failure once the queue is drained

    async def get(self):
        if self.failure is not None and self.queue.empty():
            return self._failed()
        msg = await self.queue.get()
        return self._failed() if msg is None else msg

    def _failed(self) -> P.Done:
        return P.Done(request_id=self.request_id, finish_reason="error", error=self.failure)


class Upstream:
    def __init__(self, addr: str, bound: int = QUEUE_BOUND, timeout_s: float = COORDINATOR_TIMEOUT_S,
                 watch_s: float = WATCH_INTERVAL_S, curve_key: str | None = None):
        self.addr, self.bound, self.timeout_s, self.watch_s = addr, bound, timeout_s, watch_s
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys = client_keys(curve_key)           # checked at start (server.py): here it loads
        if keys is not None:
            keys.apply(self.sock)
        self.sock.connect(addr)
        self.streams: dict[str, RequestStream] = {}
        self.draining: dict[str, Callable[[P.Done], None]] = {}     # cancelled, their Done awaited
        self.status_waiters: deque[asyncio.Future] = deque()
        self.last_reply = time.monotonic()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watch_loop())]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for stream in list(self.streams.values()):
            stream.fail("the HTTP server is shutting down")
        self.draining.clear()
        self.sock.close()

    @property
    def waiting(self) -> int:
        """Requests sent that have had no reply yet (queued or in prefill upstream)."""
        return sum(not s.answered for s in self.streams.values())

    # ---- requests -----------------------------------------------------------
    def submit(self, msg: P.Generate, data: bytes | None = None) -> RequestStream:
        """Send `msg` (`data`: its encoding, where the caller has it already)."""
        if not self.streams:                # the watchdog's silence counts from here, not from an idle spell
            self.last_reply = max(self.last_reply, time.monotonic())
        stream = self.streams[msg.request_id] = RequestStream(msg.request_id, self.bound)
        self.sock.send(P.encode(msg) if data is None else data)
        return stream

    def cancel(self, request_id: str, on_done: Callable[[P.Done], None] | None = None) -> bool:
        """Stop a request that is still open upstream; True if it was. Its Done, which
        the coordinator sends in answer, goes to `on_done` (else it is dropped)."""
        if self.streams.pop(request_id, None) is None:         # closed: its Done or Error has come
            return False
        self.sock.send(P.encode(P.Cancel(request_id=request_id)))
        if on_done is not None:
            if len(self.draining) >= MAX_DRAINING:
                del self.draining[next(iter(self.draining))]
            self.draining[request_id] = on_done
        return True

    async def status(self, timeout_s: float = 5.0) -> P.StatusReply:
        """The coordinator's StatusReply; TimeoutError when it does not answer in time."""
        waiter = asyncio.get_running_loop().create_future()
        self.status_waiters.append(waiter)
        self.sock.send(P.encode(P.Status()))
        return await asyncio.wait_for(waiter, timeout_s)

    # ---- the reader -----------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            data = await self.sock.recv()
            self.last_reply = time.monotonic()
            try:
                msg = P.decode(data, P.CLIENT_REPLIES)
            except ProtocolError as e:
                log.error("the coordinator sent a bad reply: %s", e)
                continue
            try:
                self.route(msg)
            except Exception:               # one reply's fault: the reader, and every other request, go on
                log.exception("routing a %s failed", type(msg).__name__)

    def route(self, msg) -> None:
        if isinstance(msg, P.StatusReply) or (isinstance(msg, P.Error) and msg.request_id is None):
            self._answer_status(msg)
            return
        stream = self.streams.get(msg.request_id)
        if stream is None:                  # cancelled meanwhile: its late replies are dropped, but its Done
            if isinstance(msg, (P.Done, P.Error)) and (on_done := self.draining.pop(msg.request_id, None)):
                if isinstance(msg, P.Done):
                    on_done(msg)
            return
        if isinstance(msg, P.Started):      # read by the opening event, not a reply of its own
            stream.started = msg
            return
        if isinstance(msg, (P.Done, P.Error)):
            self.streams.pop(msg.request_id, None)              # closed: nothing to cancel any more
        if not stream.push(msg):
            log.warning("request %s: its client fell %d replies behind; cancelling it", stream.request_id, self.bound)
            self.cancel(stream.request_id)
            stream.fail(f"the client read the stream too slowly ({self.bound} replies behind)")

    def _answer_status(self, msg) -> None:
        while self.status_waiters:
            waiter = self.status_waiters.popleft()
            if waiter.done():               # its caller timed out; the next caller takes this reply
                continue
            if isinstance(msg, P.Error):
                waiter.set_exception(ProtocolError(msg.message))
            else:
                waiter.set_result(msg)
            return
        if isinstance(msg, P.Error):
            log.error("the coordinator refused a message: %s", msg.message)

    # ---- the watchdog -----------------------------------------------------------
    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.watch_s)
            if not self.streams:
                continue
            silent = time.monotonic() - self.last_reply
            if silent > self.timeout_s:
                self.fail_all(f"the coordinator at {self.addr} did not answer for {silent:.0f} s")
            elif silent > self.watch_s:
                try:                        # quiet while requests are open: is it still there?
                    await self.status(timeout_s=self.watch_s)
                except (asyncio.TimeoutError, ProtocolError):
                    pass

    def fail_all(self, reason: str) -> None:
        for rid, stream in list(self.streams.items()):
            self.cancel(rid)                # should it come back, it need not finish them
            stream.fail(reason)
        self.draining.clear()
