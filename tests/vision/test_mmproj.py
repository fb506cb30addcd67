"""mmproj GGUF files: the converter writes llama.cpp's names, keys and layout from a
Qwen3_5MoeForConditionalGeneration checkpoint, and its file loads and computes what HF's
tower computes; synth's towers load; a broken or foreign file is one error naming it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from shared.errors import GGUFError, ModelError
from shared.ggml_types import GGMLType
from shared.gguf_file import GGUFFile
from modeltools.vision.convert import convert_mmproj
from shared.vision.mmproj import Mmproj, expected_tensors
from shared.vision.reference import encode_image
from modeltools.vision.synth import preset_config, synth_mmproj
from tests.support.gguf_edit import DROP, rewrite_gguf

vo = pytest.importorskip("tests.support.vision_oracle")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "mm"
    model = vo.save_multimodal(d, seed=1)
    return d, model.model.visual


@pytest.fixture(scope="module")
def tiny_mmproj(tmp_path_factory):
    path = tmp_path_factory.mktemp("mm") / "tiny-mmproj.gguf"
    synth_mmproj(path, preset_config("tiny"), "q8_0", seed=0)
    return path


def test_converted_file_holds_hf_tensors_under_llama_cpp_names(checkpoint, tmp_path):
    hf_dir, visual = checkpoint
    out = tmp_path / "mmproj.gguf"
    cfg = convert_mmproj(hf_dir, out, "f32", progress=False)
    sd = {k: v.detach().numpy() for k, v in visual.state_dict().items()}
    with _opened(out) as mm:
        assert mm.config == cfg and list(mm.weights) == list(expected_tensors(cfg))
        np.testing.assert_array_equal(mm.f32("v.patch_embd.weight"), sd["patch_embed.proj.weight"][:, :, 0])
        np.testing.assert_array_equal(mm.f32("v.patch_embd.weight.1"), sd["patch_embed.proj.weight"][:, :, 1])
        np.testing.assert_array_equal(mm.f32("v.blk.1.attn_qkv.weight"), sd["blocks.1.attn.qkv.weight"])
        np.testing.assert_array_equal(mm.f32("v.blk.0.ffn_down.bias"), sd["blocks.0.mlp.linear_fc2.bias"])
        np.testing.assert_array_equal(mm.f32("v.post_ln.weight"), sd["merger.norm.weight"])
        np.testing.assert_array_equal(mm.f32("mm.2.weight"), sd["merger.linear_fc2.weight"])
        np.testing.assert_array_equal(mm.f32("v.position_embd.weight"), sd["pos_embed.weight"])
        image = vo.random_image(64, 128, seed=5)
        (want,), _ = vo.hf_encode(visual, [image])
        got = encode_image(mm, vo.hf_patchify(image), (4, 8))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_names_and_keys_are_llama_cpp_s(checkpoint, tmp_path):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "mmproj.gguf"
    convert_mmproj(checkpoint[0], out, "q8_0", progress=False)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.MMPROJ]}
    with GGUFFile(out) as f:
        for name in f.tensors:
            base = name.removesuffix(".1").rsplit(".", 1)[0]
            parts = base.split(".")
            template = ".".join("{bid}" if p.isdigit() else p for p in parts)
            assert template in allowed, name
        K = gguf.Keys
        meta = f.metadata
        assert meta[K.General.ARCHITECTURE] == "clip" and meta[K.General.TYPE] == "mmproj"
        assert meta[K.Clip.PROJECTOR_TYPE] == gguf.VisionProjectorType.QWEN3VL
        for key in (K.Clip.HAS_VISION_ENCODER, K.ClipVision.USE_GELU, K.ClipVision.PROJECTION_DIM, K.ClipVision.IMAGE_SIZE,
                    K.ClipVision.PATCH_SIZE, K.ClipVision.EMBEDDING_LENGTH, K.ClipVision.FEED_FORWARD_LENGTH,
                    K.ClipVision.BLOCK_COUNT, K.ClipVision.Attention.HEAD_COUNT, K.ClipVision.Attention.LAYERNORM_EPS,
                    K.ClipVision.IMAGE_MEAN, K.ClipVision.IMAGE_STD, K.ClipVision.SPATIAL_MERGE_SIZE,
                    K.ClipVision.IS_DEEPSTACK_LAYERS):
            assert key in meta, key
        assert f.tensors["v.patch_embd.weight"].qtype == GGMLType.F16           # kernels stay float
        assert f.tensors["mm.0.weight"].qtype == GGMLType.Q8_0
        assert f.tensors["v.blk.0.ln1.bias"].qtype == GGMLType.F32
    assert len(gguf.GGUFReader(str(out)).tensors) == len(GGUFFile(out).tensors)


def test_converter_refuses_by_name(checkpoint, tmp_path):
    hf_dir, _ = checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="no preprocessor_config.json"):
        convert_mmproj(bad, tmp_path / "x.gguf")
    (bad / "config.json").write_text(json.dumps(dict(cfg, architectures=["Qwen3_5MoeForCausalLM"])))
    with pytest.raises(ModelError, match="needs a Qwen3_5MoeForConditionalGeneration"):
        convert_mmproj(bad, tmp_path / "x.gguf")
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "preprocessor_config.json").write_text((hf_dir / "preprocessor_config.json").read_text())
    for f in hf_dir.glob("*.safetensors*"):
        (bad / f.name).symlink_to(f)
    cfg["vision_config"]["out_hidden_size"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="out_hidden_size 32 is not the text hidden_size 64"):
        convert_mmproj(bad, tmp_path / "x.gguf")


def test_synth_tower_loads(tiny_mmproj):
    with _opened(tiny_mmproj) as mm:
        assert mm.config == preset_config("tiny")
        out = encode_image(mm, np.zeros((4 * 6, 1536), np.float32), (4, 6))
        assert out.shape == (6, 256) and np.isfinite(out).all() and out.std() > 0.1
        mm.check_text_model(256, "text.gguf")
        with pytest.raises(GGUFError, match="projection_dim is 256, but the text model text.gguf has "
                                            "embedding_length 2048"):
            mm.check_text_model(2048, "text.gguf")


@pytest.mark.parametrize("edit, message", [
    (dict(meta={"general.architecture": "qwen35moe"}), "not 'clip': not an mmproj"),
    (dict(meta={"clip.projector_type": "mlp"}), "clip.projector_type is 'mlp'; only 'qwen3vl_merger'"),
    (dict(meta={"clip.vision.block_count": DROP}), "missing metadata key clip.vision.block_count"),
    (dict(meta={"clip.vision.attention.head_count": 5}), "must be a multiple of attention.head_count"),
    (dict(meta={"clip.vision.is_deepstack_layers": [True, False]}), "deepstack"),
    (dict(tensors={"v.blk.1.ffn_up.bias": DROP}), "missing tensor v.blk.1.ffn_up.bias"),
    (dict(tensors={"mm.2.bias": ((255,), GGMLType.F32, np.zeros(255 * 4, np.uint8))}),
     r"tensor mm.2.bias has shape \[255\], but the metadata implies \[256\]"),
])
def test_a_broken_file_is_one_error(tiny_mmproj, tmp_path, edit, message):
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(tiny_mmproj, bad, **edit)
    with pytest.raises(GGUFError, match=message) as e:
        Mmproj(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_file_is_one_error(tiny_mmproj, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_mmproj.read_bytes()[:-1000])
    with pytest.raises(GGUFError, match="truncated"):
        Mmproj(bad)


class _opened:
    def __init__(self, path):
        self.mm = Mmproj(path)

    def __enter__(self):
        return self.mm

    def __exit__(self, *exc):
        self.mm.close()
