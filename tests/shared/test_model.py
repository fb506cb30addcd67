"""Loading GGUF models: config from metadata, tensors by GGUF name, and a clear
error for every file we refuse; the quirks of real files (mixed types, an MTP
block, no output.weight) handled as llama.cpp handles them."""
from __future__ import annotations

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.errors import GGUFError
from shared.gguf_file import GGUFFile
from shared.ggml_types import BLOCK_GEOMETRY, GGMLType
from shared.model import Model
from shared.quants import dequantize, quantize
from tests.support.gguf_edit import DROP, rewrite_gguf

TIGHT = 1e-5


def logits_of(path, ids=(1, 2, 3, 4, 5)):
    engine = ReferenceEngine(Model(path))
    return engine.forward(list(ids), engine.new_state())


def test_config_from_metadata(tiny_path):
    cfg = Model(tiny_path).config
    assert cfg.arch == "qwen35moe" and cfg.n_layer == 4
    assert cfg.attention_layers == [1, 3] and cfg.gdn_layers == [0, 2]
    assert cfg.conv_channels == 2 * 2 * 16 + 64
    # tiled value heads: head j reads key head j % k_heads
    assert [cfg.key_head_of(j) for j in range(4)] == [0, 1, 0, 1]


def test_missing_file_names_it(tmp_path):
    with pytest.raises(GGUFError, match="nope.gguf"):
        Model(tmp_path / "nope.gguf")


def test_other_architecture_refused(tiny_path, tmp_path):
    bad = tmp_path / "llama.gguf"
    rewrite_gguf(tiny_path, bad, meta={"general.architecture": "llama"})
    with pytest.raises(GGUFError, match="architecture 'llama' is not supported"):
        Model(bad)


