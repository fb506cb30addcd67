"""`fermoe convert`: a Hugging Face checkpoint -> a GGUF laid out as llama.cpp's
converter lays it out, so the file also runs in llama.cpp.

What llama.cpp changes on the way (and so do we): zero-centred RMSNorm weights
get +1 (not the GDN output norm); A_log becomes ssm_a = -exp(A_log); dt_bias is
`ssm_dt.bias`; the conv weight loses its middle dim; fused expert gate_up is split
and per-expert tensors are stacked, expert outermost; and for Qwen3.5/3.6 the GDN
value heads move from grouped order (head h uses key head h // r) to tiled order
(head j uses key head j % k_heads). Qwen3-Next keeps grouped order, splits
in_proj_qkvz into attn_qkv + attn_gate and keeps in_proj_ba fused as ssm_ba.

The file is streamed tensor by tensor: the model is never whole in RAM.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from shared.config import ModelConfig
from shared.errors import ModelError
from shared.ggml_types import GGMLType, BLOCK_GEOMETRY
from .gguf_writer import GGUFWriter
from .hf_tokenizer import hf_tokenizer_metadata
from shared.quants import quantize

OUT_TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q8_0: 7}
# Small or precision-critical matrices llama.cpp keeps in F32 whatever the file type.
_KEEP_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")

SUPPORTED = {
    "Qwen3_5MoeForCausalLM": ("qwen35moe", None),
    "Qwen3_5MoeForConditionalGeneration": ("qwen35moe", "text_config"),
    "Qwen3NextForCausalLM": ("qwen3next", None),
}


def tensor_type(name: str, shape: tuple, out_type: GGMLType) -> GGMLType:
    """The ggml type a tensor is stored in for a given file type (llama.cpp's rules)."""
    if len(shape) < 2 or name.endswith("_norm.weight") or name.endswith(_KEEP_F32):
        return GGMLType.F32
    if shape[-1] % BLOCK_GEOMETRY[out_type][0]:
        return GGMLType.F16           # rows that are not whole blocks fall back, as in llama.cpp
    return out_type


@dataclass
class Item:
    name: str
    shape: tuple
    produce: Callable[[], np.ndarray]    # float32 data in numpy order
    raw: bool = False                    # produce() already gives the bytes in the target type


# ---- the Hugging Face side --------------------------------------------------
def read_hf_config(hf_dir: Path) -> tuple[dict, str, str]:
    """(text config, GGUF architecture, tensor name prefix) of a checkpoint directory."""
    path = hf_dir / "config.json"
    if not path.exists():
        raise ModelError(f"{hf_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    hf_arch = next((a for a in archs if a in SUPPORTED), None)
    if hf_arch is None:
        raise ModelError(f"{path}: architectures {archs} not supported; expected one of {sorted(SUPPORTED)}")
    arch, sub = SUPPORTED[hf_arch]
    text = cfg[sub] if sub else cfg
    prefix = "model.language_model." if sub else "model."
    return text, arch, prefix


def model_config_from_hf(text: dict, arch: str) -> ModelConfig:
    rope = dict(text.get("rope_parameters") or {})
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    layer_types = text.get("layer_types")
    interval = text.get("full_attention_interval", 4)
    if layer_types:
        attn = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        interval = attn[0] + 1 if attn else len(layer_types) + 1
        if attn != [i for i in range(len(layer_types)) if (i + 1) % interval == 0]:
            raise ModelError(f"layer_types {layer_types} are not every-{interval}th attention, as GGUF requires")
    if arch == "qwen3next" and (text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1):
        raise ModelError("Qwen3-Next checkpoints with dense (mlp_only) layers are not supported")
    sections = tuple(rope.get("mrope_section", (11, 11, 10)))
    cfg = ModelConfig(
        arch=arch, n_layer=text["num_hidden_layers"], n_embd=text["hidden_size"],
        n_vocab=text["vocab_size"], rms_eps=text.get("rms_norm_eps", 1e-6),
        n_head=text["num_attention_heads"], n_head_kv=text["num_key_value_heads"], head_dim=head_dim,
        rope_dim=int(head_dim * partial), rope_theta=float(theta), full_attention_interval=interval,
        ssm_conv_kernel=text["linear_conv_kernel_dim"], ssm_k_heads=text["linear_num_key_heads"],
        ssm_v_heads=text["linear_num_value_heads"], ssm_head_k_dim=text["linear_key_head_dim"],
        ssm_d_inner=text["linear_value_head_dim"] * text["linear_num_value_heads"],
        n_expert=text["num_experts"], n_expert_used=text["num_experts_per_tok"],
        n_ff_exp=text["moe_intermediate_size"], n_ff_shexp=text.get("shared_expert_intermediate_size", 0),
        n_ctx_train=text.get("max_position_embeddings", 262144),
        rope_sections=(sections + (0, 0, 0, 0))[:4],
    )
    cfg.validate("config.json")
    return cfg


# ---- the value-head reorder of Qwen3.5/3.6 ----------------------------------
def to_tiled(a: np.ndarray, axis: int, cfg: ModelConfig, head_dim: int) -> np.ndarray:
    """Grouped value heads [k0: v0..v(r-1), k1: ...] -> tiled [v0 of k0, k1, ..., v1 of k0, ...]."""
    if not cfg.v_heads_tiled:
        return a
    nk, r = cfg.ssm_k_heads, cfg.ssm_v_heads // cfg.ssm_k_heads
    axis %= a.ndim
    shape = a.shape
    split = shape[:axis] + (nk, r, head_dim) + shape[axis + 1:]
    return np.ascontiguousarray(np.swapaxes(a.reshape(split), axis, axis + 1).reshape(shape))


def _plus_one(load):
    return lambda: load() + np.float32(1)


class _Planner:
    """Builds the list of GGUF tensors, each with a loader, from a checkpoint."""

    def __init__(self, ckpt, cfg: ModelConfig, prefix: str):
        self.ckpt, self.cfg, self.prefix = ckpt, cfg, prefix
        self.items: list[Item] = []

    def has(self, hf: str) -> bool:
        return self.prefix + hf in self._names or hf in self._names

    def loader(self, hf: str, transform=None):
        name = hf if hf in self._names else self.prefix + hf
        if name not in self._names:
            raise ModelError(f"checkpoint is missing tensor {self.prefix}{hf}")
        shape = self.ckpt.shape(name)
        load = (lambda: self.ckpt.load(name)) if transform is None else (lambda: transform(self.ckpt.load(name)))
        return load, shape

    def add(self, gguf: str, hf: str, transform=None, shape=None):
        load, hf_shape = self.loader(hf, transform)
        self.items.append(Item(gguf, tuple(shape or hf_shape), load))

    def plan(self) -> list[Item]:
        self._names = set(self.ckpt.names)
        cfg = self.cfg
        self.add("token_embd.weight", "embed_tokens.weight")
        for i in range(cfg.n_layer):
            self.plan_layer(i)
        self.items.append(Item("output_norm.weight", (cfg.n_embd,), _plus_one(self.loader("norm.weight")[0])))
        if "lm_head.weight" in self._names:
            load, shape = self.loader("lm_head.weight")
            self.items.append(Item("output.weight", shape, load))
        return self.items

    def plan_layer(self, i: int):
        p, b = f"layers.{i}.", f"blk.{i}."
        norm = lambda g, h: self.items.append(Item(b + g, self.loader(p + h)[1], _plus_one(self.loader(p + h)[0])))
        norm("attn_norm.weight", "input_layernorm.weight")
        norm("post_attention_norm.weight", "post_attention_layernorm.weight")
        if self.cfg.is_attention(i):
            for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                self.add(f"{b}{g}.weight", f"{p}self_attn.{h}.weight")
            norm("attn_q_norm.weight", "self_attn.q_norm.weight")
            norm("attn_k_norm.weight", "self_attn.k_norm.weight")
        else:
            self.plan_gdn(p + "linear_attn.", b)
        self.plan_moe(p + "mlp.", b, i)

    def plan_gdn(self, p: str, b: str):
        cfg = self.cfg
        dv, kd = cfg.ssm_head_v_dim, cfg.ssm_key_dim
        if self.has(p + "in_proj_qkvz.weight"):
            self.plan_qkvz(p, b)
        else:
            self.add(b + "attn_qkv.weight", p + "in_proj_qkv.weight",
                     lambda w: np.concatenate([w[:2 * kd], to_tiled(w[2 * kd:], 0, cfg, dv)]))
            self.add(b + "attn_gate.weight", p + "in_proj_z.weight", lambda w: to_tiled(w, 0, cfg, dv))
            self.add(b + "ssm_beta.weight", p + "in_proj_b.weight", lambda w: to_tiled(w, 0, cfg, 1))
            self.add(b + "ssm_alpha.weight", p + "in_proj_a.weight", lambda w: to_tiled(w, 0, cfg, 1))
        if self.has(p + "in_proj_ba.weight"):
            self.add(b + "ssm_ba.weight", p + "in_proj_ba.weight")
        conv = lambda w: w.reshape(w.shape[0], -1)
        self.add(b + "ssm_conv1d.weight", p + "conv1d.weight",
                 lambda w: np.concatenate([conv(w)[:2 * kd], to_tiled(conv(w)[2 * kd:], 0, cfg, dv)]),
                 shape=(cfg.conv_channels, cfg.ssm_conv_kernel))
        self.add(b + "ssm_dt.bias", p + "dt_bias", lambda w: to_tiled(w, 0, cfg, 1))
        self.add(b + "ssm_a", p + "A_log", lambda w: to_tiled(-np.exp(w), 0, cfg, 1))
        self.add(b + "ssm_norm.weight", p + "norm.weight")
        self.add(b + "ssm_out.weight", p + "out_proj.weight", lambda w: to_tiled(w, 1, cfg, dv))

    def plan_qkvz(self, p: str, b: str):
        """Qwen3-Next: rows are [q k v z] per key head; llama.cpp regroups them."""
        cfg = self.cfg
        nk, dk = cfg.ssm_k_heads, cfg.ssm_head_k_dim
        vz = cfg.ssm_d_inner // nk
        split = np.cumsum([dk, dk, vz])

        def parts(w):
            q, k, v, z = np.split(w.reshape(nk, -1, w.shape[-1]), split, axis=1)
            flat = lambda a: a.reshape(-1, w.shape[-1])
            return np.concatenate([flat(q), flat(k), flat(v)]), flat(z)

        d = cfg.n_embd
        self.add(b + "attn_qkv.weight", p + "in_proj_qkvz.weight", lambda w: parts(w)[0], (cfg.conv_channels, d))
        self.add(b + "attn_gate.weight", p + "in_proj_qkvz.weight", lambda w: parts(w)[1], (cfg.ssm_d_inner, d))

    def plan_moe(self, p: str, b: str, layer: int):
        cfg = self.cfg
        e, ff, d = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        self.add(b + "ffn_gate_inp.weight", p + "gate.weight")
        if self.has(p + "experts.gate_up_proj"):
            self.add(b + "ffn_gate_exps.weight", p + "experts.gate_up_proj", lambda w: w[:, :ff], (e, ff, d))
            self.add(b + "ffn_up_exps.weight", p + "experts.gate_up_proj", lambda w: w[:, ff:], (e, ff, d))
            self.add(b + "ffn_down_exps.weight", p + "experts.down_proj")
        else:
            for g, h, shape in (("gate", "gate_proj", (e, ff, d)), ("up", "up_proj", (e, ff, d)),
                                ("down", "down_proj", (e, d, ff))):
                loads = [self.loader(f"{p}experts.{x}.{h}.weight")[0] for x in range(e)]
                self.items.append(Item(f"{b}ffn_{g}_exps.weight", shape,
                                       lambda loads=loads: np.stack([ld() for ld in loads])))
        if cfg.n_ff_shexp:
            self.add(b + "ffn_gate_inp_shexp.weight", p + "shared_expert_gate.weight", shape=(1, d))
            for g, h in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                self.add(f"{b}ffn_{g}_shexp.weight", f"{p}shared_expert.{h}.weight")


def convert(hf_dir, out_path, out_type: str = "f32", progress: bool = True) -> ModelConfig:
    """Write `out_path` from the checkpoint in `hf_dir`; returns the model config."""
    from .safetensors_file import Checkpoint

    if out_type not in OUT_TYPES:
        raise ModelError(f"--type {out_type!r}: expected one of {', '.join(OUT_TYPES)}")
    hf_dir = Path(hf_dir)
    text, arch, prefix = read_hf_config(hf_dir)
    cfg = model_config_from_hf(text, arch)
    items = _Planner(Checkpoint(hf_dir), cfg, prefix).plan()
    qtype = OUT_TYPES[out_type]
    meta = cfg.to_metadata()
    meta["general.name"] = hf_dir.name
    meta["general.file_type"] = FILE_TYPE[qtype]
    meta.update(hf_tokenizer_metadata(hf_dir, cfg.n_vocab, arch))
    write_gguf(out_path, meta, items, qtype, progress)
    return cfg


def write_gguf(out_path, meta: dict, items: list[Item], qtype: GGMLType, progress: bool) -> None:
    """Declare every tensor, then stream them one at a time (shared with `fermoe synth`)."""
    from tqdm import tqdm

    with GGUFWriter(out_path) as w:
        for k, v in meta.items():
            w.add(k, v)
        types = {it.name: tensor_type(it.name, it.shape, qtype) for it in items}
        for it in items:
            w.add_tensor(it.name, it.shape, types[it.name])
        for it in tqdm(items, desc=f"writing {Path(out_path).name}", unit="tensor", disable=not progress):
            if it.raw:
                w.write_tensor(it.name, it.produce())
                continue
            data = np.asarray(it.produce(), dtype=np.float32).reshape(it.shape)
            w.write_tensor(it.name, quantize(data, types[it.name]))
