"""`fermoe bench http --soak MINUTES`: the HTTP API under a long mixed load, and the
resident memory of every process of the server over that time, as JSON.

Many clients loop until the time is up, each request one of: a streamed completion,
a plain one, a stream the client drops after its first chunk (a disconnect), or a
malformed request (bad JSON, a wrong field type: the server must answer 4xx and go
on). Meanwhile VmRSS, RssAnon and RssShmem of the coordinator, its HTTP front end
and its workers are read from /proc/PID/status every few seconds (RssShmem: the
snapshot arena's pages a process touched, which fill as the cache does); after the load, the
server idles a while and is sampled on, to see whether memory comes back.

What tells a leak from a level: `growth_kb_per_min` of each process over the second
half of the load (a level is ~0 there, a leak keeps its slope), and `idle_change_kb`
(memory given back, or not, once the requests stop).

JSON keys:
  model                   the GGUF path or built-in name given
  prompt_tokens           tokens of each request's prompt (--prompt)
  max_tokens              tokens each request generates (--tokens)
  server_options          the coordinator options passed through, a list of strings
  minutes                 the load's length (--soak)
  clients                 concurrent clients (--clients)
  sample_every_s          s between memory samples (--sample-every)
  idle_s                  s sampled after the load, the server idle (--idle)
  requests.<kind>         requests sent of each kind: stream, plain, disconnect, malformed
  requests_total          all of them
  requests_per_s          requests/s over the load's wall time
  errors.<failure>        requests that went wrong, by "kind: cause" (an HTTP status or an exception's
                          name); a malformed request answered 4xx is no error
  load_end_s              s from the first sample to the load's end
  pids.<process>          each server process's pid: coordinator, http, "worker ID"
  rss_kb.<process>        each process's memory over the soak, kB (1024 bytes) as /proc reports it
  rss_kb.<process>.samples  samples taken (0: the process was never read, and no other key)
  rss_kb.<process>.anon_first_kb  kB: RssAnon (its own memory, the shared arena left out), first
  rss_kb.<process>.anon_max_kb  kB: RssAnon at its peak
  rss_kb.<process>.anon_load_end_kb  kB: RssAnon at the load's end
  rss_kb.<process>.anon_last_kb  kB: RssAnon last (after the idle time)
  rss_kb.<process>.growth_kb_per_min  kB/min: the least-squares slope of RssAnon over the second
                          half of the load (a level: ~0; a leak keeps its slope)
  rss_kb.<process>.idle_change_kb  kB: RssAnon's change over the idle time (negative: given back)
  rss_kb.<process>.vmrss_last_kb  kB: VmRSS last
  rss_kb.<process>.shmem_last_kb  kB: RssShmem last (the snapshot arena's pages it touched)
  rss_kb.<process>.series  every sample, a list of [seconds, VmRSS, RssAnon, RssShmem] (kB)
  series_columns          the names of a series point's four values"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter

import numpy as np

from .host_memory import parents

KINDS = ("stream", "plain", "disconnect", "malformed")
WEIGHTS = (0.45, 0.3, 0.15, 0.1)
MALFORMED = (b"{not json", b'{"prompt": "x", "max_tokens": "many"}', b'{"max_tokens": 4}', b"[]")


def _status_kb(pid: int) -> dict | None:
    """VmRSS, RssAnon and RssShmem of a process, in kB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssShmem") if k in fields}


def server_processes(coordinator_pid: int) -> dict[str, int]:
    """name -> pid: the coordinator, its HTTP front end and its workers (its children,
    named from their command lines)."""
    found = {"coordinator": coordinator_pid}
    for entry, ppid in parents().items():
        if ppid != coordinator_pid:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "frontend" in argv:
            found["http"] = int(entry)
        elif "cpu_worker.worker" in argv:
            wid = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else entry
            found[f"worker {wid}"] = int(entry)
    return found


