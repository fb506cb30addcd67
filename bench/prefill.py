"""`fermoe bench prefill MODEL`: the GPU engine's prefill of a prompt, next to its
floor measured in the same run, as JSON.

The floor of a prefill is the larger of two: the expert bytes it streams over the
page-locked host-to-device bandwidth (measured here, with the same copy calls), and
its fp32 FLOPs over the FMA rate of this GPU (a kernel of independent FMA chains,
measured here). Time by phase comes from events on the compute stream
(`copy_wait`: the compute stream stalled for an expert layer's copy), and by kernel;
`kernel_families` gives each family's (dense GEMMs, routed experts, attention, GDN)
achieved TFLOP/s and its fraction of the FMA rate.

Switches for the paper's ablations: --pageable (expert memory not page-locked),
--chunk N (passes of at most N tokens instead of one), --no-overlap (copies on the
compute stream), --no-resident (no expert layer kept in VRAM), --lm-head cpu,
--kv-layers N (at most N attention layers' KV kept in VRAM, the others' in host memory).
--no-profile skips the prefills timed by phase and by kernel (the longest prompts).

JSON keys (one object a prompt length; several --prompt lengths print a list of them):
  model                   the GGUF path or built-in name given
  device                  the GPU's name ("host emulation" under FERMOE_GPU=emulate)
  prompt_tokens           tokens of the prompt (random ids, one new sequence)
  switches                the ablation switches of this run
  switches.pinned         bool: expert memory page-locked (false: --pageable)
  switches.overlap        bool: expert copies on a stream of their own (false: --no-overlap)
  switches.resident       bool: expert layers kept in VRAM where they fit (false: --no-resident)
  switches.lm_head        "gpu" or "cpu": where the last position's logits are computed
  switches.chunk          tokens a pass holds at most (--chunk; null: the whole prompt in one)
  switches.ring_slots     expert-layer slots of the copy ring (--ring)
  switches.kv_layers      attention layers' KV kept in VRAM at most (--kv-layers; null: as many as fit)
  prefill_s               s: the median of --reps prefills (after one warm-up)
  prefill_s_min           s: the fastest of them
  tok_s                   tokens/s: prompt_tokens over prefill_s
  passes                  passes the prompt takes
  pass_tokens             tokens a pass holds at most
  setup_s                 s: building the engine (weights up, memory plan, host expert memory)
  host_s                  the host's seconds of the last timed prefill, by part
  host_s.enqueue_s        s: enqueueing the passes (with their own waits)
  host_s.wait_s           s: waiting for the device at the end
  host_s.finish_s         s: finishing (states and logits handed back)
  streamed_gb             GB (1e9 bytes): expert bytes copied host to device in a prefill (median)
  h2d_gbps_during_prefill GB/s: streamed_gb over prefill_s
  pinned_h2d_gbps         GB/s: the best of 5 host-to-device copies from page-locked memory (up to 4
                          expert layers' bytes, at most 1 GiB), with the engine's copy calls
  pageable_h2d_gbps       GB/s: the same from ordinary memory
  fp32_fma_tflops         TFLOP/s: the FMA probe's rate (bench/gpu_kernels.py's fma_tflops)
  gflop                   GFLOP (fp32, 2 a multiply-add) of the prefill, all parts
  gflop_by_part.<part>    GFLOP of dense (every matrix but the routed experts), experts, attention,
                          gdn (the chunked form) and lm_head (the last position only)
  achieved_tflops         TFLOP/s: gflop over prefill_s
  floor                   the prefill's floor: the larger of its copies and its FLOPs
  floor.copy_s            s: streamed_gb at pinned_h2d_gbps
  floor.compute_s         s: gflop at fp32_fma_tflops
  floor.floor_s           s: the larger of the two
  fraction_of_floor       floor.floor_s over prefill_s (1: at the floor)
  phases_ms               null with --no-profile, as kernels_ms and kernel_families
  phases_ms.<phase>       ms on the compute stream by phase of one more prefill (events), costliest
                          first; copy_wait: the stream stalled for an expert layer's copy
  kernels_ms.<kernel>     ms by kernel of one more prefill, the 16 costliest: each from its launch to
                          the next on the compute stream, the last of a pass to its end
  kernel_families.<family>  dense, experts, attention and gdn: the kernels of each family
  kernel_families.<family>.ms  ms: the family's kernels, summed from kernels_ms' timing (all kernels)
  kernel_families.<family>.tflops  TFLOP/s: its parts' FLOPs (gflop_by_part) over that time
  kernel_families.<family>.fraction_of_fma  its tflops over fp32_fma_tflops
  memory                  the engine's memory plan
  memory.gpu_budget_mib   MiB: the GPU memory the engine may use (--gpu-mem, or what is free)
  memory.gpu_planned_mib  MiB: what the plan uses of it
  memory.resident_expert_layers  expert layers kept in VRAM
  memory.streamed_expert_layers  expert layers copied from host memory for each pass
  memory.host_expert_mib  MiB: host memory of the streamed expert layers
  memory.layer_mib        MiB: one expert layer's bytes
  memory.kv_placement     where the attention KV lived, in words
  memory.kv_device_layers attention layers whose KV stayed in VRAM for the whole prefill
  memory.kv_host_layers   attention layers whose KV lived in page-locked host memory, copied up
                          through one VRAM slot before each pass's attention in that layer
  memory.kv_device_mib    MiB: VRAM of the KV (its layers kept there, and the slot)
  memory.kv_host_mib      MiB: the host-memory layers' KV at the prompt's end (the state's dtype)"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from shared.model import Model

KERNELS_SHOWN = 16       # kernels_ms: the costliest only, so that the JSON stays readable


def dense_macs_per_token(model: Model) -> int:
    """Multiply-adds one token costs in every matrix but the routed experts (LM head apart)."""
    total = 0
    for layer in model.layers:
        for name, w in vars(layer).items():
            if hasattr(w, "shape") and len(w.shape) == 2 and not name.endswith("_exps") and name != "ssm_conv1d":
                total += w.shape[0] * w.shape[1]
    return total


def prefill_flops(model: Model, T: int) -> dict[str, float]:
    """fp32 FLOPs (2 a multiply-add) of a T-token prefill of a new sequence, by part
    (logits of its last position only)."""
    from gpu_worker.ops import CHUNK
    cfg = model.config
    attn_keys = T * (T + 1) // 2                                   # causal: keys each query sees
    hv, dk, dv, n = cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim, min(T, CHUNK)
    gdn_per_head = n * dk + n / 2 * (dk + dv) + 3 * dk * dv + n / 2 * dv   # chunked form, per token
    return {
        "dense": 2.0 * T * dense_macs_per_token(model),
        "experts": 2.0 * T * cfg.n_expert_used * 3 * cfg.n_ff_exp * cfg.n_embd * cfg.n_layer,
        "attention": 2.0 * 2 * len(cfg.attention_layers) * cfg.n_head * cfg.head_dim * attn_keys,
        "gdn": 2.0 * T * hv * len(cfg.gdn_layers) * gdn_per_head,
        "lm_head": 2.0 * cfg.n_vocab * cfg.n_embd,
    }


def copy_gbps(device, nbytes: int, pinned: bool, reps: int = 5) -> float:
    """Host-to-device GB/s of `nbytes` copies from page-locked (or ordinary) memory."""
    from gpu_worker.buffers import DeviceArray
    host = device.pagelocked_empty((nbytes,), np.uint8) if pinned else np.empty(nbytes, np.uint8)
    host[:] = 1
    dst, stream = DeviceArray(device, (nbytes,), np.uint8), device.stream("copy")
    best = float("inf")
    for _ in range(reps):
        a, b = device.event(), device.event()
        a.record(stream)
        device.memcpy_htod_async(int(dst), host, stream)
        b.record(stream)
        b.synchronize()
        best = min(best, b.time_since(a) / 1000)
    dst.free()
    return nbytes / best / 1e9


# Kernel families: the FLOPs of prefill_flops' parts over the time of their kernels
FAMILIES = {"dense": (("gemm_",), ("dense", "lm_head")), "experts": (("moe_gateup_", "moe_down_"), ("experts",)),
            "attention": (("attn_",), ("attention",)), "gdn": (("gdn_chunk_", "gdn_recurrent"), ("gdn",))}


def kernel_families(by_kernel: dict[str, float], flops: dict[str, float], fma: float) -> dict:
    """Each kernel family's milliseconds, achieved TFLOP/s and fraction of the FMA rate."""
    out = {}
    for family, (prefixes, parts) in FAMILIES.items():
        ms = sum(v for k, v in by_kernel.items() if k.startswith(prefixes))
        if ms > 0:
            tflops = sum(flops[p] for p in parts) / (ms / 1000) / 1e12
            out[family] = {"ms": round(ms, 2), "tflops": round(tflops, 2), "fraction_of_fma": round(tflops / fma, 3)}
    return out


