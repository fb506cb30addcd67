"""Numpy spec of the ggml quant formats we read and write.

Bit-exact with llama.cpp's `gguf.quants` (the oracle in tests/shared/test_quants.py).
Every format is a sequence of blocks; a row (innermost dimension) is a whole
number of blocks; all multi-byte fields are little-endian; "fp16" is IEEE half.

    Q4_0  32 elems, 18 B   | d fp16 | qs[16]: lo nibble = elem j, hi = elem j+16 |
                           x = (q - 8) * d
    Q8_0  32 elems, 34 B   | d fp16 | qs[32] int8 |                 x = q * d
    Q5_0  32 elems, 22 B   | d fp16 | qh u32: bit j = 5th bit of elem j | qs[16] as Q4_0 |
                           x = (q - 16) * d
    Q4_K  256 elems, 144 B | d fp16 | dmin fp16 | scales[12] | qs[128] |
                           8 sub-blocks of 32; qs byte l of 32-byte group g holds
                           sub-block 2g (lo nibble) and 2g+1 (hi), element l;
                           x = d*sc[j] * q - dmin*m[j], sc/m 6-bit, packed:
                           bytes 0-3 sc0-3 (+hi 2 bits of sc4-7), 4-7 m0-3 (+hi of m4-7),
                           8-11 lo nibble sc4-7, hi nibble m4-7
    Q5_K  256 elems, 176 B | d | dmin | scales[12] | qh[32] | qs[128] |
                           as Q4_K plus 5th bit of sub-block j, elem l = bit j of qh[l]
    Q6_K  256 elems, 210 B | ql[128] | qh[64] | scales[16] int8 | d fp16 |
                           two halves of 128: low 4 bits from ql (64 B: lo nibbles
                           elems 0-63, hi nibbles 64-127), high 2 bits from qh (32 B:
                           bits 0-1 elems 0-31, 2-3 32-63, 4-5 64-95, 6-7 96-127);
                           x = d * scales[e // 16] * (q - 32)
    F32 / F16 / BF16       plain elements (BF16 = top 16 bits of an f32)

Work is done in chunks of ~512K elements: temporaries stay cache-sized, and peak
extra memory is bounded whatever the tensor size (the converter streams GBs).
"""
import numpy as np

from shared.ggml_types import BLOCK_GEOMETRY, GGMLType, tensor_nbytes

_CHUNK_ELEMS = 1 << 19  # ~2 MB of float32 per step: fits L2, amortises numpy call overhead


# ---------------------------------------------------------------- helpers

def _fp16(cols: np.ndarray) -> np.ndarray:
    """(k, 2) uint8 columns of an fp16 field -> (k, 1) float32."""
    return cols.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(k, ..., m) packed bytes -> (k, ..., 2m): all low nibbles, then all high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _recip(d: np.ndarray) -> np.ndarray:
    """1/d in float32, 0 where d == 0 (ggml: `id = d ? 1.0f/d : 0.0f`)."""
    r = np.float32(1) / d
    r[d == 0] = 0
    return r


def _zero_nonfinite(v: np.ndarray, d: np.ndarray, inv: np.ndarray) -> None:
    """Make non-finite pre-cast values 0, in place.

    They arise only in blocks whose scale is inf/NaN (inf/NaN input) or whose
    1/d overflows (|max| below ~2e-38). gguf then casts inf/NaN to an integer,
    which numpy on x86 turns into 0; doing it explicitly keeps us bit-exact
    with gguf there and deterministic everywhere. Only those rare blocks are
    touched, so the common path pays one per-block test.
    """
    bad = ~np.isfinite(d[:, 0]) | np.isinf(inv[:, 0])
    if bad.any():
        sub = v[bad]
        sub[~np.isfinite(sub)] = 0
        v[bad] = sub


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """roundf(): like np.rint but ties go away from zero (ggml's Q8_0 rounding)."""
    r = np.rint(v)
    # v - r is exact; a tie that rint sent toward zero leaves +-0.5 with v's sign.
    tie = np.nonzero(v - r == np.copysign(np.float32(0.5), v))
    r[tie] += np.copysign(np.float32(1), v[tie])
    return r


