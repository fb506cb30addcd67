"""`fermoe synth`: seeded random models with the real structure, as GGUF files.

`tiny` is the built-in test model (every structural feature, a few MB);
`qwen3.6-35b-a3b` has the real dimensions: the benchmark workload. Weights are
scaled so activations stay O(1) and routers are not degenerate. Q4_0 tensors are
drawn directly as random blocks (no float pass), so the full-size file is written
about as fast as the disk takes it.
"""
from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np

from shared.config import ModelConfig
from .convert import FILE_TYPE, OUT_TYPES, Item, tensor_type, write_gguf
from shared.errors import ModelError
from shared.ggml_types import GGMLType
from shared.model import RANDOM_WEIGHTS_KEY, expected_shapes, gguf_tensor_name
from .synth_vocab import synth_tokenizer_metadata

# Set (true) in the files synth writes, so every command can say that what such a model
# prints is noise; llama.cpp and other GGUF readers ignore keys they do not know.
# Bumped whenever the same preset and seed would give different weights, so a cached
# built-in model is regenerated rather than silently stale.
SYNTH_VERSION = 2

PRESETS = {
    "tiny": ModelConfig(
        arch="qwen35moe", n_layer=4, n_embd=256, n_vocab=512, rms_eps=1e-6,
        n_head=4, n_head_kv=2, head_dim=32, rope_dim=8, rope_theta=1e7, full_attention_interval=2,
        ssm_conv_kernel=4, ssm_k_heads=2, ssm_v_heads=4, ssm_head_k_dim=16, ssm_d_inner=64,
        n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32,
    ),
    "qwen3.6-35b-a3b": ModelConfig(
        arch="qwen35moe", n_layer=40, n_embd=2048, n_vocab=248320, rms_eps=1e-6,
        n_head=16, n_head_kv=2, head_dim=256, rope_dim=64, rope_theta=1e7, full_attention_interval=4,
        ssm_conv_kernel=4, ssm_k_heads=16, ssm_v_heads=32, ssm_head_k_dim=128, ssm_d_inner=4096,
        n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
    ),
}


def preset_config(preset: str, experts: int | None = None, layers: int | None = None) -> ModelConfig:
    if preset not in PRESETS:
        raise ModelError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    if experts is not None:
        if not cfg.n_expert_used <= experts:
            raise ModelError(f"--experts {experts}: needs at least {cfg.n_expert_used} (experts used per token)")
        cfg = replace(cfg, n_expert=experts)
    if layers is not None:
        if layers < 1:
            raise ModelError(f"--layers {layers}: must be at least 1")
        cfg = replace(cfg, n_layer=layers)
    return cfg


_GAIN = {"ffn_gate_inp": 3.0, "ssm_out": 0.5, "attn_output": 0.5, "ffn_down_exps": 0.5, "ffn_down_shexp": 0.5}


# Tensors this large are drawn as Q4_0 blocks directly (the full-size model would
# take minutes through float32); smaller ones are drawn in float and quantised.
_DIRECT_Q4_ELEMENTS = 1 << 22


def _role(name: str) -> str:
    """GGUF attribute of a tensor name: blk.3.attn_q.weight -> attn_q."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


def _matrix_std(attr: str, fan_in: int) -> float:
    return _GAIN.get(attr, 1.0) / np.sqrt(fan_in)


def _init(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Random float32 values for one tensor, scaled by its role."""
    attr = _role(name)
    if attr.endswith("norm"):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if attr == "ssm_a":
        return -rng.uniform(0.5, 4.0, shape).astype(np.float32)
    if attr == "ssm_dt":
        return rng.uniform(-2.0, 0.0, shape).astype(np.float32)
    if attr == "ssm_conv1d":
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    if attr == "token_embd":
        return rng.standard_normal(shape).astype(np.float32)
    return (_matrix_std(attr, shape[-1]) * rng.standard_normal(shape)).astype(np.float32)


def _random_q4_0(shape: tuple, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks: uniform nibbles, an fp16 scale giving about `std`.

    A uniform nibble q - 8 has mean -0.5 and standard deviation ~4.6. The mean
    would add the same offset to every output, which over 40 layers drives all
    tokens to one direction (and one set of experts); a random sign on each
    block's scale cancels it."""
    n_blocks = int(np.prod(shape)) // 32
    blocks = np.empty((n_blocks, 18), np.uint8)
    blocks[:, 2:] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    scales = np.array([std / 4.6, -std / 4.6], np.float16).view(np.uint16)
    blocks[:, :2] = scales[rng.integers(0, 2, n_blocks)].view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def _tensor_list(cfg: ModelConfig) -> list[tuple[str, tuple]]:
    names = [("token_embd.weight", (cfg.n_vocab, cfg.n_embd))]
    for i in range(cfg.n_layer):
        for attr, shape in expected_shapes(cfg, i).items():
            if attr == "ffn_gate_inp_shexp":
                shape = (1, cfg.n_embd)
            names.append((gguf_tensor_name(i, attr), shape))
    names += [("output_norm.weight", (cfg.n_embd,)), ("output.weight", (cfg.n_vocab, cfg.n_embd))]
    return names


def synth(out_path, preset: str = "tiny", experts=None, layers=None, out_type: str = "q4_0",
          seed: int = 0, progress: bool = True, chat_template: str | None = None) -> ModelConfig:
    """Write a random model of `preset` to `out_path`; returns its config. chat_template: the
    Jinja text to store (a real model's, for benchmarks of chats with tools), else a plain one."""
    if out_type not in OUT_TYPES:
        raise ModelError(f"--type {out_type!r}: expected one of {', '.join(OUT_TYPES)}")
    cfg = preset_config(preset, experts, layers)
    qtype = OUT_TYPES[out_type]
    items = []
    for name, shape in _tensor_list(cfg):
        # One generator per tensor, so values do not depend on write order.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        target = tensor_type(name, shape, qtype)
        if target == GGMLType.Q4_0 and int(np.prod(shape)) >= _DIRECT_Q4_ELEMENTS:
            std = _matrix_std(_role(name), shape[-1])
            items.append(Item(name, shape, lambda s=shape, sd=std, r=rng: _random_q4_0(s, sd, r), raw=True))
        else:
            items.append(Item(name, shape, lambda n=name, s=shape, r=rng: _init(n, s, r)))
    meta = cfg.to_metadata()
    meta["general.name"] = f"fermoe-synth-{preset}"
    meta["general.description"] = "random weights written by fermoe synth: its output is noise"
    meta[RANDOM_WEIGHTS_KEY] = True
    meta["general.file_type"] = FILE_TYPE[qtype]
    meta.update(synth_tokenizer_metadata(cfg.n_vocab, seed))
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    write_gguf(out_path, meta, items, qtype, progress)
    return cfg
