"""The native CPU kernels: C built by cffi in API mode during `pip install -e .`.

`lib` holds the C API of native/kernels.h and `ffi` its cffi handle; the functions
below wrap them for numpy arrays: weights and activations as the uint8 block bytes
that shared.quants produces (Q4_0: 18 B, Q8_0: 34 B per 32 elements), float32 or
float16 otherwise. Calls release the GIL, so threads can split the rows of a matrix.

ISA: the best one the CPU supports, unless FERMOE_ISA=scalar|ssse3|avx2|avx512vnni
or set_isa()/use_isa() choose another. FERMOE_MAX_ISA=NAME hides the levels above
NAME, so this machine behaves as an older CPU would (tests of its skips and refusals).
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np

from shared.errors import FermoeError

try:
    from native._fermoe_native import ffi, lib
except ImportError as e:  # keep the one useful line on top of the chain
    raise ImportError("the native extension is not built: run pip install -e . "
                      "(needs a C compiler: gcc)") from e

QK = 32
Q4_0_BYTES = 18
Q8_0_BYTES = 34
ISAS = tuple(ffi.string(lib.fm_isa_name(i)).decode() for i in range(4))


class ISAError(FermoeError):
    """An ISA was asked for by name (FERMOE_ISA or set_isa) that is unknown or that this CPU lacks."""


def supported_isas() -> list[str]:
    return [n for i, n in enumerate(ISAS) if lib.fm_isa_supported(i)]


def best_isa() -> str:
    return ISAS[lib.fm_best_isa()]


def get_isa() -> str:
    return ISAS[lib.fm_get_isa()]


def _isa_problem(name: str, source: str) -> str:
    if name not in ISAS:
        return f"{source}={name!r} is not one of {', '.join(ISAS)}"
    cap = os.environ.get("FERMOE_MAX_ISA")
    hidden = f"; FERMOE_MAX_ISA={cap} hides the rest" if cap else ""
    return f"{source}={name}: this CPU lacks {name} (it supports {', '.join(supported_isas())}{hidden})"


def set_isa(name: str) -> None:
    """Run every kernel with `name` from now on (process-wide)."""
    idx = ISAS.index(name) if name in ISAS else -1
    if idx < 0 or lib.fm_set_isa(idx) < 0:
        raise ISAError(_isa_problem(name, "isa"))


@contextmanager
def use_isa(name: str):
    """Temporarily select an ISA (tests, benchmarks); not for concurrent use."""
    old = get_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(old)


def _init() -> None:
    status = lib.fm_init_dispatch()
    if status == -3:
        raise ISAError(_isa_problem(os.environ.get("FERMOE_MAX_ISA", ""), "FERMOE_MAX_ISA"))
    if status != 0:
        raise ISAError(_isa_problem(os.environ.get("FERMOE_ISA", ""), "FERMOE_ISA"))


_init()


# ---------------------------------------------------------------- array plumbing

def _ptr(arr: np.ndarray, ctype: str, dtype, what: str):
    if arr.dtype != dtype:
        raise TypeError(f"{what} must be {np.dtype(dtype).name}, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    return ffi.cast(ctype, ffi.from_buffer(arr))


def _cols_of(nbytes_row: int, block_bytes: int, what: str) -> int:
    if nbytes_row % block_bytes:
        raise ValueError(f"{what}: a row of {nbytes_row} bytes is not whole {block_bytes}-byte blocks")
    return nbytes_row // block_bytes * QK


def _row_range(rows: int, row_begin: int, row_end: int | None) -> tuple[int, int]:
    row_end = rows if row_end is None else row_end
    if not 0 <= row_begin <= row_end <= rows:
        raise ValueError(f"row range [{row_begin}, {row_end}) is outside [0, {rows})")
    return row_begin, row_end


# weight kind -> (numpy dtype of W, cffi type, block bytes or None for plain floats)
_WEIGHTS = {
    "q4_0": (np.uint8, "block_q4_0 *", Q4_0_BYTES),
    "q8_0": (np.uint8, "block_q8_0 *", Q8_0_BYTES),
    "f32": (np.float32, "float *", None),
    "f16": (np.uint16, "uint16_t *", None),
}


def _weights(W: np.ndarray, kind: str):
    """(pointer, rows, cols) of a 2-D weight matrix of `kind`."""
    dtype, ctype, bb = _WEIGHTS[kind]
    W = W.view(np.uint16) if kind == "f16" and W.dtype == np.float16 else W
    if W.ndim != 2:
        raise ValueError(f"{kind} weights must be 2-D [rows, row bytes or cols], got shape {W.shape}")
    cols = _cols_of(W.shape[1], bb, f"{kind} weights") if bb else W.shape[1]
    if cols % QK:
        raise ValueError(f"{kind} weights: cols={cols} is not a multiple of {QK}")
    return _ptr(W, ctype, dtype, f"{kind} weights"), W.shape[0], cols


def _activations(X: np.ndarray, kind: str, cols: int, batched: bool):
    """Pointer to Q8_0 bytes (integer weights) or float32 (float weights) matching cols."""
    want = cols // QK * Q8_0_BYTES if kind in ("q4_0", "q8_0") else cols
    if X.ndim != (2 if batched else 1) or X.shape[-1] != want:
        raise ValueError(f"activations of shape {X.shape} do not match {cols} columns "
                         f"(expected {'[B, ' if batched else '['}{want}])")
    if kind in ("q4_0", "q8_0"):
        return _ptr(X, "block_q8_0 *", np.uint8, "Q8_0 activations")
    return _ptr(X, "float *", np.float32, "activations")


# ---------------------------------------------------------------- kernels

def quantize_row_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n], n % 32 == 0 -> uint8 [..., n/32*34] (bit-exact with shared.quants)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or n % QK:
        raise ValueError(f"Q8_0 rows need a multiple of {QK} elements, got {n}")
    out = np.empty(x.shape[:-1] + (n // QK * Q8_0_BYTES,), np.uint8)
    lib.fm_quantize_row_q8_0(_ptr(x, "float *", np.float32, "x"), _ptr(out, "block_q8_0 *", np.uint8, "out"), x.size)
    return out


def vec_dot(w: np.ndarray, x: np.ndarray, kind: str = "q4_0") -> float:
    """One row of Q4_0 or Q8_0 bytes . one Q8_0 activation row."""
    wp, _, cols = _weights(w.reshape(1, -1), kind)
    xp = _activations(x, kind, cols, batched=False)
    fn = lib.fm_vec_dot_q4_0_q8_0 if kind == "q4_0" else lib.fm_vec_dot_q8_0_q8_0
    return float(fn(cols, wp, xp))


def matvec(W: np.ndarray, x: np.ndarray, kind: str, row_begin: int = 0, row_end: int | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """y[r] = W[r] . x for r in [row_begin, row_end); y has all rows, others untouched.

    kind: "q4_0"/"q8_0" (W block bytes, x Q8_0 bytes) or "f32"/"f16" (x float32)."""
    wp, rows, cols = _weights(W, kind)
    xp = _activations(x, kind, cols, batched=False)
    r0, r1 = _row_range(rows, row_begin, row_end)
    y = np.zeros(rows, np.float32) if out is None else out
    if y.shape != (rows,):
        raise ValueError(f"out must have shape ({rows},), got {y.shape}")
    yp = _ptr(y, "float *", np.float32, "out")
    getattr(lib, f"fm_matvec_{kind}")(wp, xp, yp, cols, r0, r1)
    return y


def matmul(W: np.ndarray, X: np.ndarray, kind: str, row_begin: int = 0, row_end: int | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Y[b, r] = W[r] . X[b]: each weight row read once for the whole batch.

    kind: "q4_0"/"q8_0" (X: [B, Q8_0 bytes]) or "f32" (X: float32 [B, cols])."""
    if kind == "f16":
        raise ValueError("no batched F16 kernel: convert the weights to f32")
    wp, rows, cols = _weights(W, kind)
    xp = _activations(X, kind, cols, batched=True)
    r0, r1 = _row_range(rows, row_begin, row_end)
    B = X.shape[0]
    Y = np.zeros((B, rows), np.float32) if out is None else out
    if Y.ndim != 2 or Y.shape[0] != B or Y.shape[1] < r1 or not Y.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous [{B}, >= {r1}] float32 array, got {Y.shape}")
    yp = _ptr(Y, "float *", np.float32, "out")
    getattr(lib, f"fm_matmul_{kind}")(wp, xp, yp, cols, B, Y.shape[1], r0, r1)
    return Y


