"""`fermoe bench decode MODEL.gguf`: prefill and decode speed of the native CPU
engine, next to the memory read bandwidth measured in the same run, as JSON.

The decode floor is bytes of weights read per token / read bandwidth: every
token reads the non-expert matrices, the selected experts, the shared expert
and the LM head once. A token also reads and writes each sequence's recurrent
state (the GDN layers' S and conv history) and reads its KV cache: the floor
with those bytes too is floor_with_state_tok_s (a pass of --batch B sequences
reads the weights once and B states and caches).

--batch B decodes B copies of the sequence in one pass per step (what a worker
does with B clients; B = 1 is the matrix-vector path) and reports the aggregate
tok/s too. --context N decodes at position N: the attention layers' KV cache is
extended to N positions of zeros (what they hold does not change the time), to
show what a long context costs on top of the weights. --json-schema FILE then decodes as many
tokens again with and without that schema's token mask, in the same run (bench/grammar_cost.py),
and reports both rates and the slowdown.

foreign_cpu_fraction is the share of the machine's CPU time other processes took during
the timed decode: on a shared machine, figures taken with it above a few hundredths
measure the other load as much as the engine.

JSON keys (a <phase> is one of the native forward's: gdn, attention, moe, lm_head, other):
  model                   the GGUF path or built-in name given
  threads                 the engine's pinned threads (-t, or its default)
  isa                     the kernel set the engine runs (FERMOE_ISA or the best this CPU runs)
  prompt_tokens           tokens of the random prompt (--prompt)
  prefill_s               s: the prompt's forward, after a warm-up prompt of the same length
  prefill_tok_s           tokens/s: prompt_tokens over prefill_s
  prefill_experts_per_layer  distinct experts a MoE block ran during the prefill, the mean over blocks
  prefill_seconds_by_phase  s: the prefill's time by phase of the forward
  prefill_seconds_by_phase.<phase>  s: that phase's
  prefill_attention_gflop GFLOP of the prompt's attention phase: its projections (q and gate, k, v and
      the output, 2 a weight a token) and its products (q.k and the weighted sum of V, every query
      head over its causal positions: 4 x heads x head_dim x T(T+1)/2 a layer, the part that grows
      with the square of the prompt)
  prefill_attention_gflop_s  GFLOP/s: that over the attention phase's time; steady across prompt
      lengths when attention costs its FLOPs, falling when a long KV outgrows the caches
  decode_tokens           timed decode steps (--tokens)
  batch                   sequences decoded together in each step (--batch)
  context                 the position decoding starts at: --context, else the prompt's end
  kv_cache_dtype          the KV cache's element type (--kv-cache-dtype)
  kv_mb_per_token         MB of KV cache a sequence's token reads at `context`
  decode_ms_per_token_median  ms: the median decode step (all `batch` sequences)
  decode_ms_per_token_min  ms: the fastest step
  decode_tok_s            tokens/s of one sequence: 1000 / decode_ms_per_token_median
  decode_tok_s_aggregate  tokens/s of all the batch's sequences: batch x decode_tok_s
  weight_bytes_per_token  bytes of weights a step reads (non-expert matrices, selected and shared
      experts, LM head; the experts at their routed share)
  read_bandwidth_gb_s     GB/s: the engine's threads reading a fresh buffer far larger than the caches
  floor_tok_s             tokens/s: read_bandwidth_gb_s over weight_bytes_per_token, the weights' floor
  fraction_of_floor       decode_tok_s over floor_tok_s
  weights_read_gb_s       GB/s: the same threads reading the mapped weights themselves (their pages)
  fraction_of_weights_read_floor  decode_tok_s x weight_bytes_per_token over weights_read_gb_s
  state_mb_per_token      MB: a sequence's recurrent state (GDN S and conv history), read and written
  floor_with_state_tok_s  tokens/s: the floor with each sequence's state and KV bytes added
  fraction_of_floor_with_state  decode_tok_s over floor_with_state_tok_s
  foreign_cpu_fraction    0 to 1: other processes' share of the machine's CPU time during the timed
      decode (null where there is no /proc/stat)
  sampling_ms_per_token   ms: a draw of the default sampler from the last logits (the decode is greedy)
  decode_breakdown        the timed decode by phase of the forward
  decode_breakdown.<phase>  one phase's share
  decode_breakdown.<phase>.ms_per_token  ms: its time a step
  decode_breakdown.<phase>.weight_mb_per_token  MB of weights it reads a step
  decode_breakdown.<phase>.state_mb_per_token  MB it moves beside the weights, all sequences: GDN
      state read and written, attention's KV read
  decode_breakdown.<phase>.gb_s  GB/s: weights and state over its time (null if it took none)
  decode_breakdown.<phase>.fraction_of_read_bw  gb_s over read_bandwidth_gb_s (null if no time)
  decode_parallel_regions  the thread pool's regions, over a few more steps timed with its statistics on
  decode_parallel_regions.per_token  parallel regions a step runs (0 with one thread: they run inline)
  decode_parallel_regions.ms_per_token  ms: a step's time inside regions
  decode_parallel_regions.outside_ms_per_token  ms: a step's time outside them (the caller alone)
  decode_parallel_regions.outside_ms_by_phase  ms: that time within the forward, by phase
  decode_parallel_regions.outside_ms_by_phase.<phase>  ms: that phase's
  decode_parallel_regions.outside_forward_ms_per_token  ms: a step's time outside the forward
  decode_parallel_regions.thread_busy_fraction  0 to 1: the threads' time in regions spent inside
      tasks (the rest waits at a region's start or end)
  decode_parallel_regions.empty_region_us  us: a region of empty tasks on this pool, the mean
  json_schema             only with --json-schema: the keys of bench.grammar_cost"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from shared.ggml_types import row_nbytes
from shared.model import Model, Weight
from shared.sampling import Sampler, SamplingParams
from shared.state import DEFAULT_KV_DTYPE, kv_bytes_per_position


def _nbytes(w: Weight) -> int:
    return len(w.raw)


def bytes_by_phase(model: Model) -> dict[str, int]:
    """Weight bytes one decoded token reads, by phase of the native forward."""
    cfg = model.config
    phases = {"gdn": 0, "attention": 0, "moe": 0, "lm_head": _nbytes(model.output),
              "other": row_nbytes(model.token_embd.qtype, cfg.n_embd)}
    for layer in model.layers:
        for name, w in vars(layer).items():
            if not isinstance(w, Weight):
                continue
            if name.startswith("ffn_"):
                share = cfg.n_expert_used / cfg.n_expert if name.endswith("_exps") else 1
                phases["moe"] += int(_nbytes(w) * share)
            elif name.endswith("_norm") and name in ("attn_norm", "post_attention_norm"):
                phases["other"] += _nbytes(w)
            else:
                phases["gdn" if layer.kind == "gdn" else "attention"] += _nbytes(w)
    return phases


def bytes_per_token(model: Model) -> int:
    """Weight bytes one decoded token reads (routers and vectors included)."""
    return sum(bytes_by_phase(model).values())


def kv_bytes_per_token(model: Model, context: int, kv_cache_dtype: str = DEFAULT_KV_DTYPE) -> int:
    """Bytes of KV cache one decoded token reads at position `context`."""
    return kv_bytes_per_position(model.config, kv_cache_dtype) * context


def _extend_context(state, context: int) -> None:
    """Move a state to position `context`, its KV cache filled with zeros up to there."""
    if context < state.position:
        raise ValueError(f"--context {context} is shorter than the prompt ({state.position} tokens)")
    state.kv.reserve(context)
    state.kv.filled_to(context)
    state.position = context


def cpu_jiffies(stat_path: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) clock ticks of all the machine's CPUs since boot; None where
    there is no /proc/stat."""
    try:
        with open(stat_path) as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)    # idle and iowait
    return sum(ticks) - idle, sum(ticks)


