"""shared.quants against llama.cpp's own python package (gguf.quants) as the oracle.

Every comparison is bit-exact: quantised bytes equal, dequantised floats equal as
uint32 bit patterns (so NaN payloads and signed zeros count too).
"""
import warnings

import numpy as np
import pytest

from shared import quants
from shared.ggml_types import BLOCK_GEOMETRY, GGMLType, tensor_nbytes

gguf = pytest.importorskip("gguf")
GQ = gguf.GGMLQuantizationType

RNG = np.random.default_rng(1234)
NAME = lambda t: t.name  # noqa: E731  readable test ids


def oracle_quantize(x, qtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # gguf warns on inf/NaN/tiny blocks
        return np.ascontiguousarray(gguf.quants.quantize(x, GQ[qtype.name])).view(np.uint8)


def oracle_dequantize(raw, qtype, shape):
    rows = raw.reshape(-1, tensor_nbytes(qtype, shape[-1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return gguf.quants.dequantize(rows, GQ[qtype.name]).reshape(shape)


def assert_bits_equal(ours, theirs):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    if ours.dtype == np.float32:
        assert theirs.dtype == np.float32
        ours, theirs = ours.view(np.uint32), theirs.view(np.uint32)
    np.testing.assert_array_equal(ours, theirs)


def check_roundtrip(x, qtype):
    """quantize and dequantize(*) agree bit for bit with gguf."""
    raw = quants.quantize(x, qtype)
    assert raw.dtype == np.uint8
    assert_bits_equal(raw, oracle_quantize(x, qtype).reshape(raw.shape))
    back = quants.dequantize(raw, qtype, x.shape)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert_bits_equal(back, oracle_dequantize(raw, qtype, x.shape))
    return raw


def special_blocks() -> np.ndarray:
    """(n, 32) float32 blocks aimed at the corners of Q4_0/Q8_0 quantisation."""
    blocks = []
    base = RNG.standard_normal((1, 32)).astype(np.float32)
    blocks.append(np.zeros(32, np.float32))                      # d == 0
    for v in (5.0, -5.0, 1e4, -3e-3):                             # single outlier
        b = np.zeros(32, np.float32)
        b[7] = v
        blocks.append(b)
    b = base[0].copy()
    b[3] = -10.0                                                  # negative max
    blocks.append(b)
    b = base[0].copy()
    b[3], b[20] = -10.0, 10.0                                     # +-max tie: first wins
    blocks.append(b)
    blocks.append(-b)
    blocks.append(np.full(32, -2.0, np.float32))                  # -max -> q = 16 -> clip 15
    # Q8_0 rounding ties: amax 127 -> d = 1, so x.5 values are exact ties.
    blocks.append(np.array([127, -127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5] * 4, np.float32))
    blocks.append(np.array([np.nextafter(np.float32(0.5), np.float32(0))] * 31 + [127],
                           np.float32))                           # just below a tie
    for scale in (1e-30, 1e-37, 2e-38, 3e-39, 1e-40, 1e-44,       # tiny; 1/d overflows
                  1e4, 5.3e5, 1e6, 3e37):                         # huge; fp16 d overflows
        blocks.append(base[0] * np.float32(scale))
    # Scales on fp16 rounding edges: d = max/8 (Q4_0) or amax/127 (Q8_0) exactly
    # halfway between fp16 neighbours, or at the fp16 normal/subnormal boundary.
    for d in (1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25,
              3 * 2.0 ** -26, 65504.0, 65520.0):
        for div in (-8.0, 127.0):
            b = base[0] / np.abs(base[0]).max() * np.float32(abs(d * div))
            b[0] = d * div  # first, so it wins any magnitude tie
            blocks.append(b)
    return np.stack(blocks).astype(np.float32)


# ---------------------------------------------------------------- Q4_0 / Q8_0

@pytest.mark.parametrize("qtype", ids=NAME, argvalues=[GGMLType.Q4_0, GGMLType.Q8_0])
@pytest.mark.parametrize("shape", [(32,), (1, 32), (3, 64), (7, 256), (5, 3, 96), (2, 3, 4, 32)])
def test_random_roundtrip_bit_exact(qtype, shape):
    x = (RNG.standard_normal(shape) * RNG.uniform(0.01, 10, shape[:-1] + (1,))).astype(np.float32)
    check_roundtrip(x, qtype)


@pytest.mark.parametrize("qtype", ids=NAME, argvalues=[GGMLType.Q4_0, GGMLType.Q8_0])
def test_special_blocks_bit_exact(qtype):
    check_roundtrip(special_blocks(), qtype)


@pytest.mark.parametrize("qtype", ids=NAME, argvalues=[GGMLType.Q4_0, GGMLType.Q8_0])
def test_nonfinite_input_matches_gguf(qtype):
    x = RNG.standard_normal((4, 32)).astype(np.float32)
    x[0, 5], x[1, 9], x[2, 0], x[3, 31] = np.inf, -np.inf, np.nan, np.nan
    x[2, 4] = np.inf
    assert_bits_equal(quants.quantize(x, qtype), oracle_quantize(x, qtype))


def test_named_wrappers_match_generic():
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    for q, dq, t in ((quants.quantize_q4_0, quants.dequantize_q4_0, GGMLType.Q4_0),
                     (quants.quantize_q8_0, quants.dequantize_q8_0, GGMLType.Q8_0)):
        raw = q(x)
        assert raw.shape == (3, 64 // 32 * BLOCK_GEOMETRY[t][1])
        assert_bits_equal(raw, quants.quantize(x, t))
        assert_bits_equal(dq(raw), quants.dequantize(raw, t, x.shape))


def test_q4_0_layout_by_hand():
    # max element -8 -> d = 1: q = x + 8; element j in low nibble, j+16 in high.
    x = np.arange(32, dtype=np.float32) % 16 - 8
    raw = quants.quantize_q4_0(x)
    assert raw[:2].view(np.float16)[0] == 1.0
    q = x.astype(int) + 8
    np.testing.assert_array_equal(raw[2:], q[:16] | (q[16:] << 4))
    np.testing.assert_array_equal(quants.dequantize_q4_0(raw), x)


@pytest.mark.parametrize("qtype", ids=NAME, argvalues=[GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.BF16])
def test_chunking_is_invisible(qtype, monkeypatch):
    x = RNG.standard_normal((9, 96)).astype(np.float32)
    whole = quants.quantize(x, qtype)
    monkeypatch.setattr(quants, "_CHUNK_ELEMS", 64)  # many ragged chunks
    assert_bits_equal(quants.quantize(x, qtype), whole)
    assert_bits_equal(quants.dequantize(whole, qtype, x.shape),
                      oracle_dequantize(whole, qtype, x.shape))


def test_float64_and_strided_input():
    x = RNG.standard_normal((6, 64))
    for qtype in (GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.F16, GGMLType.BF16, GGMLType.F32):
        assert_bits_equal(quants.quantize(x, qtype), oracle_quantize(x, qtype).reshape(6, -1))
    xt = np.asarray(RNG.standard_normal((64, 6)), np.float32).T  # non-contiguous
    assert_bits_equal(quants.quantize(xt, GGMLType.Q4_0),
                      oracle_quantize(np.ascontiguousarray(xt), GGMLType.Q4_0))


# ---------------------------------------------------------------- float types

def float_corners() -> np.ndarray:
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF,  # RNE ties
                     0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,   # inf / NaN
                     0x00000001, 0x80000000, 0x477FF000, 0x33000000, 0x33000001,   # tiny, fp16 edges
                     0x387FC000], np.uint32)
    x = RNG.standard_normal(32 * 4).astype(np.float32) * np.float32(1e3)
    x[:bits.size] = bits.view(np.float32)
    return x.reshape(4, 32)


@pytest.mark.parametrize("qtype", ids=NAME, argvalues=[GGMLType.F32, GGMLType.F16, GGMLType.BF16])
def test_float_types_bit_exact(qtype):
    with np.errstate(all="ignore"):
        check_roundtrip(float_corners(), qtype)


# ---------------------------------------------------------------- dequantise-only types

def random_blocks(qtype, nblocks):
    """Random block bytes whose fp16 fields are finite, realistic scales."""
    _, nbytes = BLOCK_GEOMETRY[qtype]
    raw = RNG.integers(0, 256, (nblocks, nbytes), dtype=np.uint8)
    fp16_at = {GGMLType.Q4_0: [0], GGMLType.Q8_0: [0], GGMLType.Q5_0: [0],
               GGMLType.Q4_K: [0, 2], GGMLType.Q5_K: [0, 2], GGMLType.Q6_K: [208]}[qtype]
    for off in fp16_at:
        d = (RNG.standard_normal(nblocks) * 10.0 ** RNG.integers(-6, 2, nblocks)).astype(np.float16)
        raw[:, off:off + 2] = d.reshape(-1, 1).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", ids=NAME, argvalues=[GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q5_0,
                                   GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K])
@pytest.mark.parametrize("shape_blocks", [(1, 1), (3, 2), (2, 3, 1)])
def test_dequantize_random_bytes(qtype, shape_blocks):
    elems, _ = BLOCK_GEOMETRY[qtype]
    shape = shape_blocks[:-1] + (shape_blocks[-1] * elems,)
    raw = random_blocks(qtype, int(np.prod(shape)) // elems)
    out = quants.dequantize(raw, qtype, shape)
    assert out.dtype == np.float32 and out.shape == shape
    assert_bits_equal(out, oracle_dequantize(raw, qtype, shape))


def test_dequantize_q5_0_of_gguf_quantised():
    x = np.concatenate([RNG.standard_normal((5, 64)).astype(np.float32),
                        special_blocks()[:10].reshape(-1, 64)])
    raw = oracle_quantize(x, GGMLType.Q5_0)
    assert_bits_equal(quants.dequantize(raw, GGMLType.Q5_0, x.shape),
                      oracle_dequantize(raw, GGMLType.Q5_0, x.shape))


@pytest.mark.parametrize("qtype", ids=NAME, argvalues=[GGMLType.F16, GGMLType.BF16, GGMLType.F32])
def test_dequantize_random_float_bits(qtype):
    shape = (3, 40)
    raw = RNG.integers(0, 256, tensor_nbytes(qtype, shape), dtype=np.uint8)  # incl. NaN/inf
    assert_bits_equal(quants.dequantize(raw, qtype, shape), oracle_dequantize(raw, qtype, shape))


def test_accepts_gguf_enum_int_and_bytes():
    x = RNG.standard_normal((2, 32)).astype(np.float32)
    raw = quants.quantize(x, GQ.Q8_0)
    assert_bits_equal(raw, quants.quantize(x, int(GGMLType.Q8_0)))
    assert_bits_equal(quants.dequantize(raw.tobytes(), GQ.Q8_0, (2, 32)),
                      quants.dequantize(raw, GGMLType.Q8_0, (2, 32)))


# ---------------------------------------------------------------- errors

def test_wrong_byte_count():
    raw = np.zeros(18 * 3, np.uint8)
    with pytest.raises(ValueError, match=r"expected 36 bytes, got 54"):
        quants.dequantize(raw, GGMLType.Q4_0, (2, 32))
    with pytest.raises(ValueError, match=r"expected 72 bytes, got 54"):
        quants.dequantize(raw, GGMLType.Q4_0, (4, 32))


def test_bad_row_length():
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.quantize(np.zeros((2, 48), np.float32), GGMLType.Q4_0)
    with pytest.raises(ValueError, match="multiple of 32"):
        quants.quantize_q8_0(np.zeros(33, np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        quants.dequantize(np.zeros(210, np.uint8), GGMLType.Q6_K, (128, 2))
    with pytest.raises(ValueError, match="multiple of 18 bytes"):
        quants.dequantize_q4_0(np.zeros(20, np.uint8))


def test_unsupported_types():
    with pytest.raises(ValueError, match="Q4_K"):
        quants.quantize(np.zeros(256, np.float32), GGMLType.Q4_K)
    with pytest.raises(ValueError, match="Q2_K"):
        quants.dequantize(np.zeros(84, np.uint8), GGMLType.Q2_K, (256,))
    with pytest.raises(ValueError, match="IQ2_XXS"):
        quants.dequantize(np.zeros(66, np.uint8), GQ.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="999"):
        quants.quantize(np.zeros(32, np.float32), 999)