def read_sum(buf: np.ndarray, prefetched: bool = False) -> int:
    """Sum of the 64-bit words of buf (whole 128-byte lines): a memory read probe;
    `prefetched`: the loop that also prefetches ahead as the kernels do."""
    fn = lib.fm_read_sum_prefetched if prefetched else lib.fm_read_sum
    return int(fn(ffi.from_buffer(buf), buf.nbytes))


class Pool:
    """The forward's pinned thread pool (native/threadpool.c), for benchmarks that
    must run the way the engine does: threads created once, pinned to `cpus`."""

    def __init__(self, cpus: list[int]):
        if not cpus:
            raise ValueError("a pool needs at least one CPU")
        self.cpus = list(cpus)
        self._pool = lib.fm_pool_create(len(self.cpus), ffi.new("int[]", self.cpus))
        if self._pool == ffi.NULL:
            raise OSError(f"could not create a thread pool pinned to CPUs {self.cpus}")

    def close(self) -> None:
        if self._pool is not None:
            lib.fm_pool_destroy(self._pool)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_gbps(self, buf: np.ndarray, reps: int = 5) -> float:
        """Best GB/s of reps parallel read passes over buf."""
        return lib.fm_pool_read_gbps(self._pool, ffi.from_buffer(buf), buf.nbytes, reps)

    def read_seconds(self, buf: np.ndarray, prefetched: bool = False) -> float:
        """Seconds of one parallel read pass over buf (`prefetched`: see read_sum)."""
        fn = lib.fm_pool_read_prefetched_seconds if prefetched else lib.fm_pool_read_seconds
        return fn(self._pool, ffi.from_buffer(buf), buf.nbytes)

    def matvec_q4_0_seconds(self, W: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> float:
        """Seconds of one Q4_0 x Q8_0 product W . x, rows split over the pool in
        ~4 MB tasks; the product is left in `out` when given."""
        wp, rows, cols = _weights(W, "q4_0")
        xp = _activations(x, "q4_0", cols, batched=False)
        y = np.empty(rows, np.float32) if out is None else out
        if y.shape != (rows,) or y.dtype != np.float32 or not y.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 array of shape ({rows},)")
        return lib.fm_pool_matvec_q4_0_seconds(self._pool, wp, xp, ffi.cast("float *", ffi.from_buffer(y)), rows, cols)

    def regions_q4_0_seconds(self, buf: np.ndarray, regions: list[list[tuple[int, int]]]) -> float:
        """Seconds of a sequence of parallel regions as the forward runs them (fm_run_jobs),
        each a list of Q4_0 matrices (rows, cols) read from `buf` one after the other,
        against one random Q8_0 vector."""
        shapes = [shape for region in regions for shape in region]
        rows = np.array([r for r, _ in shapes], np.int32)
        cols = np.array([c for _, c in shapes], np.int32)
        if (cols % 32).any() or (rows < 1).any():
            raise ValueError("matrices need rows >= 1 and columns in multiples of 32")
        sizes = rows.astype(np.int64) * (cols // 32) * 18
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        if int(sizes.sum()) > buf.nbytes:
            raise ValueError(f"the regions read {int(sizes.sum())} bytes of a {buf.nbytes}-byte buffer")
        ends = np.cumsum([len(region) for region in regions]).astype(np.int32)
        x = quantize_row_q8_0(np.random.default_rng(0).standard_normal(int(cols.max())).astype(np.float32))
        y = np.empty(max(sum(r for r, _ in region) for region in regions), np.float32)
        ptr = ffi.cast("void *", ffi.from_buffer(buf))
        return lib.fm_pool_regions_q4_0_seconds(
            self._pool, ptr, ffi.cast("int64_t *", ffi.from_buffer(offsets)), ffi.cast("int *", ffi.from_buffer(rows)),
            ffi.cast("int *", ffi.from_buffer(cols)), len(shapes), ffi.cast("int *", ffi.from_buffer(ends)), len(ends),
            ffi.cast("void *", ffi.from_buffer(x)), ffi.cast("float *", ffi.from_buffer(y)))
