"""`fermoe convert --mmproj`: the vision tower of a Qwen3_5MoeForConditionalGeneration
checkpoint -> an mmproj GGUF laid out as llama.cpp's converter lays it out
(its Qwen3VLVisionModel), so the file also runs in llama.cpp.

What changes on the way: the Conv3d patch kernel [d, 3, 2, p, p] is split into one
2-D kernel per frame (v.patch_embd.weight, .weight.1); the merger's norm becomes
v.post_ln; its two linears mm.0 and mm.2; QKV stays fused. The LayerNorm eps is the
text model's rms_norm_eps and mean/std come from preprocessor_config.json, as there.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..convert import OUT_TYPES, Item
from shared.errors import ModelError
from shared.vision.config import VisionConfig
from shared.vision.mmproj import expected_tensors
from .writer import write_mmproj

ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
PREFIXES = ("model.visual.", "visual.")          # llama.cpp's converter accepts both
_BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
          "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_TOP = {"v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
        "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
        "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
        "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}


def _read_json(path: Path, what: str) -> dict:
    if not path.exists():
        raise ModelError(f"{path.parent}: no {path.name} ({what})")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: {e}") from None


def vision_config_from_hf(hf_dir: Path) -> VisionConfig:
    cfg = _read_json(hf_dir / "config.json", "is this a Hugging Face checkpoint directory?")
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ModelError(f"{hf_dir / 'config.json'}: architectures {cfg.get('architectures')}: --mmproj needs a "
                         f"{ARCHITECTURE} checkpoint (the model with its vision tower)")
    vision, text = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    pre = _read_json(hf_dir / "preprocessor_config.json", "the image mean and std come from it")
    try:
        side = math.isqrt(vision.get("num_position_embeddings", 2304))
        out = VisionConfig(
            n_embd=vision.get("hidden_size", 1152), n_ff=vision.get("intermediate_size", 4304),
            n_layer=vision.get("depth", 27), n_head=vision.get("num_heads", 16),
            patch_size=vision.get("patch_size", 16), image_size=side * vision.get("patch_size", 16),
            n_merge=vision.get("spatial_merge_size", 2), projection_dim=vision.get("out_hidden_size", 3584),
            eps=float(text.get("rms_norm_eps", 1e-6)),
            image_mean=tuple(pre["image_mean"]), image_std=tuple(pre["image_std"]),
        )
    except (KeyError, TypeError) as e:
        raise ModelError(f"{hf_dir}: preprocessor_config.json lacks {e}") from None
    if vision.get("temporal_patch_size", 2) != 2:
        raise ModelError(f"{hf_dir}: vision_config.temporal_patch_size {vision['temporal_patch_size']}: only 2 "
                         "(two frames, llama.cpp's two kernels) is supported")
    if side * side != vision.get("num_position_embeddings", 2304):
        raise ModelError(f"{hf_dir}: vision_config.num_position_embeddings is not a square")
    if text.get("hidden_size") not in (None, out.projection_dim):
        raise ModelError(f"{hf_dir}: vision_config.out_hidden_size {out.projection_dim} is not the text "
                         f"hidden_size {text['hidden_size']}")
    out.validate(str(hf_dir / "config.json"))
    return out


def plan(ckpt, cfg: VisionConfig) -> list[Item]:
    """The tower's GGUF tensors, each with a loader reading `ckpt` (names, shape(), load())."""
    names = set(ckpt.names)

    def source(hf: str) -> str:
        for p in PREFIXES:
            if p + hf in names:
                return p + hf
        raise ModelError(f"checkpoint is missing tensor {PREFIXES[0]}{hf}")

    def hf_name(gguf: str) -> str:
        if gguf in _TOP:
            return _TOP[gguf]
        _, _, i, attr, kind = gguf.split(".")          # v.blk.N.attr.kind
        return f"blocks.{i}.{_BLOCK[attr]}.{kind}"

    kernel = source("patch_embed.proj.weight")
    want = (cfg.n_embd, 3, 2, cfg.patch_size, cfg.patch_size)
    if tuple(ckpt.shape(kernel)) != want:
        raise ModelError(f"{kernel} has shape {list(ckpt.shape(kernel))}, expected {list(want)}")
    items = []
    for gguf, shape in expected_tensors(cfg).items():
        if gguf.startswith("v.patch_embd.weight"):
            frame = 1 if gguf.endswith(".1") else 0
            items.append(Item(gguf, shape, lambda f=frame: ckpt.load(kernel)[:, :, f]))
            continue
        name = source(hf_name(gguf))
        if tuple(ckpt.shape(name)) != shape:
            raise ModelError(f"{name} has shape {list(ckpt.shape(name))}, expected {list(shape)}")
        items.append(Item(gguf, shape, lambda n=name: ckpt.load(n)))
    return items


def convert_mmproj(hf_dir, out_path, out_type: str = "f16", progress: bool = True) -> VisionConfig:
    """Write the vision tower of the checkpoint in `hf_dir` to `out_path`; returns its config."""
    from ..safetensors_file import Checkpoint

    if out_type not in OUT_TYPES:
        raise ModelError(f"--type {out_type!r}: expected one of {', '.join(OUT_TYPES)}")
    hf_dir = Path(hf_dir)
    cfg = vision_config_from_hf(hf_dir)
    items = plan(Checkpoint(hf_dir), cfg)
    meta = cfg.to_metadata()
    meta["general.name"] = hf_dir.name
    write_mmproj(out_path, meta, items, OUT_TYPES[out_type], progress)
    return cfg