class ForeignCpu:
    """The share of the machine's CPU time other processes took while open (0 to 1;
    None where unknown): the engine's threads are pinned and meet at every parallel
    region, so a thread preempted by another process stalls them all, and a run on a
    busy machine measures that machine. with ForeignCpu() as f: ...; f.fraction."""

    def __init__(self, stat_path: str = "/proc/stat"):
        self.stat_path, self.fraction = stat_path, None

    @staticmethod
    def _own() -> float:
        t = os.times()
        return (t.user + t.system) * os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self._start, self._own0 = cpu_jiffies(self.stat_path), self._own()
        return self

    def __exit__(self, *exc):
        end = cpu_jiffies(self.stat_path)
        if self._start is None or end is None or end[1] <= self._start[1]:
            return False
        foreign = (end[0] - self._start[0]) - (self._own() - self._own0)
        self.fraction = round(min(1.0, max(0.0, foreign / (end[1] - self._start[1]))), 3)
        return False


STAT_TOKENS = 8         # decode steps timed region by region, after the timed ones
SAMPLE_REPS = 20        # draws of the default sampler from the last logits


def run(model_path: str, threads: int | None = None, prompt_tokens: int = 64, decode_tokens: int = 32,
        seed: int = 0, batch: int = 1, context: int | None = None, kv_cache_dtype: str = DEFAULT_KV_DTYPE,
        json_schema: str | None = None, max_model_len: int | None = None) -> dict:
    from cpu_worker.native_engine import NativeEngine

    from shared.builtin import resolve_model
    model = Model(resolve_model(model_path))     # a GGUF file, or a built-in model's name
    stat_tokens = min(decode_tokens, STAT_TOKENS)
    end = max(prompt_tokens, context or 0) + decode_tokens * (2 if json_schema else 1) + stat_tokens
    schema_text = None
    if json_schema is not None:
        from .grammar_cost import load_schema
        schema_text = load_schema(json_schema)
    limit = max_model_len or model.config.n_ctx_train
    if max_model_len:
        model.extend_context(max_model_len)       # as a worker does under the daemon's --max-model-len
    if end > limit:
        raise ValueError(f"--prompt/--context and --tokens reach position {end}, past "
                         + (f"--max-model-len {limit}" if max_model_len else
                            f"the model's context length of {limit} (--max-model-len takes more, for timing)"))
    engine = NativeEngine(model, threads=threads, kv_cache_dtype=kv_cache_dtype)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.config.n_vocab, prompt_tokens).tolist()

    # Warm up with another prompt of the same length: it maps the pages of (nearly)
    # every expert, so the figures are the steady state of a serving worker, not
    # first-touch page faults.
    warm = rng.integers(0, model.config.n_vocab, prompt_tokens).tolist()
    engine.forward(warm, engine.new_state(), all_logits=False)
    state = engine.new_state()
    engine.experts_per_moe_block(reset=True)
    engine.phase_seconds(reset=True)
    t0 = time.perf_counter()
    logits = engine.forward(prompt, state, all_logits=False)[-1]
    prefill_s = time.perf_counter() - t0
    prefill_experts = engine.experts_per_moe_block(reset=True)
    prefill_phases = {p: round(sec, 3) for p, sec in engine.phase_seconds(reset=True).items()}
    attn_gflop = attention_flops(model.config, prompt_tokens) / 1e9

    states = [state] + [state.copy() for _ in range(batch - 1)]
    for s in states:
        if context is not None:
            _extend_context(s, context)
    rows = np.repeat(logits[None], batch, axis=0)
    context_at = states[0].position

    def step(rows):
        tokens = [int(np.argmax(r)) for r in rows]
        return engine.forward(tokens, state, all_logits=False) if batch == 1 else engine.decode_batch(tokens, states)

    step_s = []
    with ForeignCpu() as foreign:
        for _ in range(decode_tokens):
            t0 = time.perf_counter()
            rows = step(rows)
            step_s.append(time.perf_counter() - t0)
    phase_s = engine.phase_seconds()
    # then a few more steps with the pool's statistics on (timing them costs a clock
    # read per region and worker, so the figures above are taken without)
    engine.region_stats(enable=True, reset=True)
    before = engine.phase_seconds()
    t0 = time.perf_counter()
    for _ in range(stat_tokens):
        rows = step(rows)
    stat_s = time.perf_counter() - t0
    regions = engine.region_stats(enable=False, reset=True)
    stat_phases = {p: sec - before[p] for p, sec in engine.phase_seconds().items()}
    # the caller alone: each phase's time outside its regions, and the step's outside the forward
    serial_ms = {p: round(1000 * (stat_phases[p] - regions["seconds_by_phase"][p]) / stat_tokens, 3)
                 for p in stat_phases}

    sampler, row = Sampler(SamplingParams(seed=0)), rows[0]
    sampler.sample(row)
    t0 = time.perf_counter()
    for _ in range(SAMPLE_REPS):
        sampler.sample(row)
    sample_ms = 1000 * (time.perf_counter() - t0) / SAMPLE_REPS

    constrained = None
    if schema_text is not None:
        from .grammar_cost import compare
        constrained = {"file": json_schema, **compare(engine, model, states, rows, schema_text, decode_tokens, seed)}

    per_token = bytes_per_token(model)
    phase_bytes = bytes_by_phase(model)
    bandwidth = engine.read_bandwidth()
    weights_bandwidth = engine.read_bandwidth(weights=True)
    ms = 1000 * float(np.median(step_s))
    decode_tps = 1000 / ms
    floor_tps = bandwidth / per_token
    state_bytes = 2 * model.config.recurrent_state_bytes    # read and written
    kv_bytes = kv_bytes_per_token(model, context_at, kv_cache_dtype)
    # beside the weights, what a phase moves for each sequence: the GDN's recurrent state
    # (read and written), attention's KV (read)
    moved = {p: phase_bytes[p] + batch * {"gdn": state_bytes, "attention": kv_bytes}.get(p, 0) for p in phase_s}
    breakdown = {p: {"ms_per_token": round(1000 * phase_s[p] / decode_tokens, 2),
                     "weight_mb_per_token": round(phase_bytes[p] / 1e6, 1),
                     "state_mb_per_token": round((moved[p] - phase_bytes[p]) / 1e6, 1),
                     "gb_s": round(moved[p] * decode_tokens / phase_s[p] / 1e9, 2) if phase_s[p] else None,
                     "fraction_of_read_bw": round(moved[p] * decode_tokens / phase_s[p] / bandwidth, 3)
                     if phase_s[p] else None}
                 for p in phase_s}
    floor_state_tps = bandwidth / (per_token + batch * (state_bytes + kv_bytes))
    return {
        "model": model_path,
        "threads": engine.threads,
        "isa": engine.isa,
        "prompt_tokens": prompt_tokens,
        "prefill_s": round(prefill_s, 3),
        "prefill_tok_s": round(prompt_tokens / prefill_s, 2),
        "prefill_experts_per_layer": round(prefill_experts, 1),
        "prefill_seconds_by_phase": prefill_phases,
        "prefill_attention_gflop": round(attn_gflop, 6),
        "prefill_attention_gflop_s": round(attn_gflop / prefill_phases["attention"], 2)
        if prefill_phases.get("attention") else None,
        "decode_tokens": decode_tokens,
        "batch": batch,
        "context": context_at,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_mb_per_token": round(kv_bytes / 1e6, 1),
        "decode_ms_per_token_median": round(ms, 2),
        "decode_ms_per_token_min": round(1000 * min(step_s), 2),
        "decode_tok_s": round(decode_tps, 2),
        "decode_tok_s_aggregate": round(batch * decode_tps, 2),
        "weight_bytes_per_token": per_token,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "floor_tok_s": round(floor_tps, 2),
        "fraction_of_floor": round(decode_tps / floor_tps, 3),
        "weights_read_gb_s": round(weights_bandwidth / 1e9, 2),
        "fraction_of_weights_read_floor": round(decode_tps * per_token / weights_bandwidth, 3),
        "state_mb_per_token": round(state_bytes / 1e6, 1),
        "floor_with_state_tok_s": round(floor_state_tps, 2),
        "fraction_of_floor_with_state": round(decode_tps / floor_state_tps, 3),
        "foreign_cpu_fraction": foreign.fraction,     # other processes' share of the CPUs while decoding
        "sampling_ms_per_token": round(sample_ms, 3),      # the default sampler (the decode above is greedy)
        "decode_breakdown": breakdown,
        "decode_parallel_regions": {       # the thread pool's share of a token
            "per_token": round(regions["regions"] / stat_tokens, 1),
            "ms_per_token": round(1000 * regions["seconds"] / stat_tokens, 2),
            "outside_ms_per_token": round(1000 * (stat_s - regions["seconds"]) / stat_tokens, 2),
            "outside_ms_by_phase": serial_ms,
            "outside_forward_ms_per_token": round(1000 * (stat_s - sum(stat_phases.values())) / stat_tokens, 3),
            "thread_busy_fraction": round(regions["busy_fraction"], 3),
            "empty_region_us": round(1e6 * engine.region_overhead(), 2),
        },
        **({"json_schema": constrained} if constrained else {}),
    }