def timed_prefills(engine, tokens: list[int], reps: int) -> tuple[list[float], list[int], dict]:
    """Seconds and expert bytes copied of each of `reps` prefills of a new sequence, and the
    host's time by part of the last."""
    times, copied = [], []
    for _ in range(reps):
        before = engine.experts.copied_bytes
        state = engine.new_state()
        t = time.perf_counter()
        engine.prefill(tokens, state)
        times.append(time.perf_counter() - t)
        copied.append(engine.experts.copied_bytes - before)
    return times, copied, engine.last_timing


def phases_ms(engine, tokens: list[int]) -> dict[str, float]:
    """One more prefill timed by phase with events on the compute stream, costliest first."""
    from gpu_worker.profile import PhaseTimer
    engine.profile = PhaseTimer(engine.device, engine.ops.stream)
    engine.prefill(tokens, engine.new_state())
    phases = engine.profile.milliseconds()
    engine.profile = None
    return _costliest(phases)


def by_kernel_ms(engine, tokens: list[int]) -> dict[str, float]:
    """One more prefill timed kernel by kernel (every kernel: kernels_ms shows the costliest)."""
    from gpu_worker.engine import IDLE
    from gpu_worker.profile import PhaseTimer
    engine.ops.k.timer = PhaseTimer(engine.device, engine.ops.stream)
    engine.prefill(tokens, engine.new_state())
    engine.ops.k.timer.mark("end")
    by_kernel = engine.ops.k.timer.milliseconds()
    by_kernel.pop(IDLE, None)              # between passes and after the last: the host's time, no kernel's
    engine.ops.k.timer = None
    return by_kernel


