"""The GPU worker's end of a CPU worker's hybrid-decode mailbox (shared/hybrid_link.py has
the protocol and the CPU worker's end): its requests answered with a HybridEngine whose
routed experts are asked back across the same mailbox."""
from __future__ import annotations

import numpy as np

from shared.errors import FermoeError
from shared.exchange import ExchangeTimeout
from shared.expert_exchange import ERROR, HEADER as EXPERT_HEADER, REPLY, REQUEST, header as expert_header
from shared.hybrid_link import (ACK, ADMIT, FAILED, LINK, LOGITS, MAX_STEP, RELEASE, STATE, STEP, SYNC, End,
                                PeerError, blob_nbytes, link_header, state_parts, take_state)
from shared.state import SequenceState, kv_dtype, recurrent_nbytes

from .hybrid import HybridEngine


class MailboxExperts:
    """A HybridEngine's routed experts asked of the CPU worker across the mailbox (submit,
    then collect after the GPU's own work of the layer is queued)."""

    def __init__(self, end: End):
        self.end = end
        self._asked = None

    def submit(self, layer: int, x, ids, weights) -> None:
        (T, D), k = x.shape, ids.shape[1]
        self.end.send(expert_header(REQUEST, layer, T, k, D), np.ascontiguousarray(x, np.float32),
                      np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(weights, np.float32))
        self._asked = (T, D)

    def collect(self) -> np.ndarray:
        (T, D), self._asked = self._asked, None
        msg = self.end.receive()
        kind, _, t, _, d = EXPERT_HEADER.unpack_from(msg)[:5]
        if kind == ERROR:           # the request's fault, not the peer's: the step fails, the link stays
            raise FermoeError(f"the CPU worker's experts: {bytes(msg[EXPERT_HEADER.size:]).decode(errors='replace')}")
        if kind != REPLY or (t, d) != (T, D):
            self.end.broken = f"a reply of kind {kind}, [{t}, {d}], to a request of [{T}, {D}]"
            raise PeerError(f"hybrid peer: {self.end.broken}")
        return np.frombuffer(msg, np.float32, T * D, EXPERT_HEADER.size).reshape(T, D).copy()

    def drain(self) -> None:
        """The answer to a request a failed step sent and never collected, taken and dropped
        (the mailbox alternates: the step's failure goes back after it)."""
        if self._asked is not None:
            self._asked = None
            self.end.receive()


class StepServer(End):
    """The GPU worker's end of one CPU worker's mailbox: answers its requests with a
    HybridEngine (one a CPU worker: its lanes and its hand-overs) over the GPU engine.
    gone(): why the CPU worker cannot answer, or None."""

    def __init__(self, ex, gpu, timeout_s: float = 30.0, gone=None, gpu_experts: bool = True):
        super().__init__(ex, timeout_s, gone)
        self.gpu, self.cfg = gpu, gpu.cfg
        self.experts = MailboxExperts(self)
        self.hybrid = HybridEngine(gpu, self.experts, max_batch=MAX_STEP, gpu_experts=gpu_experts)
        self.states: dict[int, SequenceState] = {}
        self.steps = 0

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Answer the CPU worker's next request if one comes within timeout_s; whether one did.
        A request that fails is answered FAILED with why, and the server goes on; a peer that
        is gone raises PeerError."""
        try:
            msg = self.ex.receive(timeout_s=timeout_s)
        except ExchangeTimeout:
            return False
        kind, key, n, _, _, _ = LINK.unpack_from(msg)
        try:
            if kind == ADMIT:
                self._admit(key, msg)
            elif kind == STEP:
                self._step(msg, n)
            elif kind == SYNC:
                self._sync(key, n)
            elif kind == RELEASE:
                state = self.states.pop(key, None)
                if state is not None:
                    self.hybrid.abandon(state)
                self.send(link_header(ACK))
            else:
                raise FermoeError(f"a request of kind {kind}")
        except PeerError:
            raise
        except Exception as e:      # noqa: BLE001 -- the CPU worker gets why; the server serves on
            self.send(link_header(FAILED), f"{type(e).__name__}: {e}".encode())
        return True

    def _admit(self, key: int, first) -> None:
        _, _, _, _, _, total = LINK.unpack_from(first)
        cfg, dtype = self.cfg, kv_dtype(self.hybrid.kv_cache_dtype)
        rows, rest = divmod(total - recurrent_nbytes(cfg), blob_nbytes(cfg, dtype, 1) - recurrent_nbytes(cfg))
        if rows < 0 or rest:
            raise FermoeError(f"a state of {total} bytes is not one of this model's")
        blob = np.empty(total, np.uint8)
        self.receive_blob(first, blob)
        state = self.gpu.new_state()
        take_state(state, blob, rows)
        if state.position != rows:
            raise FermoeError(f"a state at position {state.position} with {rows} KV rows")
        old = self.states.pop(key, None)
        if old is not None:
            self.hybrid.abandon(old)
        self.states[key] = state
        self.send(link_header(ACK))

    def _step(self, msg, n: int) -> None:
        keys = np.frombuffer(msg, np.int32, n, LINK.size).tolist()
        tokens = np.frombuffer(msg, np.int32, n, LINK.size + 4 * n).tolist()
        missing = [k for k in keys if k not in self.states]
        if missing:
            raise FermoeError(f"a step of sequences {missing} never admitted")
        states = [self.states[k] for k in keys]
        try:
            logits = self.hybrid.decode_batch(tokens, states)
        except PeerError:
            raise
        except Exception:
            self.experts.drain()
            for k in keys:          # half a step ran on the device: those copies are void
                self.hybrid.abandon(self.states.pop(k))
            raise
        self.steps += 1
        self.send_blob(LOGITS, 0, [np.ascontiguousarray(logits, np.float32).reshape(-1).view(np.uint8)],
                       answered=False)

    def _sync(self, key: int, held: int) -> None:
        state = self.states.get(key)
        if state is None:
            raise FermoeError(f"a sync of sequence {key}, never admitted")
        self.hybrid.sync(state)
        self.send_blob(STATE, key, state_parts(state, (held, state.position)), n=state.position - held,
                       answered=False)

    def close(self) -> None:
        self.hybrid.close()
