"""The activations of one pass of up to T tokens, allocated once per engine. The
Gated DeltaNet and attention layers never run at once, so their projections share
buffers (`proj`, `mix`, `mid`); the plan (plan.py) counts bytes from the same spec."""
from __future__ import annotations

import numpy as np

from shared.config import ModelConfig

from .buffers import DeviceArray
from .kernels import MOE_BM
from .ops import CHUNK, SPLIT_K_FLOATS, ChunkWork, MoeGroups

LOGIT_ROWS = 64          # LM head rows a launch computes (and a download brings back)


def chunks_of(n: int, cuts=()) -> tuple[list[int], list[int]]:
    """A pass of n tokens in GDN chunks: at most 64 tokens each, also cut at `cuts`
    (snapshot positions inside the pass). Returns (starts, lengths)."""
    edges = sorted({0, n, *cuts, *range(CHUNK, n, CHUNK)})
    return edges[:-1], [b - a for a, b in zip(edges, edges[1:])]


def workspace_spec(cfg: ModelConfig, T: int) -> dict[str, tuple]:
    """Buffer name -> shape (float32 unless the name says int), for passes of up to T tokens."""
    d, C, Di = cfg.n_embd, cfg.conv_channels, cfg.ssm_d_inner
    hk, hv, dk, dv = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    k, ff = cfg.n_expert_used, cfg.n_ff_exp
    return {
        "h": (T, d), "x": (T, d),
        "proj": (T, max(C, 2 * nh * hd)),      # qkv | attention's query+gate
        "mix": (T, max(C, nh * hd)),           # conv output | attention's rotated queries
        "mid": (T, max(Di, nh * hd)),          # z | attention output
        "o": (T, hv * dv),
        "b": (T, hv), "a": (T, hv), "beta": (T, hv), "g": (T, hv),
        "q": (T, hk * dk), "k": (T, hk * dk),
        "kv_k": (T, nkv * hd), "kv_v": (T, nkv * hd),
        "router": (T, cfg.n_expert),
        "act": (T * k, ff), "moe_out": (T * k, d),              # act: silu(gate) * up of each grouped row
        "shared_act": (T, max(2 * cfg.n_ff_shexp, 1)), "shared_out": (T, d),    # [gate | up]
        "lm_rows": (LOGIT_ROWS, d), "logits": (LOGIT_ROWS, cfg.n_vocab),
        "conv_snap": (cfg.ssm_conv_kernel - 1, C),
        "rope_cos": (T, max(cfg.rope_dim // 2, 1)), "rope_sin": (T, max(cfg.rope_dim // 2, 1)),
        "embed_raw": (T, d),                   # the prompt's embedding rows, in the table's type (<= f32)
        "tokens int": (T,),
        "kv16_k half": (T, nkv * hd), "kv16_v half": (T, nkv * hd),   # a layer's new K, V as fp16 bits
        "splitk": (SPLIT_K_FLOATS,),           # partial sums of a dense GEMM split along K
    }


def chunk_spec(cfg: ModelConfig, n_chunks: int) -> dict[str, tuple]:
    hv, dk, dv = cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    f = (n_chunks, hv)
    return {"W": f + (dk, CHUNK), "U": f + (CHUNK, dv), "Vn": f + (CHUNK, dv), "P": f + (CHUNK, CHUNK),
            "Gc": f + (CHUNK,), "S0": f + (dk, dv), "chunk_start int": (n_chunks,), "chunk_len int": (n_chunks,)}


def routing_nbytes(cfg: ModelConfig, T: int) -> int:
    E, k = cfg.n_expert, cfg.n_expert_used
    return 4 * (2 * T * k + 3 * E + 1 + 3 * (-(-T * k // min(MOE_BM)) + E) + 1 + 2 * T * k)


def workspace_nbytes(cfg: ModelConfig, T: int, n_chunks: int | None = None) -> int:
    n_chunks = n_chunks or -(-T // CHUNK)
    spec = {**workspace_spec(cfg, T), **chunk_spec(cfg, n_chunks)}
    return sum(_itemsize(name) * int(np.prod(shape)) for name, shape in spec.items()) + routing_nbytes(cfg, T)


_KINDS = {"int": np.int32, "half": np.uint16, "": np.float32}


def _itemsize(name: str) -> int:
    return np.dtype(_KINDS[name.partition(" ")[2]]).itemsize


class Workspace:
    """Buffers for passes of up to T tokens cut into up to n_chunks GDN chunks."""

    def __init__(self, device, cfg: ModelConfig, T: int, n_chunks: int | None = None):
        self.T, self.n_chunks = T, n_chunks or -(-T // CHUNK)
        self.arrays = []
        for name, shape in workspace_spec(cfg, T).items():
            key, _, kind = name.partition(" ")
            setattr(self, key, DeviceArray(device, shape, _KINDS[kind]))
            self.arrays.append(getattr(self, key))
        self.chunks = ChunkWork(device, self.n_chunks, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim)
        self.groups = MoeGroups(device, T, cfg.n_expert, cfg.n_expert_used)
        self.arrays += [a for part in (self.chunks, self.groups) for a in vars(part).values()
                        if isinstance(a, DeviceArray)]

    def free(self) -> None:
        for a in self.arrays:
            a.free()
