"""The state of one sequence: what prefill leaves behind and decode carries on.

It is plain memory so it can live in shared memory and be handed between
processes by name and offset. Two parts:

Recurrent part, one contiguous buffer of fixed size per model (little-endian):

    0   magic "FMSTATE1"            8 bytes
    8   layout version              u32
    12  flags (bit 0: logits valid) u32
    16  model fingerprint           16 ASCII hex chars
    32  position                    u64   tokens consumed so far
    40  n_gdn_layers, n_vocab       u32, u32
    48  rope delta                  i64   M-RoPE position of the next token less `position`
                                          (0 for text; an image's tokens take fewer positions)
    56  reserved                    8 bytes
    64  S      [n_gdn][v_heads, k_dim, v_dim]   fp32   (o = S^T q; HF's layout)
    ..  conv   [n_gdn][kernel-1, conv_channels] fp32   (oldest input first)
    ..  logits [n_vocab]                        fp32   (of the last position)

Attention part, growing with the sequence: K and V of each attention layer in
pages of `block` positions, [block, n_head_kv, head_dim] each, so sequences that
share a prefix can share its pages read-only. Their elements are the state's KV
dtype: f16 (the default, as llama.cpp's cache; values rounded to nearest even on the
way in) or f32. Every engine reads and writes both.
"""
from __future__ import annotations

import struct

import numpy as np

from .config import ModelConfig
from .errors import ContextLengthError, FermoeError

MAGIC = b"FMSTATE1"
LAYOUT_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sII16sQII")

