"""A CPU worker and a GPU worker sharing decode steps (the hybrid decode), over one
shared-memory mailbox a pair (shared/exchange.py).

The CPU worker owns its sequences as before (sampling, stops, snapshots, the tokens it
streams); for a step of its decoding sequences it asks the GPU worker, which runs the
dense part on the device (gpu_worker/hybrid.py) and, once a MoE layer, asks back for the
routed experts' sum, which the CPU worker computes with its own W4A8 kernels while it
waits for the step's logits. The mailbox is strict request and reply: every message is
answered before the next one goes the same way. A blob's chunks are acknowledged (ACK) but
its last, which the receiver answers with its result, or, for LOGITS and STATE (themselves
answers), with its next request.

    CPU worker: DensePeer                         GPU worker: StepServer (gpu_worker/step_server.py)
    ADMIT key, the state (in chunks) ------------>   a host copy, on the device at its first step
    STEP keys, tokens --------------------------->   the pass over one token a sequence
                   <-----------------------------   REQUEST layer, x, ids, weights (expert_exchange)
    REPLY their sum ----------------------------->   ... once a MoE layer whose experts it lacks
                   <-----------------------------   LOGITS rows (in chunks)
    SYNC key, the rows the CPU holds ------------>
                   <-----------------------------   STATE: it and the KV rows since (in chunks)
    RELEASE key --------------------------------->   the sequence dropped
                   <-----------------------------   ACK

A state travels as one blob: the recurrent buffer (shared/state.py's layout, header and
logits included), then each attention layer's K rows and V rows of the range sent, in the
KV dtype both sides run. Messages: a 32-byte header (kind, key, n, last: int32; two int64:
an offset and a total), then the payload.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from .errors import FermoeError
from .exchange import PeerLost, receive_watching
from .expert_exchange import ERROR, HEADER as EXPERT_HEADER, REPLY, REQUEST, header as expert_header
from .state import SequenceState, recurrent_nbytes

LINK = struct.Struct("<4i2q")
ADMIT, STEP, LOGITS, SYNC, STATE, RELEASE, ACK, FAILED = range(20, 28)
MAX_STEP = 64               # sequences of one step


MAILBOX_PREFIX = "fermoe_hybrid"    # a CPU worker's mailboxes: /dev/shm/fermoe_hybrid-<its pid>-*


def mailbox_bytes(cfg) -> int:
    """A hybrid mailbox's capacity each way: a step's expert request for MAX_STEP tokens,
    and chunks of logits and states of 4 MiB."""
    request = EXPERT_HEADER.size + 4 * MAX_STEP * (cfg.n_embd + 2 * cfg.n_expert_used)
    return max(request, 4 << 20) + LINK.size


def link_header(kind: int, key: int = 0, n: int = 0, last: int = 0, offset: int = 0, total: int = 0) -> bytes:
    return LINK.pack(kind, key, n, last, offset, total)


class PeerError(FermoeError):
    """The other worker failed the request, or is gone."""


def process_gone(pid: int, what: str) -> str | None:
    """Why the process `pid` (`what`, for the message) cannot answer any more, or None while it runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"{what} (pid {pid}) exited"
    except PermissionError:         # someone else's: it runs
        pass
    return None


