"""GGUF reading/writing: round trips, the `gguf` package as oracle both ways, and corrupt files."""
import random
import struct
import time

import numpy as np
import pytest

from shared.errors import GGUFError
from shared.ggml_types import GGMLType, tensor_nbytes
from shared.gguf_file import GGUFFile, GGUFValueType as VT, TensorInfo
from modeltools.gguf_writer import GGUFWriter

gguf = pytest.importorskip("gguf")

# (name, numpy-order shape, type): several types, 1 to 4 dims
TENSORS = [
    ("token_embd.weight", (6, 64), GGMLType.Q8_0),
    ("blk.0.attn_norm.weight", (64,), GGMLType.F32),
    ("blk.0.ffn_gate_exps.weight", (3, 4, 32), GGMLType.Q4_0),
    ("blk.0.ssm_a", (2, 1, 3, 5), GGMLType.F16),
    ("output.weight", (2, 256), GGMLType.Q6_K),
    ("blk.0.x.weight", (3, 7), GGMLType.BF16),
]


def _random_bytes(rng, n):
    return rng.integers(0, 256, n, dtype=np.uint8)


def _write(path, tensors=TENSORS, alignment=32, seed=0, metadata=()):
    """Writes tensors of random bytes through our writer; returns {name: bytes}."""
    rng = np.random.default_rng(seed)
    data = {name: _random_bytes(rng, tensor_nbytes(qt, shape)) for name, shape, qt in tensors}
    with GGUFWriter(path, alignment=alignment) as w:
        w.add("general.architecture", "qwen35moe")
        for key, value, *vtype in metadata:
            w.add(key, value, *vtype)
        for name, shape, qt in tensors:
            w.add_tensor(name, shape, qt)
        for name, _, _ in tensors:
            w.write_tensor(name, data[name])
    return data


def _f32(x):
    return float(np.float32(x))


# (key, value given, vtype given, value read back, type read back)
EVERY_TYPE = [
    ("u8", 200, VT.UINT8, 200, VT.UINT8),
    ("i8", -100, VT.INT8, -100, VT.INT8),
    ("u16", 60000, VT.UINT16, 60000, VT.UINT16),
    ("i16", -30000, VT.INT16, -30000, VT.INT16),
    ("u32", 4_000_000_000, None, 4_000_000_000, VT.UINT32),
    ("i32", -5, None, -5, VT.INT32),
    ("f32", 1e-6, None, _f32(1e-6), VT.FLOAT32),
    ("bool", True, None, True, VT.BOOL),
    ("str", "héllo ✓", None, "héllo ✓", VT.STRING),
    ("empty_str", "", None, "", VT.STRING),
    ("u64", 5, VT.UINT64, 5, VT.UINT64),
    ("i64", -(1 << 40), VT.INT64, -(1 << 40), VT.INT64),
    ("f64", 1e-300, VT.FLOAT64, 1e-300, VT.FLOAT64),
    ("big", 1 << 40, None, 1 << 40, VT.UINT64),
    ("a_str", ["a", "", "ü"], None, ["a", "", "ü"], VT.STRING),
    ("a_i32", (1, -2, 3), None, [1, -2, 3], VT.INT32),
    ("a_f32", [0.5, 1e-6], None, [0.5, _f32(1e-6)], VT.FLOAT32),
    ("a_bool", [True, False], None, [True, False], VT.BOOL),
    ("a_u8", [1, 255], VT.UINT8, [1, 255], VT.UINT8),
    ("a_u64", [1 << 50], VT.UINT64, [1 << 50], VT.UINT64),
    ("a_f64", [0.1], VT.FLOAT64, [0.1], VT.FLOAT64),
    ("a_empty", [], VT.INT32, [], VT.INT32),
    ("np_scalar", np.int64(40), None, 40, VT.UINT32),
    ("np_float", np.float64(0.25), None, 0.25, VT.FLOAT32),
    ("np_array", np.array([11, 11, 10, 0]), None, [11, 11, 10, 0], VT.INT32),
]


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "sample.gguf"
    data = _write(path, metadata=[(k, v) if t is None else (k, v, t) for k, v, t, _, _ in EVERY_TYPE])
    return path, data


