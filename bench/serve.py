"""`fermoe bench serve MODEL.gguf`: the daemon path measured end to end, as JSON.

Time to first token for a prompt cold, repeated (served from the snapshot with
its logits: no prefill) and extended by 16 tokens (resumes from the longest
cached prefix); aggregate decode tokens/s with 1, 2 and 4 concurrent clients (a
worker decodes them in one batched pass a token); and how a running generation
fares while two cold prompts arrive: the gaps between its tokens during their
prefill, and their times to first token; and four cold prompts sent at once (a GPU
worker prefills those waiting behind the first in one batch). The default prompt is
947 tokens, the paper's, so that its cold and repeated times compare with ours
(docs/measurements.md gives both).

JSON keys:
  model                   the GGUF path or built-in name given
  workers                 workers the coordinator reports once ready (a GPU worker waited for)
  prompt_tokens           tokens of the timed prompt (--prompt)
  ttft_cold_s             s: time to first token of a prompt no request has cached
  ttft_repeated_s         s: the same prompt again (its snapshot with its logits: no prefill)
  ttft_extended16_s       s: the prompt with 16 tokens more (resumes from the cached prefix)
  prefill_device          where each was prefilled
  prefill_device.cold     "cpu" or "gpu": the cold prompt
  prefill_device.extended16  the extended one
  cold_prefill_s          s: the cold prompt's prefill itself, as the worker reports it
  cold_rest_s             s: the rest of its time to first token: the hand-over to a CPU worker (its
                          resume from the snapshot) and the first token's sampling
  cached_tokens           prompt tokens served from the cache, as the coordinator reports them
  cached_tokens.cold      of the cold prompt
  cached_tokens.repeated  of the repeated one
  cached_tokens.extended16  of the extended one
  cold_over_repeated      ttft_cold_s over ttft_repeated_s
  workers_detail[]        one object a worker
  workers_detail[].id     the worker's id
  workers_detail[].kind   "cpu" or "gpu"
  workers_detail[].device the device it runs on, as it reports it
  workers_detail[].prefill_tok_s  tokens/s: the prefill rate it reports (the scheduler's estimate)
  aggregate_decode_tok_s.<clients>  tokens/s: decode of 1, 2 and 4 concurrent clients (prompts cached
                          first: the decode phase only), all clients' tokens over the wall time
  decode_device           where those clients were decoded, as their done messages say ("cpu", "hybrid")
  decode_during_prefill   a running generation while cold prompts arrive after its first token
  decode_during_prefill.arriving_prompts  cold prompts that arrive (2)
  decode_during_prefill.prompt_tokens  tokens of each of them (128, or --prompt if fewer)
  decode_during_prefill.running_max_gap_s  s: the longest gap between two of the running
                          generation's tokens until the last arrival's first token
  decode_during_prefill.running_median_gap_s  s: the median of those gaps
  decode_during_prefill.arriving_ttft_s  s: each arriving prompt's time to first token, sorted
  cold_burst              cold prompts sent at once
  cold_burst.prompts      how many (4)
  cold_burst.prompt_tokens  tokens of each (256, or --prompt if fewer)
  cold_burst.last_first_token_s  s: from sending until the last has its first token
  cold_burst.ttft_s       s: each one's time to first token, sorted
  cold_burst.prefill_device  where each was prefilled, sorted
  cold_burst.prefill_batch  the size of the batch each was prefilled in, sorted (0: not batched)
  decode_at_prompt        one client decoding right after the whole prompt (cached first): a CPU
                          worker's decode at a context of prompt_tokens, beside its floor
  decode_at_prompt.context  the position the decode starts at
  decode_at_prompt.tok_s  tokens/s: --tokens tokens after the first, over their wall time
  decode_at_prompt.weight_mb_per_token  MB of weights a token reads (bench decode's count)
  decode_at_prompt.kv_mb_per_token  MB of KV cache a token reads at that context (the daemon's KV type)
  decode_at_prompt.read_bandwidth_gb_s  GB/s: the first CPU worker's thread count reading a buffer far
                          larger than the caches, pinned to the first node's cores, measured here
  decode_at_prompt.floor_tok_s  tokens/s: that bandwidth over the weight and KV bytes of a token
  decode_at_prompt.fraction_of_floor  tok_s over floor_tok_s
  host_memory             every process of the daemon at its fullest, pages they share counted
                          once: the keys of bench.host_memory"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time

import numpy as np

from bench.host_memory import TreeMemory
from coordinator.client import Client
from coordinator.launcher import free_port, last_words, read_log, start_coordinator, stop_coordinator
from shared.errors import FermoeError


def ttft(client: Client, tokens: list[int], max_tokens: int = 1) -> tuple[float, dict]:
    t0 = time.perf_counter()
    first, done = None, None
    for msg in client.generate(tokens=tokens, max_tokens=max_tokens, temperature=0.0):
        if first is None:
            first = time.perf_counter() - t0
        done = msg
    return first, {"cached_prompt_tokens": done.cached_prompt_tokens, "prefill_ms": done.prefill_ms,
                   "prefill_device": done.prefill_device, "prefill_batch": done.prefill_batch}


def cold_burst(addr: str, vocab_hi: int, prompts: int = 4, tokens: int = 256) -> dict:
    """`prompts` cold prompts of `tokens` tokens sent at once: the time until the last has
    its first token, where each was prefilled and in how large a batch."""
    out = [None] * prompts

    def one(i):
        cold = np.random.default_rng(200 + i).integers(10, vocab_hi, tokens).tolist()
        with Client(addr) as c:
            out[i] = ttft(c, cold)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(prompts)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"prompts": prompts, "prompt_tokens": tokens, "last_first_token_s": round(time.perf_counter() - t0, 3),
            "ttft_s": sorted(round(t, 3) for t, _ in out),
            "prefill_device": sorted(str(info["prefill_device"]) for _, info in out),
            "prefill_batch": sorted(info["prefill_batch"] for _, info in out)}


def aggregate(addr: str, clients: int, prompt: list[int], tokens: int) -> tuple[float, set[str]]:
    """Decode tokens/s of `clients` concurrent requests, and where they were decoded. Their
    prompts are cached first, so the figure is the decode phase, not prefill."""
    counts, devices = [0] * clients, set()
    with Client(addr) as c:
        for i in range(clients):
            list(c.generate(tokens=prompt + [i], max_tokens=1, temperature=0.0))

    def one(i):
        with Client(addr) as c:
            for msg in c.generate(tokens=prompt + [i], max_tokens=tokens, temperature=0.8, seed=i):
                counts[i] += hasattr(msg, "text")
                if hasattr(msg, "decode_device"):
                    devices.add(str(msg.decode_device))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0), devices


def aggregate_decode_tok_s(addr: str, prompt: list[int], tokens: int) -> tuple[dict[int, float], list[str]]:
    """Aggregate decode tokens/s with 1, 2 and 4 concurrent clients, and where they were decoded."""
    rates, devices = {}, set()
    for n in (1, 2, 4):
        rate, where = aggregate(addr, n, prompt, tokens)
        rates[n] = round(rate, 2)
        devices |= where
    return rates, sorted(devices)


def first_tokens(client: Client, prompt: list[int], vocab_hi: int) -> dict:
    """Times to first token of `prompt` cold, repeated and extended by 16 tokens; where each
    was prefilled and how much of it was cached."""
    # an uncached prompt of the same size first: the workers' first touches of memory
    # (snapshot slots, KV pages, a GPU plan for that size) are not in the cold figure
    ttft(client, np.random.default_rng(1).integers(10, vocab_hi, len(prompt)).tolist())
    cold, cold_info = ttft(client, prompt)
    repeat, repeat_info = ttft(client, prompt)
    extended, ext_info = ttft(client, prompt + list(range(20, 36)))
    return {
        "ttft_cold_s": round(cold, 3), "ttft_repeated_s": round(repeat, 3),
        "ttft_extended16_s": round(extended, 3),
        "prefill_device": {"cold": cold_info["prefill_device"], "extended16": ext_info["prefill_device"]},
        "cold_prefill_s": round(cold_info["prefill_ms"] / 1000, 3),
        "cold_rest_s": round(cold - cold_info["prefill_ms"] / 1000, 3),
        "cached_tokens": {"cold": cold_info["cached_prompt_tokens"], "repeated": repeat_info["cached_prompt_tokens"],
                          "extended16": ext_info["cached_prompt_tokens"]},
        "cold_over_repeated": round(cold / repeat, 1),
    }


def decode_at_prompt(addr: str, prompt: list[int], tokens: int, model, threads: int, kv_dtype: str) -> dict:
    """One client's decode right after `prompt` (already cached), and its floor with the
    KV bytes a token reads at that context."""
    from bench.decode import bytes_per_token, kv_bytes_per_token
    import native
    from shared.topology import default_cpus
    stamps = []
    with Client(addr) as c:
        for msg in c.generate(tokens=prompt, max_tokens=tokens + 1, temperature=0.0, ignore_eos=True):
            if hasattr(msg, "text"):
                stamps.append(time.perf_counter())
    tok_s = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    weights, kv = bytes_per_token(model), kv_bytes_per_token(model, len(prompt), kv_dtype)
    with native.Pool(default_cpus()[:threads]) as pool:
        gbps = pool.read_gbps(np.ones(1 << 30, np.uint8))
    floor = gbps * 1e9 / (weights + kv)
    return {"context": len(prompt), "tok_s": round(tok_s, 2), "weight_mb_per_token": round(weights / 1e6, 1),
            "kv_mb_per_token": round(kv / 1e6, 3), "read_bandwidth_gb_s": round(gbps, 2),
            "floor_tok_s": round(floor, 2), "fraction_of_floor": round(tok_s / floor, 3)}


def workers_detail(status) -> list[dict]:
    return [{"id": w.worker_id, "kind": w.kind, "device": w.device, "prefill_tok_s": w.prefill_tok_s}
            for w in status.workers]


def decode_during_prefill(addr: str, prompt: list[int], vocab_hi: int, cold_tokens: int = 128, arrivals: int = 2) -> dict:
    """A generation runs; `arrivals` cold prompts of cold_tokens come in after its first
    token. Its inter-token gaps until their first tokens, and their times to first token."""
    with Client(addr) as c:
        list(c.generate(tokens=prompt, max_tokens=1, temperature=0.0))       # cache its prompt
    stamps, ttfts, started = [], [], threading.Event()

    def running():
        with Client(addr) as c:
            for msg in c.generate(tokens=prompt, max_tokens=400, temperature=0.8, seed=1, ignore_eos=True):
                stamps.append(time.perf_counter())
                started.set()
                if len(ttfts) == arrivals and stamps[-1] > max(t for t, _ in ttfts) + 1.0:
                    break

    def arriving(i):
        started.wait()
        cold = np.random.default_rng(100 + i).integers(10, vocab_hi, cold_tokens).tolist()
        with Client(addr) as c:
            t0 = time.perf_counter()
            for _ in c.generate(tokens=cold, max_tokens=1, temperature=0.0):
                ttfts.append((time.perf_counter(), time.perf_counter() - t0))
                break

    threads = [threading.Thread(target=running)] + [threading.Thread(target=arriving, args=(i,)) for i in range(arrivals)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = max(t for t, _ in ttfts)
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if a < end]
    return {"arriving_prompts": arrivals, "prompt_tokens": cold_tokens,
            "running_max_gap_s": round(max(gaps), 5), "running_median_gap_s": round(float(np.median(gaps)), 5),
            "arriving_ttft_s": sorted(round(t, 2) for _, t in ttfts)}


def run(model: str, prompt_tokens: int = 947, decode_tokens: int = 32, extra: list[str] = (),
        log_path: str | None = None) -> dict:
    addr = f"tcp://127.0.0.1:{free_port()}"
    log = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")
    daemon = start_coordinator(model, addr, extra, log)
    memory = TreeMemory(daemon.pid)
    memory.start()
    try:
        with Client(addr, timeout_s=3600) as c:
            try:
                status = c.wait_ready(600, alive=lambda: daemon.poll() is None)
            except FermoeError as e:            # say why: the coordinator's own last words
                last = last_words(log)
                raise FermoeError(f"{e}: {last}" if last else str(e)) from None
            if "started gpu worker" in read_log(log):   # they take longer to join: they time a prompt first
                status = _wait_for_gpu(c, daemon, log)
            from shared.builtin import resolve_model
            from shared.model import Model
            loaded = Model(resolve_model(model))
            vocab_hi = min(1000, loaded.config.n_vocab)
            prompt = np.random.default_rng(0).integers(10, vocab_hi, prompt_tokens).tolist()
            first = first_tokens(c, prompt, vocab_hi)
            cpu = [w for w in status.workers if w.kind == "cpu"]
            at_prompt = decode_at_prompt(addr, prompt, decode_tokens, loaded, cpu[0].threads if cpu else 1,
                                         _kv_dtype(extra))
            short = prompt[:32]
            rates, decoded_on = aggregate_decode_tok_s(addr, short, decode_tokens)
            # a short --prompt (a test's) keeps the arriving prompts short too
            during = decode_during_prefill(addr, short, vocab_hi, cold_tokens=min(128, prompt_tokens))
            together = cold_burst(addr, vocab_hi, tokens=min(256, prompt_tokens))
        return {"model": model, "workers": len(status.workers), "prompt_tokens": prompt_tokens, **first,
                "workers_detail": workers_detail(status), "decode_at_prompt": at_prompt,
                "aggregate_decode_tok_s": rates, "decode_device": decoded_on,
                "decode_during_prefill": during, "cold_burst": together, "host_memory": memory.stop()}
    finally:
        memory.stop()
        stop_coordinator(daemon)
        log.close()


def _kv_dtype(options: list[str]) -> str:
    """The --kv-cache-dtype passed on to the daemon, or its default."""
    from shared.state import DEFAULT_KV_DTYPE
    for i, opt in enumerate(options):
        if opt.startswith("--kv-cache-dtype="):
            return opt.split("=", 1)[1]
        if opt == "--kv-cache-dtype" and i + 1 < len(options):
            return options[i + 1]
    return DEFAULT_KV_DTYPE


def _wait_for_gpu(client: Client, daemon, log):
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = client.status()
        if any(w.kind == "gpu" and w.alive for w in status.workers):
            return status
        if daemon.poll() is not None:
            break
        time.sleep(0.2)
    raise FermoeError(f"no GPU worker joined: {last_words(log)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fermoe bench serve")
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=947, help="prompt tokens (default 947, the paper's)")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per client (default 32)")
    p.add_argument("--log", default=None, help="write the coordinator's log here")
    args, daemon_options = p.parse_known_args(argv)      # the rest goes to the coordinator
    if args.prompt < 1 or args.tokens < 1:
        p.error("--prompt and --tokens must be at least 1")
    print(json.dumps(run(args.model, args.prompt, args.tokens, daemon_options, args.log), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