class End:
    """One end's waiting and the blobs it sends and takes, over the Exchange `ex`."""

    def __init__(self, ex, timeout_s: float, gone=None):
        self.ex, self.timeout_s, self.gone = ex, timeout_s, gone
        self.broken: str | None = None

    def send(self, *parts) -> None:
        if self.broken is not None:
            raise PeerError(f"hybrid peer unusable: {self.broken}")
        self.ex.send(*parts)

    def receive(self, timeout_s: float | None = None) -> memoryview:
        try:
            return receive_watching(self.ex, self.timeout_s if timeout_s is None else timeout_s, self.gone)
        except PeerLost as e:
            self.broken = e.reason
            raise PeerError(f"hybrid peer: {self.broken}") from None

    def kind_of(self, msg) -> tuple:
        fields = LINK.unpack_from(msg)
        if fields[0] == FAILED:
            raise PeerError(f"hybrid peer: {bytes(msg[LINK.size:]).decode(errors='replace')}")
        return fields

    def expect(self, msg, kind: int) -> tuple:
        fields = self.kind_of(msg)
        if fields[0] != kind:
            self.broken = f"a message of kind {fields[0]} where {kind} was due"
            raise PeerError(f"hybrid peer: {self.broken}")
        return fields

    def send_blob(self, kind: int, key: int, parts, n: int = 0, answered: bool = True) -> memoryview | None:
        """parts (byte views) as chunks of `kind` (n: a count the receiver reads in each), each
        but the last acknowledged; returns the reply to the last, or None when it is not
        `answered` (a reply's own blob: the peer's next request answers it)."""
        views = [memoryview(p).cast("B") for p in parts]
        total, room = sum(v.nbytes for v in views), self.ex.capacity - LINK.size
        data = _Chunks(views)
        offset = 0
        while True:
            chunk = data.take(room)
            last = int(offset + chunk_size(chunk) >= total)
            self.send(link_header(kind, key, n, last, offset, total), *chunk)
            offset += chunk_size(chunk)
            if last and not answered:
                return None
            reply = self.receive()
            if last:
                return reply
            self.expect(reply, ACK)

    def receive_blob(self, first, into: np.ndarray) -> None:
        """Chunks (the first already received) into `into` (uint8 of the blob's size); every
        chunk but the last acknowledged here, the last left for the caller to answer (each
        message is answered before the next one goes the same way)."""
        msg = first
        while True:
            kind, _, _, last, offset, total = self.kind_of(msg)
            payload = msg[LINK.size:]
            if total != into.nbytes or offset + len(payload) > total:
                self.broken = f"a chunk at {offset} of {total} bytes into {into.nbytes}"
                raise PeerError(f"hybrid peer: {self.broken}")
            into[offset:offset + len(payload)] = np.frombuffer(payload, np.uint8)
            if last:
                return
            self.send(link_header(ACK))
            msg = self.receive()


def chunk_size(views) -> int:
    return sum(v.nbytes for v in views)


class _Chunks:
    """Consecutive pieces of a list of byte views, up to n bytes at a time."""

    def __init__(self, views):
        self.views, self.i, self.at = views, 0, 0

    def take(self, n: int) -> list:
        out = []
        while n > 0 and self.i < len(self.views):
            v = self.views[self.i]
            piece = v[self.at:self.at + n]
            out.append(piece)
            n -= piece.nbytes
            self.at += piece.nbytes
            if self.at >= v.nbytes:
                self.i, self.at = self.i + 1, 0
        return out


def state_parts(state: SequenceState, rows: tuple[int, int]) -> list:
    """A state as a blob's parts: its recurrent buffer, then K and V rows [rows) of each attention layer."""
    cfg = state.cfg
    parts = [np.frombuffer(state.buffer, np.uint8, recurrent_nbytes(cfg))]
    k_out, v_out = _kv_rows(state, rows)
    for a in range(len(cfg.attention_layers)):
        state.kv.copy_rows(a, rows[0], rows[1], k_out[a], v_out[a])
        parts += [k_out[a], v_out[a]]
    return parts


def _kv_rows(state: SequenceState, rows: tuple[int, int]):
    cfg, n = state.cfg, rows[1] - rows[0]
    shape = (n, cfg.n_head_kv, cfg.head_dim)
    return ([np.empty(shape, state.kv.dtype) for _ in cfg.attention_layers],
            [np.empty(shape, state.kv.dtype) for _ in cfg.attention_layers])