# --------------------------------------------------------------------------- round trip

def test_round_trip_metadata_every_type(sample):
    with GGUFFile(sample[0]) as f:
        assert f.version == 3 and f.alignment == 32
        assert list(f.metadata)[1:] == [k for k, *_ in EVERY_TYPE]  # insertion order kept
        for key, _, _, value, vtype in EVERY_TYPE:
            assert f.metadata[key] == value, key
            assert type(f.metadata[key]) is type(value), key
            assert f.metadata_types[key] == vtype, key


def test_round_trip_tensors(sample):
    path, data = sample
    with GGUFFile(path) as f:
        assert list(f.tensors) == [name for name, _, _ in TENSORS]  # file order
        for name, shape, qt in TENSORS:
            info = f.tensors[name]
            assert info == TensorInfo(name, shape, qt, info.offset, tensor_nbytes(qt, shape))
            assert info.offset % 32 == 0 and info.offset >= f.data_offset
            raw = f.raw(name)
            assert raw.dtype == np.uint8 and raw.ndim == 1 and not raw.flags.writeable
            assert not raw.flags.owndata  # a view of the mapping, not a copy
            np.testing.assert_array_equal(raw, data[name])


def test_custom_alignment_round_trip(tmp_path):
    path = tmp_path / "a64.gguf"
    data = _write(path, alignment=64)
    with GGUFFile(path) as f:
        assert f.alignment == 64 and f.metadata["general.alignment"] == 64
        assert f.metadata_types["general.alignment"] == VT.UINT32
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        assert all((f.raw(n) == d).all() for n, d in data.items())
    assert gguf.GGUFReader(path).alignment == 64


def test_llama_cpp_key_types(tmp_path):
    """Inferred types match what llama.cpp's converter writes (llama.cpp checks key types)."""
    path = tmp_path / "keys.gguf"
    with GGUFWriter(path) as w:
        w.add("qwen35moe.block_count", 40)
        w.add("qwen35moe.attention.layer_norm_rms_epsilon", 1e-6)
        w.add("qwen35moe.rope.freq_base", 1e7)
        w.add("qwen35moe.rope.dimension_sections", [11, 11, 10, 0])
        w.add("tokenizer.ggml.tokens", ["a", "b"])
        w.add("tokenizer.ggml.token_type", np.array([1, 3], dtype=np.int64))
        w.add("tokenizer.ggml.add_bos_token", False)
    expected = {
        "qwen35moe.block_count": [VT.UINT32],
        "qwen35moe.attention.layer_norm_rms_epsilon": [VT.FLOAT32],
        "qwen35moe.rope.freq_base": [VT.FLOAT32],
        "qwen35moe.rope.dimension_sections": [VT.ARRAY, VT.INT32],
        "tokenizer.ggml.tokens": [VT.ARRAY, VT.STRING],
        "tokenizer.ggml.token_type": [VT.ARRAY, VT.INT32],
        "tokenizer.ggml.add_bos_token": [VT.BOOL],
    }
    fields = gguf.GGUFReader(path).fields
    assert {k: [int(t) for t in fields[k].types] for k in expected} == expected


def test_fingerprint(tmp_path):
    a, b, c = (tmp_path / f"{x}.gguf" for x in "abc")
    _write(a, seed=1)
    _write(b, seed=2)  # same table, other data
    _write(c, seed=1, metadata=[("x", 1)])
    fa, fb, fc = (GGUFFile(p).fingerprint for p in (a, b, c))
    assert len(fa) == 16 and int(fa, 16) >= 0
    assert fa == fb == GGUFFile(a).fingerprint
    assert fa != fc
    d = tmp_path / "d.gguf"
    _write(d, tensors=TENSORS[:-1] + [("blk.0.x.weight", (7, 3), GGMLType.BF16)])
    assert GGUFFile(d).fingerprint != fa