def _costliest(ms: dict[str, float], n: int | None = None) -> dict[str, float]:
    return {k: round(v, 2) for k, v in sorted(ms.items(), key=lambda kv: -kv[1])[:n]}


def floor(streamed: int, pinned_gbps: float, flops: dict[str, float], tflops: float) -> dict[str, float]:
    """The copy time, the compute time and the larger of the two (unrounded)."""
    out = {"copy_s": streamed / (pinned_gbps * 1e9), "compute_s": sum(flops.values()) / (tflops * 1e12)}
    out["floor_s"] = max(out.values())
    return out


def memory(engine, positions: int) -> dict:
    """The engine's memory plan, for a prompt of `positions` positions."""
    from shared.state import kv_dtype
    plan = engine.plan
    host_kv = 2 * engine.cfg.n_head_kv * engine.cfg.head_dim * kv_dtype(engine.kv_cache_dtype).itemsize * positions
    return {"gpu_budget_mib": plan.budget >> 20, "gpu_planned_mib": plan.total >> 20,
            "resident_expert_layers": plan.resident_layers, "streamed_expert_layers": plan.streamed_layers,
            "host_expert_mib": engine.experts.host_bytes >> 20, "layer_mib": round(plan.layer_bytes / 2**20, 1),
            "kv_placement": plan.kv_placement(), "kv_device_layers": plan.kv_layers,
            "kv_host_layers": plan.spilled_kv_layers, "kv_device_mib": round(plan.kv / 2**20, 3),
            "kv_host_mib": round(plan.spilled_kv_layers * host_kv / 2**20, 3)}