def blob_nbytes(cfg, kv_dtype: np.dtype, n_rows: int) -> int:
    return recurrent_nbytes(cfg) + 2 * len(cfg.attention_layers) * n_rows * cfg.n_head_kv * cfg.head_dim * \
        np.dtype(kv_dtype).itemsize


def take_state(state: SequenceState, blob: np.ndarray, n_rows: int) -> None:
    """A received blob into `state`: its recurrent buffer replaced, the n_rows K and V rows
    of each attention layer appended after those it holds."""
    cfg = state.cfg
    nbytes = recurrent_nbytes(cfg)
    np.frombuffer(state.buffer, np.uint8, nbytes)[:] = blob[:nbytes]
    shape = (n_rows, cfg.n_head_kv, cfg.head_dim)
    size, at = int(np.prod(shape)) * state.kv.dtype.itemsize, nbytes
    for a in range(len(cfg.attention_layers)):
        keys = blob[at:at + size].view(state.kv.dtype).reshape(shape)
        values = blob[at + size:at + 2 * size].view(state.kv.dtype).reshape(shape)
        state.kv.append(a, keys, values)
        at += 2 * size


# ---- the CPU worker's end ---------------------------------------------------------------------
class DensePeer(End):
    """The CPU worker's end: its sequences' steps run on the GPU worker, their routed
    experts on `engine` (a NativeEngine) here while it waits. gone(): why the GPU worker
    cannot answer (it exited), or None."""

    def __init__(self, ex, engine, timeout_s: float = 30.0, gone=None):
        super().__init__(ex, timeout_s, gone)
        self.engine = engine
        self.hops = 0

    def admit(self, key: int, state: SequenceState) -> None:
        """The GPU worker takes a copy of the sequence as it stands (every KV row)."""
        self.expect(self.send_blob(ADMIT, key, state_parts(state, (0, state.kv.length[0]))), ACK)

    def step(self, keys: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each admitted sequence: their logits [n, vocab], the routed
        experts of every layer the GPU asks for computed here meanwhile."""
        n, vocab = len(keys), self.engine.model.config.n_vocab
        self.send(link_header(STEP, 0, n), np.asarray(keys, np.int32), np.asarray(tokens, np.int32))
        logits = np.empty((n, vocab), np.float32)
        blob = logits.reshape(-1).view(np.uint8)
        while True:
            msg = self.receive()
            kind = struct.unpack_from("<i", msg)[0]
            if kind == REQUEST:
                self._experts(msg)
                continue
            self.expect(msg, LOGITS)
            self.receive_blob(msg, blob)        # its last chunk is answered by the next request
            return logits

    def _experts(self, msg) -> None:
        _, layer, T, k, D = EXPERT_HEADER.unpack_from(msg)[:5]
        at = EXPERT_HEADER.size
        try:
            x = np.frombuffer(msg, np.float32, T * D, at).reshape(T, D)
            ids = np.frombuffer(msg, np.int32, T * k, at + 4 * T * D).reshape(T, k)
            weights = np.frombuffer(msg, np.float32, T * k, at + 4 * T * (D + k)).reshape(T, k)
            out = self.engine.routed_experts(layer, x, ids, weights)
        except Exception as e:       # noqa: BLE001 -- the GPU side fails its step with it
            self.send(expert_header(ERROR), f"{type(e).__name__}: {e}".encode())
            return
        self.hops += 1
        self.send(expert_header(REPLY, layer, T, k, D), out)

    def sync(self, key: int, state: SequenceState) -> None:
        """The state brought level with the GPU's copy (its recurrent part, the KV rows
        past those it holds)."""
        self.send(link_header(SYNC, key, state.kv.length[0]))
        first = self.receive()
        _, _, n_rows, _, _, total = self.expect(first, STATE)
        blob = np.empty(total, np.uint8)
        self.receive_blob(first, blob)
        take_state(state, blob, n_rows)

    def release(self, key: int) -> None:
        self.send(link_header(RELEASE, key))
        self.expect(self.receive(), ACK)