def test_get_raw_and_close(sample):
    f = GGUFFile(sample[0])
    assert f.get("general.architecture") == "qwen35moe"
    assert f.get("nope", None) is None
    with pytest.raises(GGUFError, match="missing metadata key 'nope'"):
        f.get("nope")
    with pytest.raises(GGUFError, match="tensor 'nope' not found"):
        f.raw("nope")
    view = f.raw("output.weight")
    f.close()  # views outlive close: the mapping goes with the last of them
    assert (view == sample[1]["output.weight"]).all()
    with pytest.raises(GGUFError, match="closed"):
        f.raw("output.weight")


def test_data_views_the_tensor_region(sample):
    import os
    f = GGUFFile(sample[0])
    first = min(f.tensors.values(), key=lambda t: t.offset)
    assert first.offset == f.data_offset
    assert len(f.data()) == os.path.getsize(sample[0]) - f.data_offset
    assert (f.data(first.nbytes) == f.raw(first.name)).all()
    assert len(f.data(1 << 40)) == len(f.data())
    f.close()
    with pytest.raises(GGUFError, match="closed"):
        f.data()


def test_large_token_array_parses_fast(tmp_path):
    path = tmp_path / "vocab.gguf"
    tokens = [f"tok{i}" for i in range(248_320)]
    with GGUFWriter(path) as w:
        w.add("tokenizer.ggml.tokens", tokens)
        w.add("tokenizer.ggml.token_type", [1] * len(tokens))
    start = time.perf_counter()
    f = GGUFFile(path)
    elapsed = time.perf_counter() - start
    assert f.metadata["tokenizer.ggml.tokens"] == tokens
    assert elapsed < 1.0, f"parsing took {elapsed:.2f} s"


# --------------------------------------------------------------------------- oracle

