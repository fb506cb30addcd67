"""The state of one sequence: what prefill leaves behind and decode carries on.

It is plain memory so it can live in shared memory and be handed between processes by
name and offset. Two parts: the recurrent part, one buffer of a size fixed by the model
(RecurrentLayout: a 64-byte header, S and the conv state of every GDN layer, the last
position's logits), and the attention part, K and V of each attention layer in pages of
`block` positions (KVCache), so sequences that share a prefix can share its pages
read-only. A snapshot is the state at a position in slots of shared memory: a KV
slot with its own block's K and V (SlotLayout) and, at a resume point, a state slot
with the recurrent buffer. These two layouts are the one description every reader and writer uses:
the array views here, the slot writer and reader, the C engine (given the views'
addresses) and the GPU worker's landing. docs/state.md draws them.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .errors import ContextLengthError, FermoeError

MAGIC = b"FMSTATE1"
LAYOUT_VERSION = 1
DEFAULT_BLOCK = 256        # positions a KV page (and a snapshot) holds, unless --block says otherwise


class HeaderLayout:
    """The recurrent buffer's 64-byte header, little-endian, field by name."""

    FIELDS = {                                     # name: (offset, struct format)
        "magic": (0, "8s"),                         # MAGIC
        "version": (8, "I"),                        # LAYOUT_VERSION
        "flags": (12, "I"),                         # bit 0: the logits are valid
        "fingerprint": (16, "16s"),                 # the model's, ASCII hex, NUL-padded
        "position": (32, "Q"),                      # tokens consumed so far
        "n_gdn_layers": (40, "I"),
        "n_vocab": (44, "I"),
        "rope_delta": (48, "q"),                    # M-RoPE position of the next token less `position`
    }                                               # 56: reserved to 64
    NBYTES = 64
    _structs = {name: struct.Struct("<" + fmt) for name, (_, fmt) in FIELDS.items()}

    @classmethod
    def get(cls, buffer, name: str):
        return cls._structs[name].unpack_from(buffer, cls.FIELDS[name][0])[0]

    @classmethod
    def set(cls, buffer, name: str, value) -> None:
        cls._structs[name].pack_into(buffer, cls.FIELDS[name][0], value)


LOGITS_VALID = 1           # HeaderLayout "flags" bit