def run(model_path: str, prompt_tokens: int = 947, gpu_mem: int | None = None, gpu: int = 0, reps: int = 3,
        chunk: int | None = None, pinned: bool = True, overlap: bool = True, resident: bool = True,
        lm_head: str = "gpu", ring_slots: int = 2, seed: int = 0, probe_mb: int = 1024,
        kv_layers: int | None = None, profile: bool = True) -> dict:
    from bench.gpu_kernels import fma_tflops
    from gpu_worker.engine import GPUEngine
    from shared.builtin import resolve_model

    model = Model(resolve_model(model_path))
    t0 = time.perf_counter()
    engine = GPUEngine(model, gpu_mem=gpu_mem, gpu=gpu, max_pass_tokens=chunk, pinned=pinned, overlap=overlap,
                       resident=resident, lm_head=lm_head, ring_slots=ring_slots, max_kv_layers=kv_layers)
    setup_s = time.perf_counter() - t0
    tokens = np.random.default_rng(seed).integers(0, model.config.n_vocab, prompt_tokens).tolist()
    engine.prefill(tokens, engine.new_state())                       # warm: module, caches, first copies
    times, copied, host = timed_prefills(engine, tokens, reps)
    phases = phases_ms(engine, tokens) if profile else None
    by_kernel = by_kernel_ms(engine, tokens) if profile else None
    probe_bytes = min(probe_mb << 20, 4 * engine.plan.layer_bytes)
    pinned_gbps = copy_gbps(engine.device, probe_bytes, True)
    pageable_gbps = copy_gbps(engine.device, probe_bytes, False)
    tflops = fma_tflops(engine.device, engine.ops.k, engine.ops.stream)
    flops = prefill_flops(model, prompt_tokens)
    prefill_s, streamed = float(np.median(times)), int(np.median(copied))
    bound = floor(streamed, pinned_gbps, flops, tflops)
    out = {
        "model": model_path, "device": engine.device.name, "prompt_tokens": prompt_tokens,
        "switches": {"pinned": pinned, "overlap": overlap, "resident": resident, "lm_head": lm_head,
                     "chunk": chunk, "ring_slots": ring_slots, "kv_layers": kv_layers},
        "prefill_s": round(prefill_s, 4), "prefill_s_min": round(min(times), 4),
        "tok_s": round(prompt_tokens / prefill_s, 1), "passes": -(-prompt_tokens // engine.pass_n),
        "pass_tokens": engine.pass_n,
        "setup_s": round(setup_s, 2),
        "host_s": {k: round(v, 4) for k, v in host.items()},
        "streamed_gb": round(streamed / 1e9, 3),
        "h2d_gbps_during_prefill": round(streamed / prefill_s / 1e9, 1),
        "pinned_h2d_gbps": round(pinned_gbps, 1), "pageable_h2d_gbps": round(pageable_gbps, 1),
        "fp32_fma_tflops": round(tflops, 2), "gflop": round(sum(flops.values()) / 1e9, 3),
        "gflop_by_part": {k: round(v / 1e9, 3) for k, v in flops.items()},
        "achieved_tflops": round(sum(flops.values()) / prefill_s / 1e12, 2),
        "floor": {k: round(v, 4) for k, v in bound.items()},
        "fraction_of_floor": round(bound["floor_s"] / prefill_s, 3),
        "phases_ms": phases,
        "kernels_ms": _costliest(by_kernel, KERNELS_SHOWN) if profile else None,
        "kernel_families": kernel_families(by_kernel, flops, tflops) if profile else None,
        "memory": memory(engine, prompt_tokens),
    }
    engine.close()
    return out


def main(argv=None) -> None:
    """The command line; a FermoeError (a bad --gpu-mem, a budget too small) goes up to
    fermoe.cli.main, which reports it."""
    from shared.options import add_gpu_options, gpu_engine_options
    p = argparse.ArgumentParser(prog="fermoe bench prefill", description=__doc__.splitlines()[0])
    p.add_argument("model", help="GGUF file or built-in model name")
    p.add_argument("--prompt", default="947", help="prompt tokens; several comma-separated (947,8192) run in turn")
    add_gpu_options(p)
    p.add_argument("--reps", type=int, default=3, help="timed prefills (after one warm-up); the median is reported")
    p.add_argument("--chunk", type=int, default=None, help="passes of at most N tokens (default: one pass)")
    p.add_argument("--pageable", action="store_true", help="expert memory not page-locked")
    p.add_argument("--no-overlap", action="store_true", help="expert copies on the compute stream (serial)")
    p.add_argument("--no-resident", action="store_true", help="keep no expert layer in VRAM")
    p.add_argument("--lm-head", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--ring", type=int, default=2, help="expert-layer slots of the copy ring (default 2)")
    p.add_argument("--kv-layers", type=int, default=None,
                   help="keep at most N attention layers' KV in VRAM, the others' in host memory (default: as many as fit)")
    p.add_argument("--no-profile", action="store_true", help="skip the prefills timed by phase and by kernel")
    args = p.parse_args(argv)
    try:
        prompts = [int(x) for x in args.prompt.split(",")]
    except ValueError:
        p.error(f"--prompt {args.prompt!r}: expected comma-separated integers")
    if min(prompts) < 1 or args.reps < 1 or (args.chunk is not None and args.chunk < 1):
        p.error("--prompt, --reps and --chunk must be at least 1")
    if args.kv_layers is not None and args.kv_layers < 0:
        p.error("--kv-layers must be 0 or more")
    gpu = gpu_engine_options(args)
    results = [run(args.model, n, gpu["gpu_mem"], gpu["gpu"], args.reps, args.chunk, not args.pageable,
                   not args.no_overlap, not args.no_resident, args.lm_head, args.ring, kv_layers=args.kv_layers,
                   profile=not args.no_profile) for n in prompts]
    print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
