"""The routed experts of a hybrid decode step, asked for across an Exchange (shared/exchange.py).

Once a layer the GPU side sends the MoE block's normalised input and each token's chosen
experts and weights; the CPU side (an expert server, cpu_worker/expert_server.py) answers
with their weighted sum. A message is a fixed header then the arrays' bytes, copied once
each way into the mailbox and read in place on the other side:

    header      8 int32: kind, layer, T, k, D, 0, 0, 0 (32 bytes, so the arrays stay aligned)
    REQUEST     x [T, D] float32, ids [T, k] int32, weights [T, k] float32
    REPLY       out [T, D] float32
    ERROR       the server's message, UTF-8
    READY       nothing: the server has loaded its model (layer = its pid; k, D its shape)
    STOP        nothing: the server's loop ends
"""
from __future__ import annotations

import math
import struct

import numpy as np

from .errors import FermoeError
from .exchange import ExchangeTimeout, PeerLost, receive_watching

HEADER = struct.Struct("<8i")
REQUEST, REPLY, ERROR, READY, STOP = 1, 2, 3, 4, 5


def message_bytes(max_tokens: int, n_embd: int, n_expert_used: int) -> int:
    """The largest message either way for T up to max_tokens: an exchange's capacity."""
    return HEADER.size + 4 * max_tokens * (n_embd + 2 * n_expert_used)


def header(kind: int, layer: int = 0, T: int = 0, k: int = 0, D: int = 0) -> bytes:
    return HEADER.pack(kind, layer, T, k, D, 0, 0, 0)


class ExpertClient:
    """The GPU side's end: `routed` sends one layer's request and waits for the sum.

    timeout_s bounds each wait for a reply; gone (optional) is called while waiting and
    returns why the server cannot answer (it exited), or None while it may. After a wait
    that failed the client refuses every call: a late reply would answer the wrong request."""

    def __init__(self, exchange, timeout_s: float = 30.0, gone=None):
        self.exchange, self.timeout_s, self.gone = exchange, timeout_s, gone
        self.broken: str | None = None
        self._asked: tuple[int, int] | None = None     # (T, D) of the request awaiting its answer

    def routed(self, layer: int, x, ids, weights, out: np.ndarray | None = None) -> np.ndarray:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) of MoE layer `layer` [T, D]; a server's
        refusal is a FermoeError with its message. out: where to write, else a new array."""
        self.submit(layer, x, ids, weights)
        return self.collect(out)

    def submit(self, layer: int, x, ids, weights) -> None:
        """routed()'s request alone: the server computes while the caller goes on; collect()
        takes the answer."""
        x = np.ascontiguousarray(x, np.float32)
        ids, weights = np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(weights, np.float32)
        if x.ndim != 2 or ids.ndim != 2:
            raise FermoeError(f"routed experts: x {list(x.shape)} and ids {list(ids.shape)} must be 2-D")
        (T, D), k = x.shape, ids.shape[1]
        self._send(header(REQUEST, layer, T, k, D), x, ids, weights)
        self._asked = (T, D)

    def collect(self, out: np.ndarray | None = None) -> np.ndarray:
        """The answer to the request submit() sent."""
        if self._asked is None:
            raise FermoeError("expert server: collect() without a request")
        (T, D), self._asked = self._asked, None
        msg = self._receive()
        kind, _, t, _, d = HEADER.unpack_from(msg)[:5]
        if kind == ERROR:
            raise FermoeError(f"expert server: {bytes(msg[HEADER.size:]).decode(errors='replace')}")
        if kind != REPLY or (t, d) != (T, D) or len(msg) != HEADER.size + 4 * T * D:
            self.broken = f"a reply of kind {kind}, [{t}, {d}], {len(msg)} bytes to a request of [{T}, {D}]"
            raise FermoeError(f"expert server: {self.broken}")
        got = np.frombuffer(msg, np.float32, T * D, HEADER.size).reshape(T, D)
        if out is None:
            return got.copy()           # the view lasts only until the next request
        out[...] = got
        return out

    def wait_ready(self, timeout_s: float) -> tuple[int, int, int]:
        """The server's READY: (its pid, k, D); its ERROR (it could not start) as a FermoeError."""
        msg = self._receive(timeout_s)
        kind, pid, _, k, d = HEADER.unpack_from(msg)[:5]
        if kind == ERROR:
            self.broken = bytes(msg[HEADER.size:]).decode(errors="replace")
            raise FermoeError(f"expert server: {self.broken}")
        if kind != READY:
            self.broken = f"its first message is of kind {kind}, not READY"
            raise FermoeError(f"expert server: {self.broken}")
        return pid, k, d

    def stop(self) -> None:
        """End the server's loop (no reply: a stopped server has nothing more to say)."""
        if self.broken is None:
            self.exchange.send(header(STOP))
            self.broken = "stopped"

    def _send(self, *parts) -> None:
        if self.broken is not None:
            raise FermoeError(f"expert server unusable: {self.broken}")
        self.exchange.send(*parts)

    def _receive(self, timeout_s: float | None = None):
        try:
            return receive_watching(self.exchange, self.timeout_s if timeout_s is None else timeout_s, self.gone)
        except PeerLost as e:
            self.broken = e.reason
            raise FermoeError(f"expert server: {self.broken}") from None


def serve_experts(exchange, engine, idle_timeout: float | None = None) -> int:
    """Answer requests with engine.routed_experts until a STOP (or idle_timeout seconds
    without a message); returns the number answered. A request the engine refuses, or
    one that is not well formed, gets an ERROR reply and the loop goes on."""
    D, k = engine.model.config.n_embd, engine.model.config.n_expert_used
    out = np.empty((engine.max_batch, D), np.float32)
    served = 0
    while True:
        try:
            msg = exchange.receive(timeout_s=math.inf if idle_timeout is None else idle_timeout)
        except ExchangeTimeout:
            return served
        try:
            kind, layer, T, k_, D_ = HEADER.unpack_from(msg)[:5]
            if kind == STOP:
                return served
            if kind != REQUEST:
                raise FermoeError(f"a message of kind {kind}: expected a request ({REQUEST})")
            if T < 1 or k_ != k or D_ != D or T > engine.max_batch:
                raise FermoeError(f"a request of T={T}, k={k_}, D={D_}: this model takes k={k}, D={D}, "
                                  f"T in 1..{engine.max_batch}")
            if len(msg) != HEADER.size + 4 * T * (D + 2 * k):
                raise FermoeError(f"a request of {len(msg)} bytes: [T={T}, D={D}, k={k}] takes "
                                  f"{HEADER.size + 4 * T * (D + 2 * k)}")
            at = HEADER.size
            x = np.frombuffer(msg, np.float32, T * D, at).reshape(T, D)
            ids = np.frombuffer(msg, np.int32, T * k, at + 4 * T * D).reshape(T, k)
            weights = np.frombuffer(msg, np.float32, T * k, at + 4 * T * (D + k)).reshape(T, k)
            engine.routed_experts(layer, x, ids, weights, out=out[:T])
        except Exception as e:          # noqa: BLE001 -- a bad request never ends the server
            text = str(e) if isinstance(e, FermoeError) else f"{type(e).__name__}: {e}"
            exchange.send(header(ERROR), text.encode())
            continue
        exchange.send(header(REPLY, layer, T, k, D), out[:T])
        served += 1