def test_reads_file_written_by_gguf_package(tmp_path):
    path = tmp_path / "oracle.gguf"
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(path, "qwen35moe")
    w.add_uint32("qwen35moe.block_count", 40)
    w.add_float32("qwen35moe.rope.freq_base", 1e7)
    w.add_uint64("u64", 1 << 40)
    w.add_int8("i8", -7)
    w.add_float64("f64", 0.1)
    w.add_bool("b", True)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "é", "x y"])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    w.add_array("floats", [0.5, 0.25])
    f32 = rng.standard_normal((4, 32)).astype(np.float32)
    f16 = rng.standard_normal((2, 3, 8)).astype(np.float16)
    q8 = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("a", f32)
    w.add_tensor("b", f16)
    w.add_tensor("c", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with GGUFFile(path) as f:
        md, types = f.metadata, f.metadata_types
        assert md["general.architecture"] == "qwen35moe"
        assert (md["qwen35moe.block_count"], types["qwen35moe.block_count"]) == (40, VT.UINT32)
        assert (md["qwen35moe.rope.freq_base"], types["qwen35moe.rope.freq_base"]) == (1e7, VT.FLOAT32)
        assert (md["u64"], types["u64"]) == (1 << 40, VT.UINT64)
        assert (md["i8"], types["i8"]) == (-7, VT.INT8)
        assert (md["f64"], types["f64"]) == (0.1, VT.FLOAT64)
        assert (md["b"], types["b"]) == (True, VT.BOOL)
        assert md["tokenizer.ggml.tokens"] == ["<s>", "é", "x y"]
        assert (md["tokenizer.ggml.token_type"], types["tokenizer.ggml.token_type"]) == ([1, 2, 3], VT.INT32)
        assert md["floats"] == [0.5, 0.25]
        expected = {"a": (f32, (4, 32), GGMLType.F32), "b": (f16, (2, 3, 8), GGMLType.F16),
                    "c": (q8, (3, 64), GGMLType.Q8_0)}
        for name, (arr, shape, qt) in expected.items():
            assert (f.tensors[name].shape, f.tensors[name].qtype) == (shape, qt)
            assert f.raw(name).tobytes() == arr.tobytes()


def test_gguf_package_reads_our_file(sample):
    path, data = sample
    r = gguf.GGUFReader(path)
    fields = r.fields
    for key, _, _, value, vtype in EVERY_TYPE:
        field = fields[key]
        if isinstance(value, list):
            # field.types omits an empty array's element type; parts: key len, key, type, elem type
            assert (field.types[0], int(field.parts[3][0])) == (VT.ARRAY, vtype), key
            assert [int(t) for t in field.types] == [VT.ARRAY, vtype][:1 + bool(value)], key
            assert field.contents() == value, key
        else:
            assert [int(t) for t in field.types] == [vtype], key
            got = field.contents()
            assert got == pytest.approx(value) if isinstance(value, float) else got == value, key
    ours = GGUFFile(path).tensors
    assert [t.name for t in r.tensors] == [name for name, _, _ in TENSORS]
    for t, (name, shape, qt) in zip(r.tensors, TENSORS):
        assert tuple(int(d) for d in t.shape) == tuple(reversed(shape))  # gguf keeps ne order
        assert int(t.tensor_type) == qt
        assert t.data_offset == ours[name].offset
        assert t.n_bytes == ours[name].nbytes
        assert t.data.tobytes() == data[name].tobytes()


def test_byte_identical_to_gguf_package(tmp_path):
    """Same content through both writers gives the same bytes: layout and padding match llama.cpp."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal((7,)).astype(np.float16)
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    w = gguf.GGUFWriter(theirs, "qwen35moe")
    w.add_uint32("c", 40)
    w.add_array("t", ["a", "bc"])
    w.add_array("tt", [1, 2])
    w.add_float32("e", 1e-6)
    w.add_tensor("a", a)
    w.add_tensor("b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFWriter(ours) as m:
        for key, value in [("general.architecture", "qwen35moe"), ("c", 40), ("t", ["a", "bc"]),
                           ("tt", [1, 2]), ("e", 1e-6)]:
            m.add(key, value)
        m.add_tensor("a", a.shape, GGMLType.F32)
        m.add_tensor("b", b.shape, GGMLType.F16)
        m.write_tensor("a", a)
        m.write_tensor("b", b)
    assert ours.read_bytes() == theirs.read_bytes()


# --------------------------------------------------------------------------- corrupt files

def _s(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _build(kvs=(), tensors=(), data=b"", version=3, n_tensors=None, n_kv=None, magic=b"GGUF"):
    """Hand-assembled GGUF bytes. kvs: (key, vtype, payload); tensors: (name, ne, type id, offset)."""
    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                              len(kvs) if n_kv is None else n_kv)
    for key, vtype, payload in kvs:
        out += _s(key) + struct.pack("<I", vtype) + payload
    for name, ne, type_id, offset in tensors:
        out += _s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, offset)
    return out + bytes(-len(out) % 32) + data


F32x8 = ("t", (8,), 0, 0)  # 32 bytes of f32


def _open_bytes(tmp_path, blob):
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    return GGUFFile(path)


def _problem(tmp_path, blob) -> str:
    with pytest.raises(GGUFError) as e:
        _open_bytes(tmp_path, blob)
    assert str(tmp_path / "bad.gguf") in str(e.value)  # every message names the file
    return e.value.problem


def test_hand_built_file_is_valid(tmp_path):
    f = _open_bytes(tmp_path, _build([("k", VT.UINT32, struct.pack("<I", 7))], [F32x8], bytes(32), version=2))
    assert f.version == 2 and f.metadata == {"k": 7} and f.tensors["t"].shape == (8,)


@pytest.mark.parametrize("blob, words", [
    (b"", ["empty"]),
    (b"GG", ["not a GGUF"]),
    (_build(magic=b"GGML"), ["not a GGUF", "GGML"]),
    (_build(version=1), ["unsupported", "version 1"]),
    (_build(version=7), ["unsupported", "version 7"]),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), ["big-endian"]),
    (_build(n_tensors=1 << 60), ["implausible", str(1 << 60)]),
    (_build(n_kv=10 ** 9), ["implausible", str(10 ** 9)]),
    (_build([("k", VT.STRING, struct.pack("<Q", 1 << 62))]), ["'k'", "past the end"]),
    (_build([("k", VT.ARRAY, struct.pack("<IQ", VT.UINT32, 1 << 40))]), ["'k'", "past the end"]),
    (_build([("k", VT.ARRAY, struct.pack("<IQQ", VT.STRING, 1, 999))]),
     ["'k'", "past the end"]),
    (_build([("k", 13, b"\0" * 8)]), ["'k'", "unknown value type 13"]),
    (_build([("k", VT.ARRAY, struct.pack("<IQ", 99, 1))]), ["'k'", "unknown element type 99"]),
    (_build([("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 0))]), ["'k'", "array of arrays"]),
    (_build([("k", 0, b"\1"), ("k", 0, b"\2")]), ["duplicate", "'k'"]),
    (_build([("general.alignment", VT.UINT32, struct.pack("<I", 48))]), ["alignment", "power of two"]),
    (_build([("general.alignment", VT.INT32, struct.pack("<i", 64))]), ["alignment", "uint32"]),
    (_build([], [("t", (8,), 77, 0)], bytes(32)), ["'t'", "unknown ggml type id 77"]),
    (_build([], [("t", (256,), 16, 0)], bytes(256)), ["'t'", "16", "IQ2_XXS", "not support"]),
    (_build([], [("t", (1, 1, 1, 1, 1), 0, 0)], bytes(32)), ["'t'", "5 dimensions"]),
    (_build([], [("t", (8, 0), 0, 0)], bytes(32)), ["'t'", "zero or negative"]),
    (_build([], [("t", (8, 1 << 63), 0, 0)], bytes(32)), ["'t'", "zero or negative"]),
    (_build([], [("t", (33,), 8, 0)], bytes(64)), ["'t'", "multiple of 32"]),
    (_build([], [F32x8, F32x8], bytes(64)), ["duplicate tensor", "'t'"]),
    (_build([], [("a", (8,), 0, 0), ("b", (8,), 0, 16)], bytes(64)), ["'b'", "misaligned", "16"]),
    (_build([], [("a", (16,), 0, 0), ("b", (8,), 0, 32)], bytes(64)), ["'a'", "'b'", "overlap"]),
    (_build([], [F32x8], bytes(31)), ["truncated", "'t'"]),
    (_build([], [("t", (8,), 0, 1 << 40)], bytes(32)), ["truncated"]),
])
def test_corrupt_file_raises_helpful_error(tmp_path, blob, words):
    problem = _problem(tmp_path, blob)
    for word in words:
        assert word in problem, (word, problem)


def test_truncated_files(sample, tmp_path):
    blob = sample[0].read_bytes()
    with GGUFFile(sample[0]) as f:
        data_offset = f.data_offset
    header_cut = _problem(tmp_path, blob[:data_offset // 2])
    assert "truncated" in header_cut or "past the end" in header_cut
    data_cut = _problem(tmp_path, blob[:-100])
    assert "truncated" in data_cut and str(len(blob) - 100) in data_cut  # expected vs actual
    for n in range(0, data_offset, 7):  # every cut is a GGUFError, wherever it falls
        with pytest.raises(GGUFError):
            _open_bytes(tmp_path, blob[:n])


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile(tmp_path / "nothing.gguf")


def test_fuzzed_headers_raise_only_gguf_errors(tmp_path):
    small = [("a.weight", (4, 32), GGMLType.Q8_0), ("b", (8,), GGMLType.F32)]
    path = tmp_path / "small.gguf"
    _write(path, tensors=small, metadata=[("n", 3), ("s", ["x", "yz"]), ("f", [0.5])])
    blob = path.read_bytes()
    header_len = GGUFFile(path).data_offset
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        bad = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(header_len)
            if rng.random() < 0.5:
                bad[pos] ^= 1 << rng.randrange(8)
            else:
                bad[pos:pos + 8] = rng.randbytes(8)[:len(bad[pos:pos + 8])]
        try:
            _open_bytes(tmp_path, bytes(bad)).close()
            outcomes["ok"] += 1
        except GGUFError:
            outcomes["error"] += 1
    assert outcomes["error"] > 50, outcomes  # the loop really reached the checks


# --------------------------------------------------------------------------- writer errors

def _writer(tmp_path):
    w = GGUFWriter(tmp_path / "w.gguf")
    w.add_tensor("a", (32,), GGMLType.F32)
    w.add_tensor("b", (2, 32), GGMLType.Q4_0)
    return w


def test_write_out_of_order(tmp_path):
    w = _writer(tmp_path)
    with pytest.raises(ValueError, match="out of order.*'a'"):
        w.write_tensor("b", bytes(36))


def test_write_wrong_size(tmp_path):
    w = _writer(tmp_path)
    with pytest.raises(ValueError, match="got 127 bytes, expected 128"):
        w.write_tensor("a", bytes(127))
    w.write_tensor("a", np.zeros(32, np.float32))
    w.write_tensor("b", bytearray(36))
    with pytest.raises(ValueError, match="every declared tensor"):
        w.write_tensor("c", b"")


def test_close_with_unwritten_tensor(tmp_path):
    w = _writer(tmp_path)
    w.write_tensor("a", bytes(128))
    with pytest.raises(ValueError, match="never written.*'b'"):
        w.close()


def test_writer_refuses_bad_declarations(tmp_path):
    w = _writer(tmp_path)
    w.add("k", 1)
    for call, match in [
        (lambda: w.add("k", 2), "duplicate metadata key"),
        (lambda: w.add("neg", -1, VT.UINT32), "'neg'"),
        (lambda: w.add("f", 1.5, VT.INT32), "'f'"),
        (lambda: w.add("empty", []), "empty list"),
        (lambda: w.add("mixed", [1, "a"]), "'mixed'"),
        (lambda: w.add("obj", object()), "'obj'"),
        (lambda: w.add("general.alignment", 64), "alignment"),
        (lambda: w.add_tensor("a", (32,), GGMLType.F32), "duplicate tensor"),
        (lambda: w.add_tensor("c", (33,), GGMLType.Q8_0), "multiple of 32"),
        (lambda: w.add_tensor("c", (1, 1, 1, 1, 1), GGMLType.F32), "dims"),
        (lambda: w.add_tensor("c", (0,), GGMLType.F32), "dims"),
        (lambda: w.add_tensor("x" * 64, (1,), GGMLType.F32), "longer"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    w.write_tensor("a", bytes(128))
    with pytest.raises(ValueError, match="before the first write_tensor"):
        w.add("late", 1)
    with pytest.raises(ValueError, match="before the first write_tensor"):
        w.add_tensor("late", (1,), GGMLType.F32)


def test_metadata_only_file(tmp_path):
    path = tmp_path / "m.gguf"
    with GGUFWriter(path) as w:
        w.add("k", "v")
    with GGUFFile(path) as f:
        assert f.metadata == {"k": "v"} and f.tensors == {}


def test_populate_maps_the_whole_file(tmp_path):
    import platform
    path = tmp_path / "p.gguf"
    data = _write(path)
    release = tuple(int(p) for p in platform.release().split("-")[0].split(".")[:2])
    with GGUFFile(path) as f:
        assert f.populate() is (platform.system() == "Linux" and release >= (5, 14))
        for name, raw in data.items():
            assert np.array_equal(f.raw(name), np.frombuffer(bytes(raw), np.uint8))
