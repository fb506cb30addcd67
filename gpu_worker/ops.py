"""One method per kernel: the launch geometry each .cu file's header gives, and the
shapes it expects, checked before the launch. Every call goes on `self.stream`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.config import ModelConfig

from .buffers import DeviceArray
from .cuda_source import kernel_constants
from .kernels import DENSE_BM, DENSE_BN, KERNEL_TYPES, MOE_BM, MOE_DOWN_TILES, MOE_GATEUP_TILES, Kernels, LaunchError

# A tile's fixed cost a K step, in rows of FMAs: the 128 weight columns' loads and
# dequantisation, the A stores and the barrier are ~60 instructions a thread against
# 8 x TM x 16 FMAs, about 16 rows' worth (an instruction count, not a timing).
TILE_OVERHEAD_ROWS = 16
NARROW_COLS = 64                             # up to this many columns, the narrow kernel
# The dense tiling's model (dense_tiling): blocks run in waves of WAVE_BLOCKS_PER_SM an SM
# (the 64-accumulator tiles' registers allow two). K may be split into parts of at least
# MIN_SPLIT_STEPS steps of 16 (a tile's loads before its first FMA and its epilogue stay
# small beside them) whose partial sums fit the workspace's SPLIT_K_FLOATS.
WAVE_BLOCKS_PER_SM = 2
MIN_SPLIT_STEPS = 16
SPLIT_K_FLOATS = 1 << 22
WARP_THREAD_ROWS = 4                         # a warp is 4 x 8 threads of the tile's grid
# The grouped expert GEMMs' tile rows by the mean rows an expert gets (P / E): the
# tallest height whose threshold that mean reaches (moe_tile_rows; `bench kernels --gpu`
# sweeps them: at 59 rows 64-row tiles, at 512 rows 128-row ones)
MOE_TILE_FROM_ROWS = {64: 0, 128: 192}
_CU = kernel_constants()                     # what the .cu files #define, read from them
CHUNK = _CU["FM_CHUNK"]                      # gdn_chunk.cu's chunk of tokens
STATE_COLS = _CU["FM_STATE_COLS"]            # value columns of a head's state a block of the state pass holds
MAX_GDN_KEY_DIM = _CU["FM_GDN_MAX_DK"]       # gdn.cuh: a head's key dims in one block
MAX_HEAD_DIM = _CU["FM_ATTN_MAX_HD"]         # attention.cu
MAX_EXPERTS = _CU["FM_MAX_EXPERTS"]          # moe.cu's moe_route keeps a token's router logits in shared memory
ATTN_ROWS = _CU["FM_AQ"]                     # attention.cu's query rows a block
ACCUMULATE, SWIGLU = _CU["FM_ACCUMULATE"], _CU["FM_SWIGLU"]       # gemm.cu's flags
GEMM_K_STEP, GEMM_THREADS = _CU["FM_BK"], _CU["FM_GEMM_THREADS"]  # gemm.cu: K a step, threads a tile
GGML_TYPE = {name: int(t) for t, name in KERNEL_TYPES.items()}    # embed_rows's wtype argument


@dataclass(frozen=True)
class AttnHeads:
    """An attention layer's heads: query heads, KV heads, head dim, rotated dims."""
    nh: int
    nkv: int
    hd: int
    rope_dim: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig) -> "AttnHeads":
        return cls(cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_dim)


