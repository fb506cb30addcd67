"""The Python client of the coordinator (ZeroMQ DEALER, MessagePack messages of
shared/protocol.py). Any msgpack + ZeroMQ client in another language can do the
same: send one map per message, read maps back."""
from __future__ import annotations

import time
import uuid
from collections import defaultdict, deque
from typing import Iterator

import msgspec
import zmq

from shared import protocol as P
from shared.curve import client_keys
from shared.errors import FermoeError
from shared.sampling import SamplingParams

DEFAULT_ADDR = "tcp://127.0.0.1:5557"


class Client:
    def __init__(self, addr: str = DEFAULT_ADDR, timeout_s: float = 600.0, curve_key: str | None = None):
        """curve_key: a client key file (clients/NAME.key_secret of `fermoe keys`), for a
        coordinator started with --curve-keys."""
        self.addr, self.timeout_s, self.curve_key = addr, timeout_s, curve_key
        keys = client_keys(curve_key)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.apply(self.sock)       # before connect: the handshake reads them then
        try:
            self.sock.connect(addr)
        except zmq.ZMQError as e:
            self.sock.close()
            raise FermoeError(f"cannot connect to {addr!r}: {e}") from None
        self._inbox: dict[str | None, deque] = defaultdict(deque)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, msg) -> None:
        self.sock.send(P.encode(msg))

    def _next(self, key: str | None, timeout_s: float):
        """The next reply for request `key` (None: status replies and request-less errors)."""
        deadline = time.monotonic() + timeout_s
        while not self._inbox[key]:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise FermoeError(f"no answer from the coordinator at {self.addr} within {timeout_s:.0f} s"
                                  + self._keys_hint())
            msg = P.decode(self.sock.recv(), P.CLIENT_REPLIES)
            self._inbox[getattr(msg, "request_id", None)].append(msg)
        return self._inbox[key].popleft()

    def _keys_hint(self) -> str:
        # a coordinator that refuses our keys (or our lack of them) says nothing: ZeroMQ drops the handshake
        return (f" (is {self.curve_key} a key it takes?)" if self.curve_key else
                " (if it requires CURVE keys, give a client key file: --curve-key)")

    def submit(self, prompt: str | None = None, tokens: list[int] | None = None, messages=None,
               request_id: str | None = None, sampling: SamplingParams | None = None, **params) -> str:
        """Start a request; returns its id. Read its replies with `stream(id)`. The
        sampling parameters come as a SamplingParams or by name among the keyword
        arguments (submit("Hi", temperature=0, max_tokens=8)), not both."""
        rid = request_id or uuid.uuid4().hex
        chat = [m if isinstance(m, P.ChatMessage) else msgspec.convert(m, P.ChatMessage) for m in messages] \
            if messages else None
        if sampling is not None and set(params) & set(SamplingParams.names()):
            raise FermoeError("give the sampling parameters as sampling= or by name, not both")
        named, params = SamplingParams.split(params)
        self.send(P.Generate(request_id=rid, prompt=prompt, tokens=tokens, messages=chat,
                             sampling=sampling or named, **params))
        return rid

    def stream(self, request_id: str) -> Iterator[P.Progress | P.Token | P.Done]:
        """Token messages as they come, then the Done (raises on an Error reply); with
        return_progress=True, a Progress after each pass over the prompt before them."""
        while True:
            msg = self._next(request_id, self.timeout_s)
            if isinstance(msg, P.Started):      # the prompt's size; its Done says it again
                continue
            if isinstance(msg, P.Error):
                raise FermoeError(f"request {request_id} refused: {msg.message}")
            yield msg
            if isinstance(msg, P.Done):
                return

    def generate(self, prompt: str | None = None, **kwargs) -> Iterator[P.Token | P.Done]:
        return self.stream(self.submit(prompt, **kwargs))

    def cancel(self, request_id: str) -> None:
        self.send(P.Cancel(request_id=request_id))

    def status(self, timeout_s: float = 10.0) -> P.StatusReply:
        self.send(P.Status())
        msg = self._next(None, timeout_s)
        if isinstance(msg, P.Error):
            raise FermoeError(msg.message)
        return msg

    def wait_ready(self, timeout_s: float = 120.0, alive=lambda: True) -> P.StatusReply:
        """Block until the coordinator answers and at least one worker is ready.
        `alive()` False (say, the daemon process we started exited) stops the wait."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not alive():
                raise FermoeError(f"the coordinator for {self.addr} exited before it was ready")
            try:
                st = self.status(timeout_s=1.0)
                if any(w.alive for w in st.workers):
                    return st
            except FermoeError:
                pass
            if time.monotonic() > deadline:
                raise FermoeError(f"the coordinator at {self.addr} was not ready within {timeout_s:.0f} s"
                                  + self._keys_hint())
            time.sleep(0.2)