@dataclass(frozen=True)
class RecurrentLayout:
    """Where the recurrent buffer of a model's state keeps what, in bytes from its start."""
    ssm_shape: tuple        # [n_gdn][v_heads, k_dim, v_dim] fp32 (o = S^T q; Hugging Face's layout)
    conv_shape: tuple       # [n_gdn][kernel - 1, conv_channels] fp32, oldest input first
    n_vocab: int            # logits of the last position, fp32

    @classmethod
    def of(cls, cfg: ModelConfig) -> "RecurrentLayout":
        n_gdn = len(cfg.gdn_layers)
        return cls((n_gdn, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim),
                   (n_gdn, cfg.ssm_conv_kernel - 1, cfg.conv_channels), cfg.n_vocab)

    @property
    def ssm_offset(self) -> int:
        return HeaderLayout.NBYTES

    @property
    def conv_offset(self) -> int:
        return self.ssm_offset + 4 * int(np.prod(self.ssm_shape))

    @property
    def logits_offset(self) -> int:
        return self.conv_offset + 4 * int(np.prod(self.conv_shape))

    @property
    def nbytes(self) -> int:
        return self.logits_offset + 4 * self.n_vocab

    def views(self, buffer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """S, conv and logits as float32 arrays over `buffer`."""
        def view(offset, shape):
            return np.frombuffer(buffer, np.float32, int(np.prod(shape)), offset).reshape(shape)
        return (view(self.ssm_offset, self.ssm_shape), view(self.conv_offset, self.conv_shape),
                view(self.logits_offset, (self.n_vocab,)))


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
    return RecurrentLayout.of(cfg).nbytes


class KVCache:
    """Paged K/V of every attention layer; pages are [block, n_head_kv, head_dim] of
    `dtype` (a KV_DTYPES name)."""

    def __init__(self, cfg: ModelConfig, block: int = DEFAULT_BLOCK, dtype: str = DEFAULT_KV_DTYPE):
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

    def take_prefix(self, other: "KVCache", n_positions: int) -> None:
        """This (empty) cache takes the first n_positions of `other`'s every layer, a page at
        a time, in its dtype (so exactly)."""
        if (self.block, self.dtype) != (other.block, other.dtype) or any(self.length):
            raise StateError("take_prefix: an empty cache of the same block and dtype takes a prefix")
        full, rest = divmod(n_positions, self.block)
        for slot in range(len(self.k_pages)):
            if n_positions > other.length[slot]:
                raise StateError(f"{n_positions} positions asked of a layer that holds {other.length[slot]}")
            for mine, theirs in ((self.k_pages[slot], other.k_pages[slot]), (self.v_pages[slot], other.v_pages[slot])):
                mine.extend(page.copy() for page in theirs[:full])
                if rest:
                    page = np.zeros(self.page_shape, self.dtype)
                    page[:rest] = theirs[full][:rest]
                    mine.append(page)
            self.length[slot] = n_positions
        self._tables = None

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

    def __init__(self, cfg: ModelConfig, fingerprint: str, buffer=None, kv_block: int = DEFAULT_BLOCK,
                 kv_dtype: str = DEFAULT_KV_DTYPE):
        self.cfg = cfg
        nbytes = recurrent_nbytes(cfg)
        if buffer is None:
            buffer = bytearray(nbytes)
            for name, value in (("magic", MAGIC), ("version", LAYOUT_VERSION), ("fingerprint", _fp_bytes(fingerprint)),
                                ("n_gdn_layers", len(cfg.gdn_layers)), ("n_vocab", cfg.n_vocab)):
                HeaderLayout.set(buffer, name, value)
        elif len(memoryview(buffer).cast("B")) < nbytes:
            raise StateError(f"state buffer holds {len(buffer)} bytes; this model needs {nbytes}")
        self.buffer = buffer
        self._check_header(fingerprint)
        self._bind_views()
        self.kv = KVCache(cfg, kv_block, kv_dtype)

    # ---- header fields ---------------------------------------------------
    def _check_header(self, fingerprint: str) -> None:
        magic, version, fp, n_gdn, n_vocab = (HeaderLayout.get(self.buffer, name) for name in
                                              ("magic", "version", "fingerprint", "n_gdn_layers", "n_vocab"))
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
        return HeaderLayout.get(self.buffer, "position")

    @position.setter
    def position(self, value: int) -> None:
        HeaderLayout.set(self.buffer, "position", value)

    @property
    def rope_delta(self) -> int:
        """The next token's M-RoPE position less `position`: 0 until an image, whose
        tokens span fewer positions than they are many (Qwen3.5's get_rope_index)."""
        return HeaderLayout.get(self.buffer, "rope_delta")

    @rope_delta.setter
    def rope_delta(self, value: int) -> None:
        HeaderLayout.set(self.buffer, "rope_delta", value)

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
        return bool(HeaderLayout.get(self.buffer, "flags") & LOGITS_VALID)

    def set_logits(self, logits: np.ndarray) -> None:
        self.logits[:] = logits
        HeaderLayout.set(self.buffer, "flags", HeaderLayout.get(self.buffer, "flags") | LOGITS_VALID)

    # ---- array views -----------------------------------------------------
    def _bind_views(self) -> None:
        cfg = self.cfg
        self.ssm, self.conv, self.logits = RecurrentLayout.of(cfg).views(self.buffer)
        self.gdn_slot = {layer: g for g, layer in enumerate(cfg.gdn_layers)}
        self.attn_slot = {layer: a for a, layer in enumerate(cfg.attention_layers)}

    # ---- copies and files ------------------------------------------------
    def fingerprint(self) -> str:
        return HeaderLayout.get(self.buffer, "fingerprint").rstrip(b"\0").decode()

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


# ---- snapshots: a state at a position, in slots of shared memory ------------------
@dataclass(frozen=True)
class SlotLayout:
    """One KV slot of the snapshot store: a 64-byte KV header (u64 block start, u64 rows,
    u32 KV element bytes, then padding), then K and V of each attention layer,
    [block][n_head_kv][head_dim] of the KV dtype: rows [block start, block start + rows) of
    the sequence. A snapshot at position p is a KV slot with the KV of its own block and,
    where it is a resume point, a state slot (the recurrent buffer, RecurrentLayout:
    header, S, conv, logits). Resuming at p reads the KV slots of every earlier block
    boundary in order, then p's own KV slot and state slot."""
    n_attention: int
    page_shape: tuple                  # (block, n_head_kv, head_dim)
    dtype: np.dtype

    KV_HEADER = struct.Struct("<QQI")
    KV_HEADER_NBYTES = 64

    @classmethod
    def of(cls, cfg: ModelConfig, block: int, kv_dtype_name: str = DEFAULT_KV_DTYPE) -> "SlotLayout":
        return cls(len(cfg.attention_layers), (block, cfg.n_head_kv, cfg.head_dim), kv_dtype(kv_dtype_name))

    @property
    def page_nbytes(self) -> int:
        return int(np.prod(self.page_shape)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.KV_HEADER_NBYTES + 2 * self.n_attention * self.page_nbytes

    def kv_header(self, slot) -> tuple[int, int, int]:
        """(block start, rows, KV element bytes) of a KV slot."""
        return self.KV_HEADER.unpack_from(self._bytes(slot, self.KV_HEADER_NBYTES), 0)

    def set_kv_header(self, slot, start: int, rows: int) -> None:
        self.KV_HEADER.pack_into(self._bytes(slot), 0, start, rows, self.dtype.itemsize)

    def pages(self, slot, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Attention layer `layer`'s K and V pages of a KV slot, as arrays over it."""
        view = self._bytes(slot)
        offset = self.KV_HEADER_NBYTES + 2 * layer * self.page_nbytes
        n = int(np.prod(self.page_shape))
        return (np.frombuffer(view, self.dtype, n, offset).reshape(self.page_shape),
                np.frombuffer(view, self.dtype, n, offset + self.page_nbytes).reshape(self.page_shape))

    def _bytes(self, slot, need: int | None = None) -> memoryview:
        view = memoryview(slot).cast("B")
        if len(view) < (self.nbytes if need is None else need):
            raise StateError(f"a KV slot of {len(view)} bytes; this model's block of {self.page_shape[0]} "
                             f"{self.dtype.name} positions needs {self.nbytes}")
        return view


def kv_slot_nbytes(cfg: ModelConfig, block: int, kv_dtype_name: str = DEFAULT_KV_DTYPE) -> int:
    """Bytes of a KV slot: one block's K and V in every attention layer, and its header."""
    return SlotLayout.of(cfg, block, kv_dtype_name).nbytes


def state_slot_nbytes(cfg: ModelConfig) -> int:
    """Bytes of a state slot: the recurrent buffer."""
    return recurrent_nbytes(cfg)


def write_snapshot(state: SequenceState, kv_slot, state_slot, block: int, position: int | None = None) -> None:
    """A snapshot of `state` at `position` (default: its own): its last block's KV into
    kv_slot, its recurrent part into state_slot (then at its own position only); either
    may be None (a KV link of a chain, or a state for a cached block)."""
    position = state.position if position is None else position
    if kv_slot is not None:
        write_snapshot_kv(state, kv_slot, block, position)
    if state_slot is not None:
        if position != state.position:
            raise StateError(f"a state slot at position {position} written from a state at {state.position}")
        write_snapshot_state(state, state_slot)


def write_snapshot_state(state: SequenceState, slot) -> None:
    """The recurrent part of `state` (header, S, conv, logits) into a state slot."""
    r = recurrent_nbytes(state.cfg)
    dst = memoryview(slot).cast("B")
    if len(dst) < r:
        raise StateError(f"a state slot of {len(dst)} bytes; this model's recurrent state needs {r}")
    dst[:r] = memoryview(state.buffer).cast("B")[:r]


def write_snapshot_kv(state: SequenceState, slot, block: int, position: int) -> None:
    """The KV of a snapshot at `position` (at most state.position) into a KV slot: the rows
    of `state`'s pages from the start of the block that holds position - 1 up to position,
    with the header that says where they start."""
    layout = SlotLayout.of(state.cfg, block, state.kv.dtype_name)
    start = (position - 1) // block * block if position else 0
    layout.set_kv_header(slot, start, position - start)
    for layer in range(layout.n_attention):
        state.kv.copy_rows(layer, start, position, *layout.pages(slot, layer))


def restore_snapshots(cfg: ModelConfig, fingerprint: str, kv_slots, state_slot, block: int,
                      kv_dtype_name: str = DEFAULT_KV_DTYPE, buffer: bytearray | None = None) -> SequenceState:
    """A fresh state from a snapshot: the KV slots of its chain in block order (its own
    last), and its state slot, which gives the recurrent part.
    buffer: a recurrent buffer to reuse (a finished sequence's), which spares the page
    faults of a new one: most of a large model's restore time."""
    if not kv_slots or state_slot is None:
        raise StateError("no snapshot to restore: a resume needs its KV slots and a state slot")
    layout = SlotLayout.of(cfg, block, kv_dtype_name)
    r = recurrent_nbytes(cfg)
    src = memoryview(state_slot).cast("B")
    if len(src) < r:
        raise StateError(f"a state slot of {len(src)} bytes; this model's recurrent state needs {r}")
    if buffer is None or len(buffer) != r:
        buffer = bytearray(r)
    memoryview(buffer)[:] = src[:r]
    state = SequenceState(cfg, fingerprint, buffer, kv_block=block, kv_dtype=kv_dtype_name)
    expected = 0
    for slot in kv_slots:
        start, rows, itemsize = layout.kv_header(slot)
        if itemsize != layout.dtype.itemsize:
            raise StateError(f"a snapshot holds {8 * itemsize}-bit KV, expected {kv_dtype_name}")
        if start != expected:
            raise StateError(f"snapshot chain broken: a page starts at {start}, expected {expected}")
        if rows > block:
            raise StateError(f"a KV slot says {rows} rows, more than its block of {block}")
        for layer in range(layout.n_attention):
            k, v = layout.pages(slot, layer)
            state.kv.append(layer, k[:rows], v[:rows])
        expected = start + rows
    if expected != state.position:
        raise StateError(f"snapshots cover {expected} positions, the state is at {state.position}")
    return state