def attention_flops(cfg, T: int) -> int:
    """FLOPs (2 a multiply-add) of a T-token prompt's attention layers from position 0:
    the projections and the products over the causal positions."""
    width, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    projections = 2 * T * cfg.n_embd * (2 * width + 2 * kv + width)
    products = 4 * cfg.n_head * cfg.head_dim * T * (T + 1) // 2
    return len(cfg.attention_layers) * (projections + products)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="fermoe bench decode")
    p.add_argument("model")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--prompt", default="64",
                   help="prompt tokens (default 64); several comma-separated (8192,32768) run in turn")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens (default 32)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together in one pass (default 1)")
    p.add_argument("--context", type=int, default=None,
                   help="decode at this position, the KV cache extended with zeros (default: right after the prompt)")
    from shared.options import add_kv_cache_dtype
    add_kv_cache_dtype(p)
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="also decode with this JSON schema's token mask and without it, and report both")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions allowed (default: the model's context length; more is taken, as the daemon "
                        "takes it: the timing holds, the text past it is noise)")
    args = p.parse_args(argv)
    try:
        prompts = [int(x) for x in args.prompt.split(",")]
    except ValueError:
        p.error(f"--prompt {args.prompt!r}: expected comma-separated integers")
    if args.batch < 1 or args.tokens < 1 or min(prompts) < 1:
        p.error("--batch, --tokens and --prompt must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 1:
        p.error(f"--max-model-len {args.max_model_len}: must be at least 1")
    try:
        out = [run(args.model, args.threads, n, args.tokens, batch=args.batch, context=args.context,
                   kv_cache_dtype=args.kv_cache_dtype, json_schema=args.json_schema,
                   max_model_len=args.max_model_len) for n in prompts]
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