def _map_blocks(kernel, blocks: np.ndarray, width: int, dtype, elems: int) -> np.ndarray:
    """out[i] = kernel(blocks[i]) for (nblocks, ...) blocks, a chunk at a time."""
    out = np.empty((blocks.shape[0], width), dtype)
    step = max(1, _CHUNK_ELEMS // elems)
    with np.errstate(all="ignore"):  # inf/NaN inputs are handled explicitly, as gguf does
        for s in range(0, blocks.shape[0], step):
            kernel(blocks[s:s + step], out[s:s + step])
    return out


def _as_type(qtype) -> GGMLType:
    """Accept our GGMLType, gguf's GGMLQuantizationType or a plain int."""
    try:
        return GGMLType(int(qtype))
    except ValueError:
        raise ValueError(f"unsupported ggml type {getattr(qtype, 'name', qtype)!r}") from None


# ---------------------------------------------------------------- quantise kernels
# Each takes a (k, block) chunk in the caller's dtype and fills a (k, nbytes) uint8 chunk.

def _q_f32(b, out):
    out.view(np.float32)[:] = b


def _q_f16(b, out):
    out.view(np.float16)[:] = b  # direct cast, as gguf's astype(float16): round to nearest even


def _q_bf16(b, out):
    n = b.astype(np.float32).view(np.uint32)
    # NaN stays NaN (quiet bit set) instead of possibly rounding to inf.
    n = np.where((n & 0x7FFFFFFF) > 0x7F800000, (n & 0xFFFF0000) | 0x00400000, n)
    # Round to nearest even on the 16 dropped bits; cannot overflow uint32.
    out.view(np.uint16)[:] = (n + (0x7FFF + ((n >> 16) & 1))) >> 16


def _q_q8_0(b, out):
    b = b.astype(np.float32, copy=False)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    inv = _recip(d)
    q = _round_half_away(b * inv)
    _zero_nonfinite(q, d, inv)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)


def _q_q4_0(b, out):
    b = b.astype(np.float32, copy=False)
    # The signed element of largest magnitude (first one on ties) maps to -8.
    at = np.abs(b).argmax(axis=1)[:, None]
    d = np.take_along_axis(b, at, axis=1) / np.float32(-8)
    inv = _recip(d)
    v = b * inv
    v += np.float32(8.5)  # then truncate: round-to-nearest around the +8 offset
    _zero_nonfinite(v, d, inv)
    q = v.astype(np.uint8)  # v >= 0 here, so the cast truncates like int()
    np.minimum(q, 15, out=q)  # x near -max (opposite sign) reaches 16
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)


# ---------------------------------------------------------------- dequantise kernels
# Each takes a (k, nbytes) uint8 chunk and fills a (k, block) float32 chunk. The
# order of float32 operations follows gguf's, so results match to the bit.

def _dq_f32(b, out):
    out[:] = b.view(np.float32)


def _dq_f16(b, out):
    out[:] = b.view(np.float16)