class Sampler:
    """A thread reading each process's memory every `every_s` seconds (and once at stop)."""

    def __init__(self, pids: dict[str, int], every_s: float):
        self.pids, self.every_s, self.t0 = pids, every_s, time.monotonic()
        self.series: dict[str, list] = {name: [] for name in pids}
        self.marks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.monotonic() - self.t0, 2)

    def sample(self) -> None:
        t = round(time.monotonic() - self.t0, 2)
        for name, pid in self.pids.items():
            if self.series[name] and self.series[name][-1][0] >= t:
                continue                # stop()'s own sample, within the rounding of the thread's last
            kb = _status_kb(pid)
            if kb is not None:
                self.series[name].append([t, kb.get("VmRSS", 0), kb.get("RssAnon", 0), kb.get("RssShmem", 0)])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _slope_kb_per_min(points: list) -> float:
    """Least-squares slope of RssAnon (the process's own memory) over time."""
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return 0.0
    t, rss = np.asarray([p[0] for p in points]), np.asarray([p[2] for p in points])
    return round(float(np.polyfit(t, rss, 1)[0]) * 60, 1)


def summarise(series: list, load_end: float) -> dict:
    """RssAnon (the process's own memory, the shared arena left out) first, at its peak, at
    the end of the load and last; its slope over the second half of the load; its change
    over the idle time after it. And the last VmRSS and RssShmem."""
    if not series:
        return {"samples": 0}
    load = [p for p in series if p[0] <= load_end]
    second_half = [p for p in load if p[0] >= load_end / 2]
    at_load_end = load[-1][2] if load else series[0][2]
    return {"samples": len(series), "anon_first_kb": series[0][2], "anon_max_kb": max(p[2] for p in series),
            "anon_load_end_kb": at_load_end, "anon_last_kb": series[-1][2],
            "growth_kb_per_min": _slope_kb_per_min(second_half),
            "idle_change_kb": series[-1][2] - at_load_end,
            "vmrss_last_kb": series[-1][1], "shmem_last_kb": series[-1][3], "series": series}


async def _one(http, kind: str, rng: random.Random, prompt_tokens: int, max_tokens: int, counts: Counter,
               errors: Counter) -> None:
    body = {"prompt": [rng.randrange(10, 500) for _ in range(prompt_tokens)], "max_tokens": max_tokens,
            "temperature": 0.8, "seed": rng.randrange(1 << 30), "ignore_eos": True}
    try:
        if kind == "malformed":
            r = await http.post("/v1/completions", content=rng.choice(MALFORMED),
                                headers={"Content-Type": "application/json"})
            ok = 400 <= r.status_code < 500
        elif kind == "plain":
            r = await http.post("/v1/completions", json=body)
            ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
        else:
            async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                ok = r.status_code == 200
                async for line in r.aiter_lines():
                    if kind == "disconnect" and line.startswith("data: {"):
                        break                   # leaving the block closes the connection mid-stream
        counts[kind] += 1
        if not ok:
            errors[f"{kind}: HTTP {r.status_code}"] += 1
    except Exception as e:                      # counted, never fatal: the soak goes on
        counts[kind] += 1
        errors[f"{kind}: {type(e).__name__}"] += 1


async def _load(url: str, clients: int, seconds: float, prompt_tokens: int, max_tokens: int, seed: int):
    import httpx
    counts, errors = Counter(), Counter()
    deadline = time.monotonic() + seconds

    async def client(i):
        rng = random.Random(seed * 1000 + i)
        # its own connection pool: a disconnect closes only this client's connection
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while time.monotonic() < deadline:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                await _one(http, kind, rng, prompt_tokens, max_tokens, counts, errors)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return counts, errors, time.perf_counter() - t0


def soak(url: str, coordinator_pid: int, minutes: float, clients: int, every_s: float, idle_s: float,
         prompt_tokens: int, max_tokens: int, seed: int = 0) -> dict:
    pids = server_processes(coordinator_pid)
    sampler = Sampler(pids, every_s).start()
    counts, errors, wall = asyncio.run(_load(url, clients, minutes * 60, prompt_tokens, max_tokens, seed))
    sampler.mark("load_end")
    time.sleep(idle_s)
    sampler.stop()
    load_end = sampler.marks["load_end"]
    n = sum(counts.values())
    return {"minutes": minutes, "clients": clients, "sample_every_s": every_s, "idle_s": round(idle_s, 2),
            "requests": dict(counts), "requests_total": n, "requests_per_s": round(n / wall, 2),
            "errors": dict(errors), "load_end_s": load_end, "pids": pids,
            "rss_kb": {name: summarise(series, load_end) for name, series in sampler.series.items()},
            "series_columns": ["seconds", "VmRSS_kB", "RssAnon_kB", "RssShmem_kB"]}


def dumps(result: dict) -> str:
    """JSON with each series point on one line (a long soak has many)."""
    return json.dumps(result, indent=1)
