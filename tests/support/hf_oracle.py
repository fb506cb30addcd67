"""Small random Hugging Face models for the oracle tests: built, re-scaled so that
activations are O(1) and routers decisive, saved with a tokenizer, ready for
`fermoe convert`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

torch = __import__("pytest").importorskip("torch")
transformers = __import__("pytest").importorskip("transformers")

from shared.quants import dequantize, quantize  # noqa: E402
from shared.ggml_types import GGMLType  # noqa: E402
from modeltools.synth_vocab import synth_tokenizer_metadata  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402

VOCAB = 512
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}

# Shapes: more value than key heads, several attention layers, odd head counts,
# every row a whole number of 32-blocks so Q8_0/Q4_0 files quantise every matrix.
SHAPES = {
    "qwen35moe-a": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                        linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32, full_attention_interval=2),
    "qwen35moe-b": dict(hidden_size=96, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3,
                        head_dim=32, linear_num_key_heads=3, linear_num_value_heads=9, linear_key_head_dim=32,
                        linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=64, shared_expert_intermediate_size=32, full_attention_interval=3),
}
# Qwen3-Next: the same shapes with two value heads a key head
SHAPES.update({f"qwen3next-{v}": {**SHAPES[f"qwen35moe-{v}"],
                                  "linear_num_value_heads": 2 * SHAPES[f"qwen35moe-{v}"]["linear_num_key_heads"]}
               for v in "ab"})


def build_hf_model(shape: str, seed: int = 0):
    """A float32 HF causal LM of `shape` with eager attention and eager experts."""
    kw = dict(SHAPES[shape])
    if shape.startswith("qwen35moe"):
        config = transformers.Qwen3_5MoeTextConfig(vocab_size=VOCAB, rope_parameters=dict(ROPE), **kw)
        cls = transformers.Qwen3_5MoeForCausalLM
    else:
        rope = {k: v for k, v in ROPE.items() if not k.startswith("mrope")}
        config = transformers.Qwen3NextConfig(vocab_size=VOCAB, rope_parameters=rope, norm_topk_prob=True,
                                              decoder_sparse_step=1, mlp_only_layers=[], **kw)
        cls = transformers.Qwen3NextForCausalLM
    config.eos_token_id = None
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", experts_implementation="eager")
    _rescale(model, seed)
    return model.eval()


@torch.no_grad()
def _rescale(model, seed: int) -> None:
    """O(1) activations; norms away from their init so the +1 convention is tested."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        rand = torch.randn(p.shape, generator=g)
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1 + 0.1 * rand)
        elif "norm" in name:
            p.copy_(0.1 * rand)                       # zero-centred: HF multiplies by 1 + w
        elif name.endswith(("A_log", "dt_bias")):
            continue
        elif "conv1d" in name:
            p.copy_(0.5 * rand)
        elif "embed_tokens" in name:
            p.copy_(rand)
        else:
            gain = 3.0 if name.endswith("mlp.gate.weight") else 0.5 if ("down" in name or "o_proj" in name
                                                                        or "out_proj" in name) else 1.0
            p.copy_(gain / np.sqrt(p.shape[-1]) * rand)


def _is_quantised(name: str, param) -> bool:
    """Which HF parameters the converter stores quantised (mirror of convert.tensor_type)."""
    skip = ("norm", "mlp.gate.weight", "shared_expert_gate", "conv1d", "A_log", "dt_bias")
    return param.ndim >= 2 and not any(s in name for s in skip)


@torch.no_grad()
def round_trip_weights(model, qtype: GGMLType) -> None:
    """Replace every weight the converter will quantise by its dequantised self, so HF
    computes with exactly the values the GGUF holds (quantisation is idempotent)."""
    for name, p in model.named_parameters():
        if _is_quantised(name, p):
            a = p.detach().numpy().astype(np.float32)
            assert a.shape[-1] % 32 == 0, name
            p.copy_(torch.from_numpy(dequantize(quantize(a, qtype), qtype, a.shape)))


def save_checkpoint(model, directory: Path) -> Path:
    """save_pretrained plus a tokenizer (our synthetic vocabulary) and chat template."""
    model.save_pretrained(directory)
    meta = synth_tokenizer_metadata(VOCAB, seed=0)
    tok = Tokenizer.from_metadata(meta)
    tok._hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": meta["tokenizer.chat_template"], "add_bos_token": False,
    }))
    return directory


@torch.no_grad()
def hf_logits(model, ids) -> np.ndarray:
    return model(torch.tensor([ids])).logits[0].float().numpy()


@torch.no_grad()
def hf_greedy(model, ids, n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()
