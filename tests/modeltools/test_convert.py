"""`fermoe convert`: every checkpoint layout a user may have gives the same GGUF,
laid out with llama.cpp's names and keys; bad input is refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest

from modeltools.convert import convert
from shared.errors import ModelError
from shared.gguf_file import GGUFFile

hf_oracle = pytest.importorskip("tests.support.hf_oracle")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    """A tiny Qwen3.5-MoE checkpoint as save_pretrained writes it (per-expert tensors)."""
    d = tmp_path_factory.mktemp("hf") / "causal"
    hf_oracle.save_checkpoint(hf_oracle.build_hf_model("qwen35moe-a"), d)
    return d


def _load_all(directory):
    from modeltools.safetensors_file import Checkpoint
    ck = Checkpoint(directory)
    return {n: ck.load(n) for n in ck.names}


def _as_conditional_generation(src, dst):
    """The same weights as Qwen3_5MoeForConditionalGeneration: text under text_config,
    tensors under model.language_model., experts fused as 3-D gate_up/down, two shards."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    wrapped = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": cfg, "vision_config": {"depth": 1}}
    (dst / "config.json").write_text(json.dumps(wrapped))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_text((src / f).read_text())
    tensors = _load_all(src)
    out, n_exp = {}, cfg["num_experts"]
    for name, value in tensors.items():
        if ".experts." in name:
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = value
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        stack = lambda w: np.stack([tensors[f"{p}{e}.{w}.weight"] for e in range(n_exp)])
        q = f"model.language_model.layers.{layer}.mlp.experts."
        out[q + "gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], axis=1)
        out[q + "down_proj"] = stack("down_proj")
    out["mtp.fc.weight"] = np.zeros((4, 4), np.float32)            # skipped, as llama.cpp does
    out["model.visual.patch_embed.weight"] = np.zeros((4, 4), np.float32)
    names = sorted(out)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        safetensors_numpy.save_file({n: np.ascontiguousarray(out[n]) for n in part}, str(dst / file))
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("out_type", ["f32", "q4_0"])
def test_every_layout_gives_the_same_file(causal_lm, tmp_path, out_type):
    cond = _as_conditional_generation(causal_lm, tmp_path / "cond")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert(causal_lm, a, out_type, progress=False)
    convert(cond, b, out_type, progress=False)
    with GGUFFile(a) as fa, GGUFFile(b) as fb:
        assert list(fa.tensors) == list(fb.tensors)
        for name in fa.tensors:
            assert fa.tensors[name].shape == fb.tensors[name].shape, name
            assert bytes(fa.raw(name)) == bytes(fb.raw(name)), name
        meta_a = {k: v for k, v in fa.metadata.items() if k != "general.name"}
        assert meta_a == {k: v for k, v in fb.metadata.items() if k != "general.name"}


def test_names_and_keys_are_llama_cpp_s(causal_lm, tmp_path):
    """Tensor names from llama.cpp's own table for the architecture; the keys its loader reads."""
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    convert(causal_lm, out, "q8_0", progress=False)
    arch = gguf.MODEL_ARCH.QWEN35MOE
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    with GGUFFile(out) as f:
        for name in f.tensors:
            base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
            template = base if not base.startswith("blk.") else "blk.{bid}." + base.split(".", 2)[2]
            assert template in allowed, name
        a = "qwen35moe"
        for key in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                    "attention.key_length", "rope.dimension_count", "rope.dimension_sections", "rope.freq_base",
                    "expert_count", "expert_used_count", "expert_feed_forward_length",
                    "expert_shared_feed_forward_length", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
                    "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval",
                    "attention.layer_norm_rms_epsilon"):
            assert f"{a}.{key}" in f.metadata, key
        assert f.metadata["general.architecture"] == a
        assert f.metadata["general.file_type"] == 7
        assert len(f.metadata["tokenizer.ggml.tokens"]) == f.tensors["token_embd.weight"].shape[0]
    reader = gguf.GGUFReader(str(out))          # llama.cpp's own reader takes the file
    assert len(reader.tensors) == len(GGUFFile(out).tensors)


def test_bad_inputs_are_named(causal_lm, tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        convert(tmp_path, tmp_path / "x.gguf")
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelError, match="LlamaForCausalLM.*not supported"):
        convert(other, tmp_path / "x.gguf")
    with pytest.raises(ModelError, match="--type 'q2_k'"):
        convert(causal_lm, tmp_path / "x.gguf", "q2_k")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / f).write_text((causal_lm / f).read_text())
    tensors = _load_all(causal_lm)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    safetensors_numpy.save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelError, match="missing tensor model.layers.1.self_attn.k_proj.weight"):
        convert(broken, tmp_path / "x.gguf")
