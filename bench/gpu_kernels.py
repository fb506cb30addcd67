"""`fermoe bench kernels --gpu`: the GPU GEMM kernels on the shapes of a prefill, as JSON.

For each prompt length T (947 and 8192 by default) and each dense projection of the
model (a preset's real dimensions: the benchmark workload), C [T, N] = A [T, K] W^T
is timed with Q4_0 weights (what the engine runs: dequantised in the tile) and with
the same kernels on fp32 weights (so the difference is what the dequantisation
costs), at the tile height and K split the engine picks (gpu_worker.ops.dense_tiling)
and at every other tile height, each with its own best split (`tiles`: whether the
pick is the fastest; `unsplit_q4_0`: the pick without its split). The routed experts are
timed as the engine runs them: T tokens routed by random logits on the device
(moe_route, moe_group), then one grouped gate|up launch and one down launch over
every expert, with the useful fraction of the rows their tiles hold and compute.
With the sweep, the experts are also timed in every tile height (`tiles_q4_0`, each
with its useful fraction). The chunked Gated DeltaNet of one layer (`gdn`) gives each
of its three kernels' milliseconds. The fp32 FMA probe (probe.cu) is measured in the
same run, and every rate is also given as its fraction.

TFLOP/s count 2 FLOPs a multiply-add of the product itself (routed rows only for
the experts), over the best of --reps timings of a batch of launches between two
events on one stream. scripts/cublas_gemm.py runs this and cuBLAS on the same
shapes in one run.

JSON keys:
  device                  the GPU's name ("host emulation" under FERMOE_GPU=emulate)
  multiprocessors         its multiprocessors
  preset                  the model dimensions (a synth preset, --gpu-preset)
  experts                 routed experts a layer (the preset's, at most 128)
  fp32_fma_tflops         TFLOP/s: the FMA probe (probe.cu's fma_peak) over the whole device
  setup.reps              timings of which the best counts (--reps)
  setup.launches_a_timing  launches between the two events of a timing
  setup.weights           the weight types timed
  prompts.<T>             one prompt length T (--gpu-prompts): the GEMMs' rows
  prompts.<T>.dense[]     one dense projection of the model: C [M, N] = A [M, K] W^T
  prompts.<T>.dense[].name  the projection (gdn_qkv, attn_out, router, ...)
  prompts.<T>.dense[].M   rows: T
  prompts.<T>.dense[].N   output columns
  prompts.<T>.dense[].K   the reduction (A's columns; shexp_down: after the SwiGLU of [gate | up])
  prompts.<T>.dense[].tile_rows  the tile height the engine picks, or "narrow" (the narrow kernel)
  prompts.<T>.dense[].k_splits  the K splits the engine picks at that height
  prompts.<T>.dense[].q4_0  with Q4_0 weights (dequantised in the tile), at the engine's pick
  prompts.<T>.dense[].q4_0.ms  ms a launch: the best of --reps timings
  prompts.<T>.dense[].q4_0.tflops  TFLOP/s of the product
  prompts.<T>.dense[].q4_0.fraction_of_fma  tflops over fp32_fma_tflops
  prompts.<T>.dense[].f32  keys as prompts.<T>.dense[].q4_0: the same kernels on fp32 weights
  prompts.<T>.dense[].tiles_q4_0.<rows>  TFLOP/s at each tile height, each with its best split (sweep)
  prompts.<T>.dense[].unsplit_q4_0  keys as prompts.<T>.dense[].q4_0: the pick without its K split
                          (where it splits)
  prompts.<T>.dense[].dequant_cost  q4_0's ms over f32's, minus 1
  prompts.<T>.experts[]   the grouped gate|up launch and the down launch over every expert
  prompts.<T>.experts[].name  experts_gate_up or experts_down
  prompts.<T>.experts[].M  routed rows: T x the experts a token uses
  prompts.<T>.experts[].N  output columns an expert
  prompts.<T>.experts[].K  the reduction
  prompts.<T>.experts[].experts  experts over which the rows are grouped
  prompts.<T>.experts[].rows_per_expert  M over experts
  prompts.<T>.experts[].tile_rows  the tile height the engine picks (ops.moe_tile_rows)
  prompts.<T>.experts[].useful_fraction  at that height:
  prompts.<T>.experts[].useful_fraction.tiles  tiles of the grouping
  prompts.<T>.experts[].useful_fraction.of_tiles  routed rows over the rows the tiles hold
  prompts.<T>.experts[].useful_fraction.of_computed  routed rows over the rows the warps compute
  prompts.<T>.experts[].q4_0  keys as prompts.<T>.dense[].q4_0: Q4_0 weights, the picked height
  prompts.<T>.experts[].f32  keys as prompts.<T>.dense[].q4_0: fp32 weights
  prompts.<T>.experts[].tiles_q4_0.<rows>  keys as prompts.<T>.dense[].q4_0: Q4_0 weights at each tile
                          height (sweep), and useful_fraction:
  prompts.<T>.experts[].tiles_q4_0.<rows>.useful_fraction  keys as prompts.<T>.experts[].useful_fraction:
                          the grouping at that height
  prompts.<T>.experts[].dequant_cost  q4_0's ms over f32's, minus 1
  prompts.<T>.gdn         the chunked Gated DeltaNet of one layer over T tokens
  prompts.<T>.gdn.T       tokens
  prompts.<T>.gdn.chunks  chunks of 64 tokens
  prompts.<T>.gdn.heads   value heads
  prompts.<T>.gdn.layers  GDN layers of the model
  prompts.<T>.gdn.ms.<kernel>  ms of gdn_chunk_prep, gdn_chunk_state (the sequential pass) and
                          gdn_chunk_output
  prompts.<T>.gdn.ms_all_layers  ms: the three, summed, times layers
"""
from __future__ import annotations

