"""`fermoe bench hybrid MODEL.gguf`: decode with the dense part on the GPU and the routed
experts on the CPU (gpu_worker/hybrid.py) beside the CPU-only decode, in one run, as JSON.

A random prompt is prefilled once on the GPU; copies of its state then decode --tokens
greedy steps (--batch copies together) three ways, one after the other: on the CPU engine
alone (the paper's split), in the hybrid with the routed experts computed in this process
(`inline`: the CPU engine's W4A8 kernels, no hand-over between processes) and in the hybrid
with them in an expert server process across the shared-memory mailbox (`process`: what a
GPU worker and a CPU worker would do). The CPU side of each runs on the same threads.

The expert layers the GPU engine's memory plan keeps resident in VRAM run on the GPU in the
hybrid (all of them where the whole model fits); --no-gpu-experts sends every layer's to the
CPU (the ablation); --hot-experts N keeps each streamed layer's N most routed experts in VRAM
too (chosen again every 256 tokens) and runs their choices on the GPU. The hybrid's CPU share of a token is the other layers' routed experts'
weights (k of the experts of each): routed_floor_ms is their bytes over the CPU threads'
read bandwidth measured in the same run, what a step's CPU part cannot beat.

JSON keys:
  model, device              the GGUF path or built-in name; the GPU's name
  threads                    the CPU engine's and the expert server's threads (-t, or the default)
  gpu_expert_layers          the MoE layers whose routed experts the hybrid runs on the GPU
  prompt_tokens, decode_tokens, batch   the options
  <way>                      cpu, hybrid_inline, hybrid_process (each only when run: --ways)
  <way>.ms_per_token_median  ms: the median step (all `batch` sequences)
  <way>.tok_s                tokens/s of one sequence: 1000 / ms_per_token_median
  <way>.tok_s_aggregate      tokens/s of the batch: batch x tok_s
  <way>.tokens_agree         hybrid ways: leading greedy tokens equal to the CPU-only decode's
      (the dense part in fp32 here, W4A8 there: a near tie may go the other way)
  <way>.hops_per_token       hybrid ways: hand-overs a step (one a MoE layer)
  <way>.gpu_choices_per_token  hybrid ways: expert choices a step ran on the GPU as hot experts
      (--hot-experts; the warm-up's steps count the routing they are chosen by)
  <way>.routing_ms_per_token hybrid ways: the host's time a step in the hand-overs: down (the GPU's
      layer up to its router, then the rows and choices copied to page-locked memory), experts
      (the CPU's sum, what of it the GPU's shared expert did not hide), up (the sum queued back)
  <way>.routing_ms_per_token.<part>  ms
  speedup_<way>              hybrid ways: cpu's ms_per_token_median over this way's
  routed_mb_per_token        MB: the routed experts' weights one token reads on the CPU in the hybrid
  cpu_read_gb_s              GB/s: the CPU threads reading a buffer far larger than the caches
  routed_floor_ms            ms: routed_mb_per_token over cpu_read_gb_s
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from shared.model import Model, Weight

WAYS = ("cpu", "hybrid_inline", "hybrid_process")


def routed_bytes_per_token(model: Model, skip=()) -> int:
    """Weight bytes of the k routed experts each MoE layer (but those in `skip`) runs for one token."""
    cfg, total = model.config, 0
    for L, layer in enumerate(model.layers):
        if L in skip:
            continue
        for name, w in vars(layer).items():
            if isinstance(w, Weight) and name.endswith("_exps"):
                total += len(w.raw) * cfg.n_expert_used // cfg.n_expert
    return total


def greedy_steps(engine, states, logits: np.ndarray, steps: int) -> tuple[list[float], list[int]]:
    """`steps` greedy steps of every state together; the step times and the first state's tokens."""
    rows, times, tokens = logits, [], []
    for _ in range(steps):
        chosen = [int(np.argmax(r)) for r in rows]
        tokens.append(chosen[0])
        t0 = time.perf_counter()
        rows = (engine.forward(chosen, states[0], all_logits=False) if len(states) == 1
                else engine.decode_batch(chosen, states))
        times.append(time.perf_counter() - t0)
    return times, tokens


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(model_path: str, prompt_tokens: int = 64, decode_tokens: int = 32, batch: int = 1,
        threads: int | None = None, gpu_mem: int | None = None, gpu: int = 0, ways=WAYS, seed: int = 0,
        gpu_experts: bool = True, hot_experts: int = 0) -> dict:
    from cpu_worker.expert_server import spawn_expert_server, stop_expert_server
    from cpu_worker.native_engine import NativeEngine
    from gpu_worker.engine import GPUEngine
    from gpu_worker.hybrid import HybridEngine
    from shared.builtin import resolve_model

    path = resolve_model(model_path)
    model = Model(path)
    cpu = NativeEngine(model, threads=threads)
    engine = GPUEngine(model, gpu_mem=gpu_mem, gpu=gpu)
    prompt = np.random.default_rng(seed).integers(0, model.config.n_vocab, prompt_tokens).tolist()
    start = engine.new_state()
    logits = engine.forward(prompt, start, all_logits=False)[-1]
    first = np.repeat(logits[None], batch, axis=0)

    def states():
        return [start.copy() for _ in range(batch)]

    out = {"model": model_path, "device": engine.device.name, "threads": cpu.threads,
           "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "batch": batch}
    greedy_steps(cpu, states(), first, 2)                  # warm: the experts' pages, the pool
    times, want = greedy_steps(cpu, states(), first, decode_tokens)
    results = {"cpu": (times, want, None)}
    for way in ways:
        if way == "cpu":
            continue
        proc = client = None
        if way == "hybrid_process":
            proc, client = spawn_expert_server(path, threads=cpu.threads)
            routed = client          # submit, then collect after the shared expert is queued
        else:
            routed = cpu.routed_experts
        try:
            hybrid = HybridEngine(engine, routed, max_batch=max(batch, 1), gpu_experts=gpu_experts,
                                  hot_experts=hot_experts)
            warm = states()
            greedy_steps(hybrid, warm, first, 2)
            for s in warm:
                hybrid.release(s)
            hybrid.routing.seconds = dict.fromkeys(hybrid.routing.seconds, 0.0)
            hybrid.routing.hops = hybrid.routing.on_gpu_choices = 0
            run_states = states()
            times, got = greedy_steps(hybrid, run_states, first, decode_tokens)
            results[way] = (times, got, hybrid.routing)
            hybrid.close()
        finally:
            if proc is not None:
                stop_expert_server(proc, client)
    cpu_ms = 1000 * float(np.median(results["cpu"][0]))
    for way, (times, tokens, routing) in results.items():
        ms = 1000 * float(np.median(times))
        entry = {"ms_per_token_median": round(ms, 3), "tok_s": round(1000 / ms, 2),
                 "tok_s_aggregate": round(batch * 1000 / ms, 2)}
        if routing is not None:
            entry["tokens_agree"] = _agree(tokens, want)
            entry["hops_per_token"] = round(routing.hops / decode_tokens, 1)
            entry["gpu_choices_per_token"] = round(routing.on_gpu_choices / decode_tokens, 2)
            entry["routing_ms_per_token"] = {k: round(1000 * v / decode_tokens, 3) for k, v in routing.seconds.items()}
            out[f"speedup_{way}"] = round(cpu_ms / ms, 3)
        out[way] = entry
    on_gpu = sorted(engine.experts.resident) if gpu_experts else []
    out["gpu_expert_layers"] = on_gpu
    routed = routed_bytes_per_token(model, skip=on_gpu)
    bandwidth = cpu.read_bandwidth()
    out["routed_mb_per_token"] = round(routed / 1e6, 2)
    out["cpu_read_gb_s"] = round(bandwidth / 1e9, 2)
    out["routed_floor_ms"] = round(1000 * routed / bandwidth, 3)
    engine.close()
    cpu.close()
    return out


def main(argv=None) -> None:
    from shared.options import add_gpu_options, gpu_engine_options
    p = argparse.ArgumentParser(prog="fermoe bench hybrid", description=__doc__.splitlines()[0])
    p.add_argument("model", help="GGUF file or built-in model name")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens (default 32)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--ways", default=",".join(WAYS), help=f"which to run, comma-separated (default {','.join(WAYS)})")
    p.add_argument("--no-gpu-experts", action="store_true",
                   help="every layer's routed experts on the CPU, even those resident in VRAM")
    p.add_argument("--hot-experts", type=int, default=0,
                   help="keep each streamed layer's N most routed experts in VRAM and run them there")
    add_gpu_options(p)
    args = p.parse_args(argv)
    ways = args.ways.split(",")
    if any(w not in WAYS for w in ways):
        p.error(f"--ways {args.ways!r}: choose from {', '.join(WAYS)}")
    if min(args.prompt, args.tokens, args.batch) < 1 or args.hot_experts < 0:
        p.error("--prompt, --tokens and --batch must be at least 1, --hot-experts at least 0")
    gpu = gpu_engine_options(args)
    print(json.dumps(run(args.model, args.prompt, args.tokens, args.batch, args.threads, gpu["gpu_mem"], gpu["gpu"],
                         ways, gpu_experts=not args.no_gpu_experts, hot_experts=args.hot_experts), indent=2))