def _dq_bf16(b, out):
    out[:] = (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _dq_q4_0(b, out):
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    np.multiply(_fp16(b[:, :2]), q, out=out, dtype=np.float32)


def _dq_q8_0(b, out):
    np.multiply(_fp16(b[:, :2]), b[:, 2:].view(np.int8), out=out, dtype=np.float32)


def _dq_q5_0(b, out):
    hi = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")  # bit j of the LE u32 = elem j
    q = (_nibbles(b[:, 6:]) | (hi << 4)).astype(np.int8) - np.int8(16)
    np.multiply(_fp16(b[:, :2]), q, out=out, dtype=np.float32)


def _k_scales(s: np.ndarray):
    """(k, 12) packed 6-bit scales/mins of Q4_K/Q5_K -> (k, 8) float32 each."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b, q, out):
    """Q4_K/Q5_K: x = (d*sc) * q - (dmin*m), per 32-element sub-block."""
    sc, mn = _k_scales(b[:, 4:16])
    scale = (_fp16(b[:, 0:2]) * sc)[:, :, None]
    offset = (_fp16(b[:, 2:4]) * mn)[:, :, None]
    out[:] = (scale * q.astype(np.float32) - offset).reshape(out.shape)


def _dq_q4_k(b, out):
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32))  # (k, 4 groups, 64) = sub-blocks in order
    _k_affine(b, q.reshape(-1, 8, 32), out)


def _dq_q5_k(b, out):
    lo = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    shifts = np.arange(8, dtype=np.uint8)[:, None]
    hi = (b[:, None, 16:48] >> shifts) & 1  # (k, 8 sub-blocks, 32)
    _k_affine(b, lo | (hi << 4), out)


def _dq_q6_k(b, out):
    lo = _nibbles(b[:, :128].reshape(-1, 2, 64))  # (k, half, 128)
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    hi = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3  # (k, half, 4, 32)
    q = (lo | (hi.reshape(-1, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    scale = _fp16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    q = q.reshape(-1, 16, 16).astype(np.float32)
    out[:] = (scale[:, :, None] * q).reshape(out.shape)


_QUANTIZE = {
    GGMLType.F32: _q_f32, GGMLType.F16: _q_f16, GGMLType.BF16: _q_bf16,
    GGMLType.Q8_0: _q_q8_0, GGMLType.Q4_0: _q_q4_0,
}
_DEQUANTIZE = {
    GGMLType.F32: _dq_f32, GGMLType.F16: _dq_f16, GGMLType.BF16: _dq_bf16,
    GGMLType.Q4_0: _dq_q4_0, GGMLType.Q8_0: _dq_q8_0, GGMLType.Q5_0: _dq_q5_0,
    GGMLType.Q4_K: _dq_q4_k, GGMLType.Q5_K: _dq_q5_k, GGMLType.Q6_K: _dq_q6_k,
}
DEQUANTIZABLE = frozenset(_DEQUANTIZE)       # the types a model may hold: converted at load if not run as they are


# ---------------------------------------------------------------- row-level drivers

def _quantize_rows(x, qtype: GGMLType) -> np.ndarray:
    """float [..., n] -> uint8 [..., n/block*nbytes]."""
    x = np.asarray(x)
    elems, nbytes = BLOCK_GEOMETRY[qtype]
    if x.ndim == 0 or x.shape[-1] % elems:
        n = x.shape[-1] if x.ndim else "a scalar"
        raise ValueError(f"{qtype.name} rows need a multiple of {elems} elements, got {n}")
    # A view for contiguous input (the usual case: memmaps, fresh arrays); a strided
    # view is copied once here, in its own dtype.
    blocks = x.reshape(-1, elems)
    out = _map_blocks(_QUANTIZE[qtype], blocks, nbytes, np.uint8, elems)
    return out.reshape(*x.shape[:-1], x.shape[-1] // elems * nbytes)


def _dequantize_rows(raw, qtype: GGMLType) -> np.ndarray:
    """uint8 [..., nb*nbytes] -> float32 [..., nb*block]."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"{qtype.name} data must be uint8 bytes, got {raw.dtype}")
    elems, nbytes = BLOCK_GEOMETRY[qtype]
    if raw.ndim == 0 or raw.shape[-1] % nbytes:
        n = raw.shape[-1] if raw.ndim else "a scalar"
        raise ValueError(f"{qtype.name} rows need a multiple of {nbytes} bytes, got {n}")
    out = _map_blocks(_DEQUANTIZE[qtype], raw.reshape(-1, nbytes), elems, np.float32, elems)
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes * elems)


# ---------------------------------------------------------------- public API

def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """float [..., n], n % 32 == 0 -> uint8 [..., n//32*18]."""
    return _quantize_rows(x, GGMLType.Q4_0)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., nb*18] -> float32 [..., nb*32]."""
    return _dequantize_rows(raw, GGMLType.Q4_0)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float [..., n], n % 32 == 0 -> uint8 [..., n//32*34]."""
    return _quantize_rows(x, GGMLType.Q8_0)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., nb*34] -> float32 [..., nb*32]."""
    return _dequantize_rows(raw, GGMLType.Q8_0)


def quantize(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """float [..., n] -> uint8 [..., row bytes] in F32, F16, BF16, Q8_0 or Q4_0."""
    qtype = _as_type(qtype)
    if qtype not in _QUANTIZE:
        raise ValueError(f"cannot quantize to {qtype.name}: only "
                         f"{', '.join(t.name for t in _QUANTIZE)}")
    return _quantize_rows(x, qtype)


def dequantize(raw: np.ndarray, qtype: GGMLType, shape: tuple) -> np.ndarray:
    """The uint8 bytes of a whole tensor -> float32 array of numpy-order `shape`."""
    qtype = _as_type(qtype)
    if qtype not in _DEQUANTIZE:
        raise ValueError(f"cannot dequantize {qtype.name}: only "
                         f"{', '.join(t.name for t in _DEQUANTIZE)}")
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError(f"{qtype.name} tensor needs at least one dimension")
    expected = tensor_nbytes(qtype, shape)  # ValueError if the row is not whole blocks
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, np.uint8)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"{qtype.name} data must be uint8 bytes, got {raw.dtype}")
    if raw.size != expected:
        raise ValueError(f"{qtype.name} tensor of shape {shape}: expected {expected} bytes, "
                         f"got {raw.size}")
    return _dequantize_rows(raw.reshape(-1), qtype).reshape(shape)