@dataclass(frozen=True)
class GDNHeads:
    """A Gated DeltaNet layer's heads: key heads, value heads, their dims, and whether value
    head h reads key head h % hk (tiled, llama.cpp's Qwen3.5/3.6 order) or h / (hv / hk)."""
    hk: int
    hv: int
    dk: int
    dv: int
    tiled: bool

    @classmethod
    def of(cls, cfg: ModelConfig) -> "GDNHeads":
        return cls(cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim, cfg.v_heads_tiled)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dense_tiling(M: int, N: int, K: int, sms: int, capacity: int, heights=DENSE_BM) -> tuple[int, int]:
    """Tile rows BM (of `heights`) and parts of K for C [M, N] = A [M, K] W^T on `sms`
    multiprocessors with `capacity` floats for partial sums: the smallest modelled
    time, waves of WAVE_BLOCKS_PER_SM blocks an SM, each wave a tile's BM +
    TILE_OVERHEAD_ROWS rows over its part of K; parts double while the grid stays
    within one wave, each part keeps MIN_SPLIT_STEPS steps and their sums fit. Ties
    go to fewer parts, then taller tiles."""
    best = None
    for bm in heights:
        blocks = cdiv(M, bm) * cdiv(N, DENSE_BN)
        splits = 1
        while True:
            cost = cdiv(blocks * splits, WAVE_BLOCKS_PER_SM * max(1, sms)) * (bm + TILE_OVERHEAD_ROWS) * cdiv(K, splits)
            best = min(best or (cost, splits, -bm), (cost, splits, -bm))
            if (2 * splits > K // (GEMM_K_STEP * MIN_SPLIT_STEPS) or 2 * splits * M * N > capacity
                    or 2 * splits * blocks > WAVE_BLOCKS_PER_SM * sms):
                break
            splits *= 2
    return -best[2], best[1]


def warp_rows(bm: int, bn: int) -> int:
    """Tile rows a warp computes (gemm.cu: 4 thread rows of bm * bn / 2048 rows each)."""
    return WARP_THREAD_ROWS * bm * bn // (8 * 256)


def moe_tile_rows(T: int, E: int, k: int) -> int:
    """The grouped expert GEMMs' tile rows for T tokens routed to k of E experts each:
    taller tiles once an expert averages enough rows (each weight dequantised for more
    rows)."""
    mean = T * k / max(1, E)
    return max(bm for bm, rows in MOE_TILE_FROM_ROWS.items() if mean >= rows)


