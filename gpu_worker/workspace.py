"""The activations of one pass of up to T tokens, allocated once per engine. The
Gated DeltaNet and attention layers never run at once, so their projections share
buffers (`proj`, `mix`, `mid`); the plan (plan.py) counts bytes from the same spec."""
from __future__ import annotations

import numpy as np

from shared.config import ModelConfig

from .buffers import DeviceArray
from .kernels import MOE_BM
from .ops import CHUNK, SPLIT_K_FLOATS, need

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
        "beta_proj": (T, hv), "alpha_proj": (T, hv),     # x ssm_beta, x ssm_alpha: the gates before their nonlinearity
        "beta": (T, hv), "g": (T, hv),
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


def workspace_nbytes(cfg: ModelConfig, T: int, n_chunks: int | None = None) -> int:
    """Bytes of Workspace(cfg, T, n_chunks): counted from the specs it allocates by."""
    n_chunks = n_chunks or -(-T // CHUNK)
    parts = [{name: (shape, _KINDS[name.partition(" ")[2]]) for name, shape in workspace_spec(cfg, T).items()},
             ChunkWork.spec(n_chunks, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim),
             MoeGroups.spec(T, cfg.n_expert, cfg.n_expert_used)]
    return sum(np.dtype(dtype).itemsize * int(np.prod(shape)) for part in parts for shape, dtype in part.values())


_KINDS = {"int": np.int32, "half": np.uint16, "": np.float32}


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


class MoeGroups:
    """A MoE block's routing of up to T tokens, in device memory (moe.cu)."""

    @staticmethod
    def spec(T: int, E: int, k: int) -> dict[str, tuple]:
        """Buffer name -> (shape, dtype): what __init__ allocates, and the plan counts."""
        P, i32 = T * k, np.int32
        tiles = MoeGroups.max_tiles_of(T, E, k)
        return {"topk_ids": ((T, k), i32), "topk_w": ((T, k), np.float32), "counts": ((E,), i32),
                "cursor": ((E,), i32), "offsets": ((E + 1,), i32), "tile_expert": ((tiles,), i32),
                "tile_row0": ((tiles,), i32), "tile_rows": ((tiles,), i32), "n_tiles": ((1,), i32),
                "pair_token": ((P,), i32), "pair_pos": ((P,), i32)}

    @staticmethod
    def max_tiles_of(T: int, E: int, k: int) -> int:
        """Tiles of the smallest height, a partial one an expert."""
        return -(-T * k // min(MOE_BM)) + E

    def __init__(self, device, T: int, E: int, k: int):
        self.max_tiles = self.max_tiles_of(T, E, k)
        for name, (shape, dtype) in self.spec(T, E, k).items():
            setattr(self, name, DeviceArray(device, shape, dtype))
        self.bm = MOE_BM[0]          # the tiles' rows (set by Ops.moe_group)

    def reset(self, stream):
        self.counts.zero(stream)
        self.cursor.zero(stream)


class ChunkWork:
    """The chunked recurrence's buffers for up to n_chunks chunks (gdn_chunk.cu), and
    the chunk table of the pass, uploaded once and shared by every GDN layer."""

    @staticmethod
    def spec(n_chunks: int, hv: int, dk: int, dv: int) -> dict[str, tuple]:
        """Buffer name -> (shape, dtype): what __init__ allocates, and the plan counts."""
        f, f32 = (n_chunks, hv), np.float32
        return {"W": (f + (dk, CHUNK), f32),          # key-major: the state pass reads slabs of key dims
                "U": (f + (CHUNK, dv), f32), "Vn": (f + (CHUNK, dv), f32), "P": (f + (CHUNK, CHUNK), f32),
                "Gc": (f + (CHUNK,), f32), "S0": (f + (dk, dv), f32),
                "chunk_start": ((n_chunks,), np.int32), "chunk_len": ((n_chunks,), np.int32)}

    def __init__(self, device, n_chunks: int, hv: int, dk: int, dv: int):
        for name, (shape, dtype) in self.spec(n_chunks, hv, dk, dv).items():
            setattr(self, name, DeviceArray(device, shape, dtype))
        self.n_chunks = n_chunks

    def part(self, first: int, stop: int) -> "ChunkWork":
        """Chunks [first, stop) of the table as a ChunkWork of their own (views: the same
        memory), for a GDN call over one sequence of a pass; their chunk_start values stay
        rows of the whole pass."""
        need(0 <= first < stop <= self.n_chunks, f"chunks [{first}, {stop}) of a table of {self.n_chunks}")
        out = object.__new__(ChunkWork)
        for name, a in vars(self).items():
            setattr(out, name, a.rows(first, stop) if isinstance(a, DeviceArray) else a)
        out.n_chunks = stop - first
        return out

    def set_chunks(self, starts, lengths) -> int:
        n = len(starts)
        need(0 < n <= self.n_chunks and max(lengths) <= CHUNK, f"{n} chunks for a table of {self.n_chunks}")
        self.chunk_start.rows(0, n).upload(np.asarray(starts, np.int32))
        self.chunk_len.rows(0, n).upload(np.asarray(lengths, np.int32))
        return n