KV_DTYPES = {"f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
DEFAULT_KV_DTYPE = "f16"


def kv_dtype(name: str) -> np.dtype:
    """The numpy dtype of a KV cache dtype name (f16, f32)."""
    if name not in KV_DTYPES:
        raise FermoeError(f"KV cache dtype {name!r}: expected one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def kv_bytes_per_position(cfg: ModelConfig, dtype: str = DEFAULT_KV_DTYPE) -> int:
    """Bytes of K and V one position holds in every attention layer."""
    return len(cfg.attention_layers) * 2 * cfg.n_head_kv * cfg.head_dim * kv_dtype(dtype).itemsize


class StateError(FermoeError):
    """A state buffer or file does not belong to this model or is damaged."""


def recurrent_nbytes(cfg: ModelConfig) -> int:
    """Bytes of the recurrent buffer of one sequence (header included)."""
    return HEADER_BYTES + cfg.recurrent_state_bytes + 4 * cfg.n_vocab


class KVCache:
    """Paged K/V of every attention layer; pages are [block, n_head_kv, head_dim] of
    `dtype` (a KV_DTYPES name)."""

    def __init__(self, cfg: ModelConfig, block: int = 256, dtype: str = DEFAULT_KV_DTYPE):
        self.block = block
        self.dtype_name = dtype
        self.dtype = kv_dtype(dtype)
        self.page_shape = (block, cfg.n_head_kv, cfg.head_dim)
        n = len(cfg.attention_layers)
        self.k_pages: list[list[np.ndarray]] = [[] for _ in range(n)]
        self.v_pages: list[list[np.ndarray]] = [[] for _ in range(n)]
        self.length = [0] * n
        self._tables = None

    def append(self, slot: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K, V [T, n_head_kv, head_dim] of the next T positions of layer `slot`,
        a page's run of rows at a time."""
        t, T = 0, k.shape[0]
        while t < T:
            pos = self.length[slot]
            page, row = divmod(pos, self.block)
            if page == len(self.k_pages[slot]):
                self.k_pages[slot].append(np.zeros(self.page_shape, self.dtype))
                self.v_pages[slot].append(np.zeros(self.page_shape, self.dtype))
                self._tables = None
            n = min(T - t, self.block - row)
            self.k_pages[slot][page][row:row + n] = k[t:t + n]
            self.v_pages[slot][page][row:row + n] = v[t:t + n]
            self.length[slot] = pos + n
            t += n

    def reserve(self, n_positions: int) -> None:
        """Pages for positions [0, n_positions) in every layer, for a native engine to fill."""
        pages = -(-n_positions // self.block)
        for slot in range(len(self.k_pages)):
            while len(self.k_pages[slot]) < pages:
                self.k_pages[slot].append(np.zeros(self.page_shape, self.dtype))
                self.v_pages[slot].append(np.zeros(self.page_shape, self.dtype))
                self._tables = None

    def filled_to(self, n_positions: int) -> None:
        """A native engine wrote K/V up to n_positions in every layer."""
        self.length = [n_positions] * len(self.length)

    def page_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Addresses of the pages, [n_layers, max_pages] uint64 each (K, V), for C."""
        if getattr(self, "_tables", None) is None:
            width = max([len(p) for p in self.k_pages] + [1])
            tables = []
            for pages in (self.k_pages, self.v_pages):
                table = np.zeros((len(pages), width), np.uint64)
                for slot, layer_pages in enumerate(pages):
                    table[slot, :len(layer_pages)] = [p.ctypes.data for p in layer_pages]
                tables.append(table)
            self._tables = tuple(tables)
        return self._tables

    def copy_rows(self, slot: int, start: int, end: int, k_out: np.ndarray, v_out: np.ndarray) -> None:
        """Rows [start, end) of layer `slot`'s K and V into k_out, v_out (in the pages'
        dtype, exact), touching only the pages that hold them."""
        if end > self.length[slot]:
            raise StateError(f"rows up to {end} asked of a layer that holds {self.length[slot]}")
        t = start
        while t < end:
            page, row = divmod(t, self.block)
            n = min(end - t, self.block - row)
            k_out[t - start:t - start + n] = self.k_pages[slot][page][row:row + n]
            v_out[t - start:t - start + n] = self.v_pages[slot][page][row:row + n]
            t += n

    def view(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V of all stored positions of layer `slot`, [P, n_head_kv, head_dim] fp32."""
        n = self.length[slot]
        if n == 0:
            empty = np.zeros((0,) + self.page_shape[1:], np.float32)
            return empty, empty
        k = np.concatenate(self.k_pages[slot])[:n].astype(np.float32, copy=False)
        v = np.concatenate(self.v_pages[slot])[:n].astype(np.float32, copy=False)
        return k, v

    def copy(self) -> "KVCache":
        other = KVCache.__new__(KVCache)
        other.block, other.dtype, other.dtype_name, other.page_shape = self.block, self.dtype, self.dtype_name, self.page_shape
        other.k_pages = [[p.copy() for p in pages] for pages in self.k_pages]
        other.v_pages = [[p.copy() for p in pages] for pages in self.v_pages]
        other.length = list(self.length)
        other._tables = None
        return other


class SequenceState:
    """Recurrent buffer + paged KV of one sequence. `buffer` may be shared memory."""

    def __init__(self, cfg: ModelConfig, fingerprint: str, buffer=None, kv_block: int = 256,
                 kv_dtype: str = DEFAULT_KV_DTYPE):
        self.cfg = cfg
        nbytes = recurrent_nbytes(cfg)
        if buffer is None:
            buffer = bytearray(nbytes)
            _HEADER.pack_into(buffer, 0, MAGIC, LAYOUT_VERSION, 0, _fp_bytes(fingerprint), 0,
                              len(cfg.gdn_layers), cfg.n_vocab)
        elif len(memoryview(buffer).cast("B")) < nbytes:
            raise StateError(f"state buffer holds {len(buffer)} bytes; this model needs {nbytes}")
        self.buffer = buffer
        self._check_header(fingerprint)
        self._bind_views()
        self.kv = KVCache(cfg, kv_block, kv_dtype)

    # ---- header fields ---------------------------------------------------
    def _check_header(self, fingerprint: str) -> None:
        magic, version, _, fp, _, n_gdn, n_vocab = _HEADER.unpack_from(self.buffer, 0)
        if magic != MAGIC:
            raise StateError("not a fermoe sequence state (bad magic)")
        if version != LAYOUT_VERSION:
            raise StateError(f"state layout version {version}, this build reads {LAYOUT_VERSION}")
        if fp != _fp_bytes(fingerprint):
            raise StateError(f"state belongs to model {fp.decode(errors='replace')}, not {fingerprint}")
        if (n_gdn, n_vocab) != (len(self.cfg.gdn_layers), self.cfg.n_vocab):
            raise StateError("state shape does not match the model config")

    @property
    def position(self) -> int:
        return struct.unpack_from("<Q", self.buffer, 32)[0]

    @position.setter
    def position(self, value: int) -> None:
        struct.pack_into("<Q", self.buffer, 32, value)

    @property
    def rope_delta(self) -> int:
        """The next token's M-RoPE position less `position`: 0 until an image, whose
        tokens span fewer positions than they are many (Qwen3.5's get_rope_index)."""
        return struct.unpack_from("<q", self.buffer, 48)[0]

    @rope_delta.setter
    def rope_delta(self, value: int) -> None:
        struct.pack_into("<q", self.buffer, 48, value)

    @property
    def room(self) -> int:
        """Positions the model's context length leaves this sequence."""
        return self.cfg.n_ctx_train - self.position

    def check_room(self, n_tokens: int) -> None:
        """Refuse, before any work, to run n_tokens more than the model's context holds."""
        if n_tokens > self.room:
            raise ContextLengthError(f"{self.position + n_tokens} positions ({self.position} in the sequence, "
                                     f"{n_tokens} new) exceed the model's context length of {self.cfg.n_ctx_train}")

    @property
    def logits_valid(self) -> bool:
        return bool(struct.unpack_from("<I", self.buffer, 12)[0] & 1)

    def set_logits(self, logits: np.ndarray) -> None:
        self.logits[:] = logits
        struct.pack_into("<I", self.buffer, 12, 1)

    # ---- array views -----------------------------------------------------
    def _bind_views(self) -> None:
        cfg = self.cfg
        n_gdn = len(cfg.gdn_layers)
        s_shape = (n_gdn, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim)
        c_shape = (n_gdn, cfg.ssm_conv_kernel - 1, cfg.conv_channels)
        offset = HEADER_BYTES
        self.ssm = np.frombuffer(self.buffer, np.float32, int(np.prod(s_shape)), offset).reshape(s_shape)
        offset += self.ssm.nbytes
        self.conv = np.frombuffer(self.buffer, np.float32, int(np.prod(c_shape)), offset).reshape(c_shape)
        offset += self.conv.nbytes
        self.logits = np.frombuffer(self.buffer, np.float32, cfg.n_vocab, offset)
        self.gdn_slot = {layer: g for g, layer in enumerate(cfg.gdn_layers)}
        self.attn_slot = {layer: a for a, layer in enumerate(cfg.attention_layers)}

    # ---- copies and files ------------------------------------------------
    def fingerprint(self) -> str:
        return _HEADER.unpack_from(self.buffer, 0)[3].rstrip(b"\0").decode()

    def copy(self) -> "SequenceState":
        other = SequenceState(self.cfg, self.fingerprint(), bytearray(self.buffer))
        other.kv = self.kv.copy()
        return other

    def save(self, path) -> None:
        """One file: the recurrent buffer, then K and V of every attention layer (fp32,
        whatever the state's KV dtype: an f16 cache widens exactly)."""
        with open(path, "wb") as f:
            f.write(memoryview(self.buffer).cast("B")[:recurrent_nbytes(self.cfg)])
            for slot in range(len(self.cfg.attention_layers)):
                k, v = self.kv.view(slot)
                f.write(np.ascontiguousarray(k, np.float32).tobytes())
                f.write(np.ascontiguousarray(v, np.float32).tobytes())

    @classmethod
    def load(cls, path, cfg: ModelConfig, fingerprint: str, kv_dtype: str = DEFAULT_KV_DTYPE) -> "SequenceState":
        data = open(path, "rb").read()
        n = recurrent_nbytes(cfg)
        if len(data) < n:
            raise StateError(f"{path}: truncated state file ({len(data)} bytes, need at least {n})")
        state = cls(cfg, fingerprint, bytearray(data[:n]), kv_dtype=kv_dtype)
        per_pos = cfg.n_head_kv * cfg.head_dim * 4
        pos = state.position
        expected = n + 2 * pos * per_pos * len(cfg.attention_layers)
        if len(data) != expected:
            raise StateError(f"{path}: state file has {len(data)} bytes, expected {expected} for position {pos}")
        offset = n
        shape = (pos, cfg.n_head_kv, cfg.head_dim)
        for slot in range(len(cfg.attention_layers)):
            k = np.frombuffer(data, np.float32, pos * cfg.n_head_kv * cfg.head_dim, offset).reshape(shape)
            offset += k.nbytes
            v = np.frombuffer(data, np.float32, k.size, offset).reshape(shape)
            offset += v.nbytes
            state.kv.append(slot, k, v)
        return state


def _fp_bytes(fingerprint: str) -> bytes:
    raw = fingerprint.encode("ascii")[:16]
    return raw.ljust(16, b"\0")


# ---- snapshots: a state at a position, in a slot of shared memory ------------------
#
#   0        recurrent buffer (header, S, conv, logits)      recurrent_nbytes(cfg)
#   R        u64 block_start, u64 rows, u32 KV element bytes  20 bytes, then padding to 64
#   R + 64   K then V of each attention layer, [block][n_head_kv][head_dim] of the KV
#            dtype, rows [block_start, block_start + rows) of the sequence
#
# A snapshot at position p keeps only the KV of its own block; resuming at p reads
# the snapshots of every earlier block boundary for theirs.
_SNAP = struct.Struct("<QQI")


def snapshot_nbytes(cfg: ModelConfig, block: int, kv_dtype_name: str = DEFAULT_KV_DTYPE) -> int:
    kv = 2 * len(cfg.attention_layers) * block * cfg.n_head_kv * cfg.head_dim * kv_dtype(kv_dtype_name).itemsize
    return recurrent_nbytes(cfg) + 64 + kv


def write_snapshot(state: SequenceState, slot, block: int) -> None:
    """Copy `state` (at any position) into a slot: recurrent part + KV of its last block."""
    r = recurrent_nbytes(state.cfg)
    memoryview(slot).cast("B")[:r] = memoryview(state.buffer).cast("B")[:r]
    write_snapshot_kv(state, slot, block, state.position)


def write_snapshot_kv(state: SequenceState, slot, block: int, position: int) -> None:
    """The KV part of a snapshot at `position` (at most state.position): the rows of
    `state`'s pages from the start of the block that holds position - 1 up to position,
    with the header that says where they start. The slot's recurrent part is left alone."""
    cfg, dtype = state.cfg, state.kv.dtype
    view = memoryview(slot).cast("B")
    r = recurrent_nbytes(cfg)
    start = (position - 1) // block * block if position else 0
    _SNAP.pack_into(view, r, start, position - start, dtype.itemsize)
    shape = (block, cfg.n_head_kv, cfg.head_dim)
    offset = r + 64
    page_bytes = int(np.prod(shape)) * dtype.itemsize
    for layer in range(len(cfg.attention_layers)):
        k, v = (np.frombuffer(view, dtype, int(np.prod(shape)), offset + i * page_bytes).reshape(shape)
                for i in (0, 1))
        state.kv.copy_rows(layer, start, position, k, v)
        offset += 2 * page_bytes


def restore_snapshots(cfg: ModelConfig, fingerprint: str, slots, block: int,
                      kv_dtype_name: str = DEFAULT_KV_DTYPE, buffer: bytearray | None = None) -> SequenceState:
    """A fresh state from snapshots in block order; the last one gives the recurrent part.
    buffer: a recurrent buffer to reuse (a finished sequence's), which spares the page
    faults of a new one: most of a large model's restore time."""
    if not slots:
        raise StateError("no snapshot to restore")
    r = recurrent_nbytes(cfg)
    dtype = kv_dtype(kv_dtype_name)
    last = memoryview(slots[-1]).cast("B")
    if buffer is None or len(buffer) != r:
        buffer = bytearray(r)
    memoryview(buffer)[:] = last[:r]
    state = SequenceState(cfg, fingerprint, buffer, kv_block=block, kv_dtype=kv_dtype_name)
    shape = (block, cfg.n_head_kv, cfg.head_dim)
    page_bytes = int(np.prod(shape)) * dtype.itemsize
    expected = 0
    for slot in slots:
        view = memoryview(slot).cast("B")
        start, rows, itemsize = _SNAP.unpack_from(view, r)
        if itemsize != dtype.itemsize:
            raise StateError(f"a snapshot holds {8 * itemsize}-bit KV, expected {kv_dtype_name}")
        if start != expected:
            raise StateError(f"snapshot chain broken: a page starts at {start}, expected {expected}")
        offset = r + 64
        for layer in range(len(cfg.attention_layers)):
            k = np.frombuffer(view, dtype, int(np.prod(shape)), offset).reshape(shape)[:rows]
            v = np.frombuffer(view, dtype, int(np.prod(shape)), offset + page_bytes).reshape(shape)[:rows]
            state.kv.append(layer, k, v)
            offset += 2 * page_bytes
        expected = start + rows
    if expected != state.position:
        raise StateError(f"snapshots cover {expected} positions, the state is at {state.position}")
    return state