def moe_useful_fraction(tile_rows, bm: int, bn: int) -> dict[str, float]:
    """Of the rows a grouped launch's tiles of bm x bn hold (n_tiles x bm), and of those
    its warps compute (a warp holds warp_rows and skips when all are past the tile's end),
    the fraction that are routed rows."""
    rows = np.asarray(tile_rows, np.int64)
    warp = warp_rows(bm, bn)
    useful = int(rows.sum())
    return {"of_tiles": useful / max(1, len(rows) * bm),
            "of_computed": useful / max(1, int((-(-rows // warp) * warp).sum()))}


def need(ok: bool, what: str):
    if not ok:
        raise LaunchError(what)


class Ops:
    def __init__(self, device):
        self.device = device
        self.k = Kernels(device)
        self.stream = device.stream("compute")
        self.split_scratch = None    # a DeviceArray of SPLIT_K_FLOATS for split-K partial sums (the workspace's)

    # ---- rows --------------------------------------------------------------
    def embed(self, out: DeviceArray, W, tokens: DeviceArray, T: int, n: int, wtype: str):
        need(out.shape == (T, n) and tokens.shape[0] >= T, f"embed: out {out.shape}, {T} tokens of {n}")
        self.k.embed_rows((T,), (256,), self.stream, out, W, tokens, T, n, GGML_TYPE[wtype])

    def rmsnorm(self, y: DeviceArray, x: DeviceArray, w: DeviceArray, rows: int, n: int, eps: float,
                ldx: int | None = None):
        need(w.shape == (n,), f"rmsnorm: weight {w.shape} for rows of {n}")
        self.k.rmsnorm((rows,), (256,), self.stream, y, x, w, rows, n, n, ldx or n, eps)

    def rmsnorm_gated(self, y, x, z, w: DeviceArray, rows: int, n: int, eps: float):
        need(w.shape == (n,), f"rmsnorm_gated: weight {w.shape} for rows of {n}")
        self.k.rmsnorm_gated((rows,), (256,), self.stream, y, x, z, w, rows, n, eps)

    # ---- products ------------------------------------------------------------
    def gemm(self, C: DeviceArray, A: DeviceArray, W, M: int, N: int, K: int, wtype: str, accumulate: bool = False,
             swiglu: bool = False, bm: int | None = None, splits: int | None = None):
        """C (+)= A W^T; with `swiglu` A's rows are [gate | up] of K each and the product
        takes silu(gate) * up (an FFN's down projection, its activation fused). `bm`
        forces the tile rows and `splits` the parts K is split into (the benchmark's
        sweep, the tests); by default dense_tiling picks, splitting only into
        `split_scratch`."""
        lda, ldc = 2 * K if swiglu else K, N
        need(C.nbytes >= 4 * ((M - 1) * ldc + N) and A.nbytes >= 4 * ((M - 1) * lda + K),
              f"gemm: C {C.shape} and A {A.shape} for [{M}, {N}] = [{M}, {K}] x W^T")
        flags = int(accumulate) * ACCUMULATE | int(swiglu) * SWIGLU
        if N <= NARROW_COLS and not swiglu and bm is None and splits is None:   # 8-row tiles, every SM busy
            self.k.gemm(wtype, "gemm_narrow")((cdiv(M, 8), cdiv(N, 32)), (8 * 32,), self.stream, C, A, W, M, N, K,
                                              lda, ldc, flags)
            return
        scratch = self.split_scratch
        capacity = scratch.nbytes // 4 if scratch is not None else 0
        picked_bm, picked_splits = dense_tiling(M, N, K, self.device.multiprocessors, capacity,
                                                (bm,) if bm else DENSE_BM)
        bm, splits = bm or picked_bm, splits or picked_splits
        need(bm in DENSE_BM, f"gemm: tiles of {bm} rows (gemm.cu has {DENSE_BM})")
        ksplit = cdiv(cdiv(K, splits), 32) * 32          # whole Q4_0 / Q8_0 blocks a part
        splits = cdiv(K, ksplit)
        grid = (cdiv(N, DENSE_BN), cdiv(M, bm), splits)
        if splits == 1:
            self.k.gemm(wtype, "gemm", bm)(grid, (GEMM_THREADS,), self.stream, C, A, W, M, N, K, lda, ldc, flags, K)
            return
        need(scratch is not None and scratch.nbytes >= 4 * splits * M * N and M * N < 2 ** 31,
              f"gemm: {splits} parts of K need {splits * M * N} floats of split_scratch")
        self.k.gemm(wtype, "gemm", bm)(grid, (GEMM_THREADS,), self.stream, scratch, A, W, M, N, K, lda, N,
                                       flags & SWIGLU, ksplit)
        self.k.gemm_splitk_sum((cdiv(M * N, 256),), (256,), self.stream, C, scratch, M, N, ldc, splits,
                               flags & ACCUMULATE)

    # ---- MoE -------------------------------------------------------------------
    def moe_route(self, topk_ids, topk_w, counts: DeviceArray, logits, T: int, E: int, k: int):
        need(counts.shape == (E,) and E <= MAX_EXPERTS, f"moe_route: counts {counts.shape} for {E} experts "
                                                          f"(the GPU kernels take up to {MAX_EXPERTS})")
        self.k.moe_route((T,), (128,), self.stream, topk_ids, topk_w, counts, logits, T, E, k)

    def moe_group(self, g, T: int, E: int, k: int, bm: int | None = None):
        """Offsets, the tile table and the grouped order from g.counts (a MoeGroups), in
        tiles of moe_tile_rows rows (or `bm`: the benchmark's sweep, the tests)."""
        need(bm is None or bm in MOE_BM, f"moe_group: tiles of {bm} rows (gemm.cu has {MOE_BM})")
        g.bm = bm or moe_tile_rows(T, E, k)
        g.cursor.zero(self.stream)          # moe_scatter's arrival counts: zero for every grouping
        self.k.moe_tiles((1,), (1,), self.stream, g.offsets, g.tile_expert, g.tile_row0, g.tile_rows, g.n_tiles,
                         g.counts, E, g.bm, g.max_tiles)
        P = T * k
        self.k.moe_scatter((cdiv(P, 256),), (256,), self.stream, g.pair_token, g.pair_pos, g.cursor, g.offsets,
                           g.topk_ids, P, k)

    def moe_gateup(self, act, x, slot, slot_map, expert_bytes: int, g, N: int, K: int, wtype: str):
        """act [P, N]: each grouped row's silu(gate) * up (the expert's SwiGLU, in the epilogue)."""
        need(act.shape[-1] == N, f"moe_gateup: act {act.shape} for rows of {N}")
        self.k.gemm(wtype, "moe_gateup", g.bm)((cdiv(N, MOE_GATEUP_TILES[g.bm] // 2), g.max_tiles), (GEMM_THREADS,), self.stream, act, x,
                                               slot, slot_map, expert_bytes, g.tile_expert, g.tile_row0,
                                               g.tile_rows, g.n_tiles, g.pair_token, N, K, K)

    def moe_down(self, y, act, slot, slot_map, expert_bytes: int, down_offset: int, g, N: int, K: int, wtype: str):
        need(act.shape[-1] == K, f"moe_down: act {act.shape} for rows of {K}")
        self.k.gemm(wtype, "moe_down", g.bm)((cdiv(N, MOE_DOWN_TILES[g.bm]), g.max_tiles), (GEMM_THREADS,), self.stream, y, act, slot,
                                             slot_map, expert_bytes, down_offset, g.tile_expert, g.tile_row0,
                                             g.tile_rows, g.n_tiles, N, K)

    def moe_combine(self, h, y, g, shared_out, x, shared_gate, T: int, d: int, k: int):
        self.k.moe_combine((T,), (256,), self.stream, h, y, g.topk_w, g.pair_pos, shared_out or 0, x,
                           shared_gate or 0, T, d, k)

    # ---- attention ---------------------------------------------------------------
    def attn_qk_norm_rope(self, q_out, Kc, Vc, qg, k_in, v_in, q_norm, k_norm, cos, sin, start: int, T: int,
                          heads: AttnHeads, eps: float, kv_f16: bool):
        nh, nkv, hd = heads.nh, heads.nkv, heads.hd
        need(hd <= MAX_HEAD_DIM, f"attention head_dim {hd}: the GPU kernels take up to {MAX_HEAD_DIM}")
        need(Kc.shape[0] >= start + T, f"attention cache of {Kc.shape[0]} positions for {start} + {T}")
        self.k.attn_qk_norm_rope((T, nh + nkv), (128,), self.stream, q_out, Kc, Vc, qg, k_in, v_in, q_norm, k_norm,
                                 cos, sin, start, T, nh, nkv, hd, heads.rope_dim, eps, int(kv_f16))

    def attn_prompt(self, out, q, Kc, Vc, qg, start: int, T: int, heads: AttnHeads):
        nh, nkv, hd = heads.nh, heads.nkv, heads.hd
        need(hd <= MAX_HEAD_DIM and hd % 4 == 0,
              f"attention head_dim {hd}: the GPU kernels take multiples of 4 up to {MAX_HEAD_DIM}")
        need(Kc.shape[0] >= start + T and Vc.shape[0] >= start + T,
              f"attention cache of {Kc.shape[0]} positions for {start} + {T}")
        need(all(int(a) % 16 == 0 for a in (q, Kc, Vc)), "attn_prompt: q, K and V must be 16-byte aligned")
        need(T * nh * hd < 2 ** 31 and (start + T) * nkv * hd < 2 ** 31,
              f"attn_prompt: {start} + {T} positions overflow the kernel's 32-bit offsets")
        # one block a head and 64 query rows, the block of the last rows (most keys) first
        self.k.attn_prompt((nh, cdiv(T, ATTN_ROWS)), (256,), self.stream, out, q, Kc, Vc, qg, start, T, nh, nkv,
                           hd, float(hd) ** -0.5)

    def to_f16(self, dst: DeviceArray, src: DeviceArray):
        n = int(np.prod(src.shape))
        need(dst.dtype == np.uint16 and dst.nbytes >= 2 * n, f"to_f16: {dst.shape} {dst.dtype} for {src.shape}")
        self.k.to_f16((cdiv(n, 256),), (256,), self.stream, dst, src, n)

    def from_f16(self, dst: DeviceArray, src: DeviceArray):
        n = int(np.prod(dst.shape))
        need(src.dtype == np.uint16 and src.nbytes >= 2 * n and dst.dtype == np.float32,
             f"from_f16: {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
        self.k.from_f16((cdiv(n, 256),), (256,), self.stream, dst, src, n)

    # ---- Gated DeltaNet -------------------------------------------------------------
    def gdn_conv(self, out, x, state, w, T: int, C: int, Kk: int):
        self.k.gdn_conv((cdiv(C, 256), T), (256,), self.stream, out, x, state, w, T, C, Kk)

    def gdn_conv_history(self, dst, state, x, n: int, T: int, C: int, Kk: int):
        self.k.gdn_conv_history((cdiv(C, 256),), (256,), self.stream, dst, state, x, n, T, C, Kk)

    def gdn_qk_gates(self, q, k, beta, g, conv, beta_proj, alpha_proj, ssm_a, dt_bias, T: int, heads: GDNHeads,
                     C: int, eps: float):
        self.k.gdn_qk_gates((T, heads.hk), (128,), self.stream, q, k, beta, g, conv, beta_proj, alpha_proj, ssm_a,
                            dt_bias, T, heads.hk, heads.hv, heads.dk, C, eps)

    def gdn_recurrent(self, o, S, q, k, v, beta, g, T: int, heads: GDNHeads, ldv: int):
        hk, hv, dk, dv, tiled = heads.hk, heads.hv, heads.dk, heads.dv, heads.tiled
        need(dk <= MAX_GDN_KEY_DIM, f"ssm.state_size {dk}: the GPU kernels take up to {MAX_GDN_KEY_DIM}")
        self.k.gdn_recurrent((hv, cdiv(dv, 32)), (dk,), self.stream, o, S, q, k, v, beta, g, T, hk, hv, dk, dv,
                             ldv, int(tiled))

    def gdn_chunked(self, o, S, q, k, v, beta, g, w, nc: int, heads: GDNHeads, ldv: int):
        """The chunked recurrence over w's chunk table (a ChunkWork): prep, state pass, output."""
        hk, hv, dk, dv, tiled = heads.hk, heads.hv, heads.dk, heads.dv, heads.tiled
        need(dk <= MAX_GDN_KEY_DIM and dk % 4 == 0,
              f"ssm.state_size {dk}: the chunked GPU kernels take multiples of 4 up to {MAX_GDN_KEY_DIM}")
        need(int(k) % 16 == 0, "gdn_chunked: k must be 16-byte aligned (the state pass reads it 4 floats at once)")
        need(w.W.shape[-2:] == (dk, CHUNK) and w.chunk_start.shape[0] >= nc and w.S0.shape[0] >= nc,
              f"gdn_chunked: a chunk table of {w.chunk_start.shape[0]} chunks, W {w.W.shape}, for {nc} chunks of "
              f"dk {dk}")
        s = self.stream
        self.k.gdn_chunk_prep((nc, hv), (256,), s, w.W, w.U, w.Gc, w.P, q, k, v, beta, g, w.chunk_start,
                              w.chunk_len, hk, hv, dk, dv, ldv, int(tiled))
        self.k.gdn_chunk_state((hv, cdiv(dv, STATE_COLS)), (256,), s, S, w.S0, w.Vn, w.W, w.U, w.Gc, k, w.chunk_start,
                               w.chunk_len, nc, hk, hv, dk, dv, int(tiled))
        self.k.gdn_chunk_output((nc, hv, cdiv(dv, 32)), (256,), s, o, q, w.S0, w.Vn, w.P, w.Gc, w.chunk_start,
                                w.chunk_len, hk, hv, dk, dv, int(tiled))