import json

import numpy as np

from .weights import random_weights

PROMPTS = (947, 8192)
BENCH_EXPERTS = 128          # the full-size synthetic model (fermoe synth --experts 128)


def dense_shapes(cfg) -> list[dict]:
    """The dense projections of one of each layer kind: name, N, K, and whether A is [gate | up]."""
    d, nh, hd = cfg.n_embd, cfg.n_head, cfg.head_dim
    return [
        {"name": "gdn_qkv", "N": cfg.conv_channels, "K": d},
        {"name": "gdn_z", "N": cfg.ssm_d_inner, "K": d},
        {"name": "gdn_out", "N": d, "K": cfg.ssm_d_inner},
        {"name": "attn_q_gate", "N": 2 * nh * hd, "K": d},
        {"name": "attn_k", "N": cfg.n_head_kv * hd, "K": d},
        {"name": "attn_out", "N": d, "K": nh * hd},
        {"name": "shexp_gate_up", "N": 2 * cfg.n_ff_shexp, "K": d},
        {"name": "shexp_down", "N": d, "K": cfg.n_ff_shexp, "swiglu": True},
        {"name": "router", "N": cfg.n_expert, "K": d},
    ]


def expert_shapes(cfg) -> list[dict]:
    """gate|up: 2 ff outputs an expert (its SwiGLU in the epilogue); down reads ff."""
    return [{"name": "experts_gate_up", "N": 2 * cfg.n_ff_exp, "K": cfg.n_embd},
            {"name": "experts_down", "N": cfg.n_embd, "K": cfg.n_ff_exp}]


def bench_config(preset: str):
    from modeltools.synth import preset_config
    return preset_config(preset, experts=min(BENCH_EXPERTS, preset_config(preset).n_expert))


class Timer:
    """Milliseconds a launch: the best of `reps` batches of `batch` launches between events."""

    def __init__(self, device, stream, reps: int, batch: int):
        self.device, self.stream, self.reps, self.batch = device, stream, reps, batch

    def ms(self, launch) -> float:
        launch()                                # warm: the module's first use, caches
        best = float("inf")
        for _ in range(self.reps):
            a, b = self.device.event(), self.device.event()
            a.record(self.stream)
            for _ in range(self.batch):
                launch()
            b.record(self.stream)
            b.synchronize()
            best = min(best, b.time_since(a) / self.batch)
        return best


