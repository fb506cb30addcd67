"""`fermoe bench http [MODEL]`: the HTTP front end measured end to end, as JSON.

A coordinator started with --http on free loopback ports serves streamed
/v1/completions of cold prompts to 1, 8 and 32 concurrent clients (each a keep-alive connection
sending its share of the requests one after another): requests/s, generated tokens/s and the
time to first token's percentiles. Then the HTTP path's added latency against the
ZeroMQ client in the same run: one-token requests on a cached prompt, the two
paths alternated pair by pair, each timed from sending to the first token.
Clients, server, coordinator and worker share this machine's cores.

With --soak MINUTES it runs bench/soak.py's mixed load instead and reports each
server process's resident memory over the time (its JSON keys are listed there).

JSON keys:
  model                   the GGUF path or built-in name given
  prompt_tokens           tokens of each request's prompt (--prompt)
  max_tokens              tokens each request generates (--tokens; ignore_eos)
  concurrency.<clients>   the load with 1, 8 and 32 concurrent clients
  concurrency.<clients>.requests  requests sent: --requests shared out, each client's share rounded up
  concurrency.<clients>.requests_per_s  requests/s over the wall time of all of them
  concurrency.<clients>.tokens_per_s  generated tokens/s (the usage chunks' counts) over that time
  concurrency.<clients>.ttft_ms  ms: time to first token's percentiles over the requests
  concurrency.<clients>.ttft_ms.p50  the median
  concurrency.<clients>.ttft_ms.p90  the 90th percentile
  concurrency.<clients>.ttft_ms.p99  the 99th percentile
  added_latency_vs_zmq    one-token requests on a cached prompt, HTTP and ZeroMQ alternated pair by pair
  added_latency_vs_zmq.pairs  pairs timed (--pairs, after 8 to warm both paths)
  added_latency_vs_zmq.http_ttft_median_ms  ms: the HTTP side's median, sending to the first token
  added_latency_vs_zmq.zmq_ttft_median_ms  ms: the ZeroMQ client's
  added_latency_vs_zmq.added_median_ms  ms: the median of the pairs' differences (HTTP minus ZeroMQ)
  added_latency_vs_zmq.target_ms  ms: the most the HTTP path should add (ADDED_LATENCY_TARGET_MS)
  added_latency_vs_zmq.within_target  bool: added_median_ms at most target_ms"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time

import numpy as np

from coordinator.client import Client
from coordinator.launcher import free_port, last_words, start_coordinator, stop_coordinator
from shared.errors import FermoeError

try:
    import httpx
except ImportError:                  # a test extra: the server itself does not need it
    httpx = None

CONCURRENCY = (1, 8, 32)
ADDED_LATENCY_TARGET_MS = 5.0        # the front end is a thin layer: a few ms is all it may add to a token


def _percentiles(values_s: list[float]) -> dict:
    ms = np.asarray(values_s) * 1000
    return {f"p{q}": round(float(np.percentile(ms, q)), 2) for q in (50, 90, 99)}


async def _stream(http, body: dict) -> tuple[float, int]:
    """(time to the first token, generated tokens from the usage chunk) of one streamed completion."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    t0, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise FermoeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens


async def _load(url: str, clients: int, requests: int, prompts: list[list[int]], max_tokens: int) -> dict:
    ttfts, tokens = [], [0]
    per_client = -(-requests // clients)

    async def client(i, http):
        for j in range(per_client):
            body = {"prompt": prompts[(i * per_client + j) % len(prompts)], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.8, "seed": j}
            first, n = await _stream(http, body)
            ttfts.append(first)
            tokens[0] += n

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall = time.perf_counter() - t0
    n = clients * per_client
    return {"requests": n, "requests_per_s": round(n / wall, 2), "tokens_per_s": round(tokens[0] / wall, 1),
            "ttft_ms": _percentiles(ttfts)}


def concurrency(url: str, prompt_tokens: int, max_tokens: int, requests: int) -> dict[str, dict]:
    """The streamed load at each of CONCURRENCY, after a warm-up of every process."""
    def cold(seed):                   # prompts no earlier request has cached
        rng = np.random.default_rng(seed)
        return [rng.integers(10, 500, prompt_tokens).tolist() for _ in range(requests)]
    asyncio.run(_load(url, 4, 8, cold(0), max_tokens))               # warm up every process
    return {str(c): asyncio.run(_load(url, c, requests, cold(c), max_tokens)) for c in CONCURRENCY}


def added_latency_vs_zmq(url: str, addr: str, prompt: list[int], pairs: int) -> dict:
    """HTTP and ZeroMQ one-token requests on the same cached prompt, alternated."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}

    async def http_side(http):
        return (await _stream(http, body))[0]

    def zmq_side(c):
        t0 = time.perf_counter()
        for _ in c.generate(tokens=prompt, max_tokens=1, temperature=0.0, ignore_eos=True):
            return time.perf_counter() - t0

    async def run():
        out = []
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with Client(addr) as c:
                for _ in range(8):                                  # warm both paths and the cache
                    await http_side(http), zmq_side(c)
                for i in range(pairs):
                    if i % 2:
                        h, z = await http_side(http), zmq_side(c)
                    else:
                        z, h = zmq_side(c), await http_side(http)
                    out.append((h, z))
        return out

    measured = np.asarray(asyncio.run(run())) * 1000
    added = float(np.median(measured[:, 0] - measured[:, 1]))
    return {"pairs": pairs, "http_ttft_median_ms": round(float(np.median(measured[:, 0])), 3),
            "zmq_ttft_median_ms": round(float(np.median(measured[:, 1])), 3),
            "added_median_ms": round(added, 3), "target_ms": ADDED_LATENCY_TARGET_MS,
            "within_target": added <= ADDED_LATENCY_TARGET_MS}


def start_http_coordinator(model: str, extra: list[str], log) -> tuple[subprocess.Popen, str, str]:
    addr, url = f"tcp://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    daemon = start_coordinator(model, addr, ["--http", url.removeprefix("http://"), *extra], log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and daemon.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return daemon, addr, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    last = last_words(log)
    daemon.kill()
    raise FermoeError("the coordinator's HTTP front end did not come up" + (f": {last}" if last else ""))


def run(model: str, prompt_tokens: int, max_tokens: int, requests: int, pairs: int, extra: list[str]) -> dict:
    with tempfile.TemporaryFile("w+") as log:
        daemon, addr, url = start_http_coordinator(model, extra, log)
        try:
            load = concurrency(url, prompt_tokens, max_tokens, requests)
            prompt = np.random.default_rng(1000).integers(10, 500, prompt_tokens).tolist()
            added = added_latency_vs_zmq(url, addr, prompt, pairs)
        finally:
            stop_coordinator(daemon)
    return {"model": model, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "concurrency": load, "added_latency_vs_zmq": added}


def run_soak(model: str, args, extra: list[str]) -> dict:
    from .soak import soak
    idle_s = args.idle if args.idle is not None else min(60.0, args.soak * 60 * 0.2)
    with tempfile.TemporaryFile("w+") as log:
        daemon, _, url = start_http_coordinator(model, extra, log)
        try:
            result = soak(url, daemon.pid, args.soak, args.clients, args.sample_every, idle_s, args.prompt,
                          args.tokens)
        finally:
            stop_coordinator(daemon)
    return {"model": model, "prompt_tokens": args.prompt, "max_tokens": args.tokens, "server_options": extra,
            **result}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fermoe bench http")
    p.add_argument("model", nargs="?", default="tiny", help="GGUF file or built-in model (default: tiny)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of each request (default 32)")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated by each request (default 16)")
    p.add_argument("--requests", type=int, default=64,
                   help="requests at each concurrency, shared out among the clients (default 64)")
    p.add_argument("--pairs", type=int, default=200, help="alternated HTTP/ZeroMQ pairs for the added latency")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="instead: a mixed load (streamed, plain, dropped and malformed requests) for MINUTES, and "
                        "every server process's resident memory over it")
    p.add_argument("--clients", type=int, default=16, help="--soak: concurrent clients (default 16)")
    p.add_argument("--sample-every", type=float, default=5.0, help="--soak: seconds between memory samples "
                                                                    "(default 5)")
    p.add_argument("--idle", type=float, default=None, help="--soak: seconds sampled after the load, the server "
                                                            "idle (default: a fifth of the soak, at most 60)")
    args, daemon_options = p.parse_known_args(argv)          # the rest goes to the coordinator
    if httpx is None:
        raise FermoeError("fermoe bench http needs httpx: pip install -e '.[test]'")
    if min(args.prompt, args.tokens, args.requests, args.pairs) < 1:
        p.error("--prompt, --tokens, --requests and --pairs must be at least 1")
    if args.soak is not None:
        if args.soak <= 0 or args.clients < 1 or args.sample_every <= 0 or (args.idle or 0) < 0:
            p.error("--soak and --sample-every must be positive, --clients at least 1, --idle at least 0")
        from .soak import dumps
        print(dumps(run_soak(args.model, args, daemon_options)))
        return 0
    print(json.dumps(run(args.model, args.prompt, args.tokens, args.requests, args.pairs, daemon_options), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