def test_a_tensor_type_we_cannot_read_is_one_error_naming_the_tensor(tiny_path, tmp_path):
    """Q4_1 (20 bytes a block of 32) is a type llama.cpp writes and fermoe refuses."""
    from tests.support.serving_harness import fermoe
    name = "blk.2.ssm_out.weight"
    with GGUFFile(tiny_path) as f:
        info = f.tensors[name]
    rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
    bad = tmp_path / "q4_1.gguf"
    q4_1 = np.zeros(rows * cols // 32 * 20, np.uint8)
    rewrite_gguf(tiny_path, bad, tensors={name: (info.shape, GGMLType.Q4_1, q4_1)})
    for convert in (True, False):
        with pytest.raises(GGUFError, match=f"tensor {name}: cannot dequantize Q4_1"):
            Model(bad, convert=convert)
    out = fermoe("generate", bad, "-p", "x", "-n", 1, check=False)
    assert out.returncode == 1 and f"tensor {name}: cannot dequantize Q4_1" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_process_that_runs_no_layer_converts_nothing(tiny_path, tmp_path):
    """A K-quant LM head (as llama.cpp's Q4_0 files have) is converted to Q8_0 at load for
    the engines, and left as it is, only checked, with convert=False (the coordinator)."""
    path = tmp_path / "q6_k-head.gguf"
    with GGUFFile(tiny_path) as f:
        shape = f.tensors["output.weight"].shape
    q6_k = np.zeros(int(np.prod(shape)) // 256 * 210, np.uint8)
    rewrite_gguf(tiny_path, path, tensors={"output.weight": (shape, GGMLType.Q6_K, q6_k)})
    assert Model(path).output.qtype == GGMLType.Q8_0
    light = Model(path, convert=False)
    assert light.output.qtype == GGMLType.Q6_K and light.fingerprint == Model(path).fingerprint


@pytest.mark.parametrize("edit, error", [
    (dict(tensors={"blk.2.ssm_out.weight": DROP}), "missing tensor blk.2.ssm_out.weight"),
    (dict(meta={"qwen35moe.expert_feed_forward_length": 64}), "ffn_gate_exps.weight has shape .* implies"),
    (dict(meta={"qwen35moe.ssm.group_count": DROP}), "missing metadata key qwen35moe.ssm.group_count"),
    (dict(meta={"qwen35moe.attention.head_count_kv": 3}), "multiple of head_count_kv"),
], ids=["missing_tensor", "shape_contradicting_metadata", "missing_metadata_key", "impossible_metadata"])
def test_a_file_that_contradicts_itself_is_refused_by_name(tiny_path, tmp_path, edit, error):
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(tiny_path, bad, **edit)
    with pytest.raises(GGUFError, match=error):
        Model(bad)


def test_output_weight_falls_back_to_embedding(tiny_path, tmp_path):
    tied = tmp_path / "tied.gguf"
    with Model(tiny_path).file as f:
        embd = f.tensors["token_embd.weight"]
        embd_raw = np.array(f.raw("token_embd.weight"))
    rewrite_gguf(tiny_path, tied, tensors={"output.weight": DROP})
    model = Model(tied)
    assert model.output is model.token_embd
    # the same as a file whose output.weight is a copy of the embedding
    copy = tmp_path / "copy.gguf"
    rewrite_gguf(tiny_path, copy, tensors={"output.weight": (embd.shape, embd.qtype, embd_raw)})
    np.testing.assert_array_equal(logits_of(tied), logits_of(copy))


def test_mtp_block_is_skipped(tiny_path, tmp_path):
    """block_count counts the MTP block; nextn_predict_layers says how many to skip."""
    with Model(tiny_path).file as f:
        extra = {n.replace("blk.3.", "blk.4."): (i.shape, i.qtype, np.array(f.raw(n)))
                 for n, i in f.tensors.items() if n.startswith("blk.3.")}
    mtp = tmp_path / "mtp.gguf"
    rewrite_gguf(tiny_path, mtp, meta={"qwen35moe.block_count": 5, "qwen35moe.nextn_predict_layers": 1},
                 tensors=extra)
    assert Model(mtp).config.n_layer == 4
    np.testing.assert_array_equal(logits_of(mtp), logits_of(tiny_path))


@pytest.mark.parametrize("qtype", [GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q4_K, GGMLType.Q5_K])
def test_mixed_types_converted_at_load(tiny_path, tmp_path, qtype):
    """A K-quant or Q5_0 LM head (common in real files) computes like its values
    rounded to Q8_0, which is what it becomes at load."""
    cfg = Model(tiny_path).config
    shape = (cfg.n_vocab, cfg.n_embd)
    assert cfg.n_embd % 256 == 0, "K-quant rows are 256 wide"
    raw = _random_blocks(qtype, shape, np.random.default_rng(int(qtype)))
    mixed, plain = tmp_path / "mixed.gguf", tmp_path / "plain.gguf"
    rewrite_gguf(tiny_path, mixed, tensors={"output.weight": (shape, qtype, raw)})
    as_q8 = quantize(dequantize(raw, qtype, shape), GGMLType.Q8_0)
    rewrite_gguf(tiny_path, plain, tensors={"output.weight": (shape, GGMLType.Q8_0, as_q8)})
    assert Model(mixed).output.qtype == GGMLType.Q8_0
    np.testing.assert_allclose(logits_of(mixed), logits_of(plain), rtol=0, atol=TIGHT)


def _random_blocks(qtype, shape, rng):
    """Random bytes in a block format with small, finite fp16 scales (first fields)."""
    elems, nbytes = BLOCK_GEOMETRY[qtype]
    n_blocks = int(np.prod(shape)) // elems
    blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    scale = np.float16(0.002).view(np.uint16)
    if qtype in (GGMLType.Q4_K, GGMLType.Q5_K):       # d and dmin lead the block
        blocks[:, 0:4] = np.frombuffer(np.array([scale, scale], np.uint16).tobytes(), np.uint8)
    elif qtype == GGMLType.Q6_K:                       # d trails the block
        blocks[:, -2:] = np.frombuffer(np.array([scale], np.uint16).tobytes(), np.uint8)
    else:                                              # Q5_0: d leads the block
        blocks[:, 0:2] = np.frombuffer(np.array([scale], np.uint16).tobytes(), np.uint8)
    return blocks.reshape(-1)