def fma_tflops(device, kernels, stream, ms_target: float = 200.0) -> float:
    """The fp32 FMA rate of probe.cu's fma_peak over the whole device."""
    from gpu_worker.buffers import DeviceArray
    blocks, threads = device.multiprocessors * 16, 256
    out = DeviceArray(device, (blocks * threads,))
    iters = 64
    while True:
        a, b = device.event(), device.event()
        a.record(stream)
        kernels.fma_peak((blocks,), (threads,), stream, out, iters, 1.0)
        b.record(stream)
        b.synchronize()
        ms = b.time_since(a)
        if ms >= ms_target or iters >= 1 << 20:
            out.free()
            return blocks * threads * iters * 128 / (ms / 1000) / 1e12
        iters *= max(2, int(ms_target / max(ms, 1e-3)))


def _rate(flops: float, ms: float, peak: float) -> dict:
    tflops = flops / (ms / 1000) / 1e12
    return {"ms": round(ms, 4), "tflops": round(tflops, 2), "fraction_of_fma": round(tflops / peak, 3)}


def _dense(ops, timer, shape: dict, T: int, peak: float, rng, sweep: bool) -> dict:
    from gpu_worker.buffers import DeviceArray
    from gpu_worker.kernels import DENSE_BM
    from gpu_worker.ops import NARROW_COLS, dense_tiling
    N, K, swiglu = shape["N"], shape["K"], shape.get("swiglu", False)
    dev = ops.device
    A = DeviceArray.of(dev, rng.standard_normal((T, 2 * K if swiglu else K)).astype(np.float32))
    C = DeviceArray(dev, (T, N))
    flops = 2.0 * T * N * K
    narrow = N <= NARROW_COLS and not swiglu
    bm, splits = dense_tiling(T, N, K, dev.multiprocessors, ops.split_scratch.nbytes // 4)
    out = {"name": shape["name"], "M": T, "N": N, "K": K, "tile_rows": "narrow" if narrow else bm,
           "k_splits": 1 if narrow else splits}
    for wtype in ("q4_0", "f32"):
        W = DeviceArray.of(dev, random_weights(N, K, wtype, rng))
        run = lambda bm=None: ops.gemm(C, A, W, T, N, K, wtype, swiglu=swiglu, bm=bm)  # noqa: E731
        out[wtype] = _rate(flops, timer.ms(run), peak)
        if sweep and wtype == "q4_0" and not narrow:
            out["tiles_q4_0"] = {str(bm): _rate(flops, timer.ms(lambda bm=bm: run(bm)), peak)["tflops"]
                                 for bm in DENSE_BM}
            if out["k_splits"] > 1:          # what the split gains
                whole = lambda: ops.gemm(C, A, W, T, N, K, wtype, swiglu=swiglu, bm=bm, splits=1)  # noqa: E731
                out["unsplit_q4_0"] = _rate(flops, timer.ms(whole), peak)
        W.free()
    out["dequant_cost"] = round(out["q4_0"]["ms"] / out["f32"]["ms"] - 1, 3)
    A.free()
    C.free()
    return out


def _experts(ops, timer, cfg, T: int, peak: float, rng, sweep: bool) -> list[dict]:
    """The grouped gate|up and down launches over every expert, Q4_0 and fp32 weights,
    in the tiles the engine picks (ops.moe_tile_rows); with `sweep`, Q4_0 in every tile
    height too (`tiles_q4_0`: TFLOP/s and the useful fractions of each)."""
    from gpu_worker.buffers import DeviceArray
    from gpu_worker.kernels import MOE_BM, MOE_DOWN_TILES, MOE_GATEUP_TILES
    from gpu_worker.ops import moe_tile_rows, moe_useful_fraction
    from gpu_worker.workspace import MoeGroups
    dev, E, k, d, ff = ops.device, cfg.n_expert, cfg.n_expert_used, cfg.n_embd, cfg.n_ff_exp
    P = T * k
    g = MoeGroups(dev, T, E, k)
    g.reset(ops.stream)
    logits = DeviceArray.of(dev, rng.standard_normal((T, E)).astype(np.float32))
    ops.moe_route(g.topk_ids, g.topk_w, g.counts, logits, T, E, k)
    picked = moe_tile_rows(T, E, k)

    def group(bm: int) -> dict[str, dict]:
        """Each launch's useful fractions in tiles of bm rows (its own columns: its warps' rows)"""
        ops.moe_group(g, T, E, k, bm)
        n_tiles = int(g.n_tiles.download()[0])
        rows = g.tile_rows.download()[:n_tiles]
        return {name: {"tiles": n_tiles, **{key: round(v, 3) for key, v in
                                           moe_useful_fraction(rows, bm, tiles[bm]).items()}}
                for name, tiles in (("experts_gate_up", MOE_GATEUP_TILES), ("experts_down", MOE_DOWN_TILES))}

    useful = group(picked)
    x = DeviceArray.of(dev, rng.standard_normal((T, d)).astype(np.float32))
    act, y = DeviceArray(dev, (P, ff)), DeviceArray(dev, (P, d))
    act.upload(rng.standard_normal((P, ff)).astype(np.float32))
    results = {s["name"]: {"name": s["name"], "M": P, "N": s["N"], "K": s["K"], "experts": E,
                           "rows_per_expert": round(P / E, 1), "tile_rows": picked, "useful_fraction": useful[s["name"]]}
               for s in expert_shapes(cfg)}
    for wtype in ("q4_0", "f32"):
        gate_up = [random_weights(2 * ff, d, wtype, rng) for _ in range(E)]
        down = [random_weights(d, ff, wtype, rng) for _ in range(E)]
        down_offset = len(gate_up[0])
        expert_bytes = down_offset + len(down[0])
        slot = DeviceArray.of(dev, np.concatenate([m for pair in zip(gate_up, down) for m in pair]))
        del gate_up, down
        identity = DeviceArray.of(dev, np.arange(E, dtype=np.int32))      # expert e in record e of the slot
        runs = {"experts_gate_up": lambda: ops.moe_gateup(act, x, slot, identity, expert_bytes, g, ff, d, wtype),
                "experts_down": lambda: ops.moe_down(y, act, slot, identity, expert_bytes, down_offset, g, d, ff,
                                                     wtype)}
        heights = [picked] + [bm for bm in MOE_BM if bm != picked] if sweep and wtype == "q4_0" else [picked]
        for bm in heights:                      # the pick first, so its grouping is the one timed above
            fraction = group(bm)
            for s in expert_shapes(cfg):
                rate = _rate(2.0 * P * s["N"] * s["K"], timer.ms(runs[s["name"]]), peak)
                if bm == picked:
                    results[s["name"]][wtype] = rate
                if len(heights) > 1:
                    results[s["name"]].setdefault("tiles_q4_0", {})[str(bm)] = {**rate, "useful_fraction": fraction[s["name"]]}
        ops.moe_group(g, T, E, k, picked)
        slot.free()
        identity.free()
    for r in results.values():
        r["dequant_cost"] = round(r["q4_0"]["ms"] / r["f32"]["ms"] - 1, 3)
    for a in (x, act, y, logits):
        a.free()
    return list(results.values())


def _gdn(ops, timer, cfg, T: int, peak: float, rng) -> dict:
    """The chunked Gated DeltaNet of one layer over T tokens (chunks of 64): each of its
    three kernels' milliseconds, the state pass being the sequential one."""
    from gpu_worker.buffers import DeviceArray
    from gpu_worker.ops import STATE_COLS, cdiv
    from gpu_worker.workspace import ChunkWork
    from gpu_worker.workspace import chunks_of
    dev = ops.device
    hk, hv, dk, dv = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)              # noqa: E731
    q = DeviceArray.of(dev, (unit(rng.standard_normal((T, hk, dk))) / np.sqrt(dk)).astype(np.float32))
    k = DeviceArray.of(dev, unit(rng.standard_normal((T, hk, dk))).astype(np.float32))
    v = DeviceArray.of(dev, rng.standard_normal((T, hv * dv)).astype(np.float32))
    beta = DeviceArray.of(dev, (1 / (1 + np.exp(-rng.standard_normal((T, hv))))).astype(np.float32))
    g = DeviceArray.of(dev, (-0.3 * np.exp(rng.standard_normal((T, hv)))).astype(np.float32))
    S, o = DeviceArray(dev, (hv, dk, dv)), DeviceArray(dev, (T, hv, dv))
    S.zero()
    starts, lengths = chunks_of(T)
    w = ChunkWork(dev, len(starts), hv, dk, dv)
    nc = w.set_chunks(starts, lengths)
    kk, s, tiled = ops.k, ops.stream, int(cfg.v_heads_tiled)
    runs = {
        "gdn_chunk_prep": lambda: kk.gdn_chunk_prep((nc, hv), (256,), s, w.W, w.U, w.Gc, w.P, q, k, v, beta, g,
                                                    w.chunk_start, w.chunk_len, hk, hv, dk, dv, hv * dv, tiled),
        "gdn_chunk_state": lambda: kk.gdn_chunk_state((hv, cdiv(dv, STATE_COLS)), (256,), s, S, w.S0, w.Vn, w.W,
                                                      w.U, w.Gc, k, w.chunk_start, w.chunk_len, nc, hk, hv, dk, dv,
                                                      tiled),
        "gdn_chunk_output": lambda: kk.gdn_chunk_output((nc, hv, cdiv(dv, 32)), (256,), s, o, q, w.S0, w.Vn, w.P,
                                                        w.Gc, w.chunk_start, w.chunk_len, hk, hv, dk, dv, tiled),
    }
    out = {"T": T, "chunks": nc, "heads": hv, "layers": len(cfg.gdn_layers),
           "ms": {name: round(timer.ms(run), 4) for name, run in runs.items()}}
    out["ms_all_layers"] = round(sum(out["ms"].values()) * len(cfg.gdn_layers), 2)
    for a in (q, k, v, beta, g, S, o):
        a.free()
    for a in vars(w).values():
        if isinstance(a, DeviceArray):
            a.free()
    return out


def run(preset: str = "qwen3.6-35b-a3b", prompts=PROMPTS, reps: int = 5, batch: int = 10, sweep: bool = True,
        device=None, probe_ms: float = 200.0) -> dict:
    from gpu_worker.cuda import open_device
    from gpu_worker.buffers import DeviceArray
    from gpu_worker.ops import SPLIT_K_FLOATS, Ops
    cfg = bench_config(preset)
    owns_device = device is None
    device = device or open_device(0)
    try:
        ops = Ops(device)
        ops.split_scratch = DeviceArray(device, (SPLIT_K_FLOATS,))         # as the engine's workspace gives it
        timer = Timer(device, ops.stream, reps, batch)
        rng = np.random.default_rng(0)
        peak = fma_tflops(device, ops.k, ops.stream, probe_ms)
        out = {"device": device.name, "multiprocessors": device.multiprocessors, "preset": preset,
               "experts": cfg.n_expert, "fp32_fma_tflops": float(f"{peak:.4g}"),
               "setup": {"reps": reps, "launches_a_timing": batch, "weights": ["q4_0", "f32"]}, "prompts": {}}
        for T in prompts:
            out["prompts"][str(T)] = {
                "dense": [_dense(ops, timer, s, T, peak, rng, sweep) for s in dense_shapes(cfg)],
                "experts": _experts(ops, timer, cfg, T, peak, rng, sweep),
                "gdn": _gdn(ops, timer, cfg, T, peak, rng),
            }
    finally:
        if owns_device and hasattr(device, "close"):
            device.synchronize()
            device.close()          # pycuda aborts the process at exit if its context is still current
    return out


def main(args) -> None:
    """From bench/kernels.py's command line (--gpu)."""
    prompts = tuple(int(x) for x in args.gpu_prompts.split(","))
    print(json.dumps(run(args.gpu_preset, prompts, args.reps, sweep=not args.no_sweep), indent=2))
