"""`fermoe bench http --soak MINUTES` for a few seconds: the JSON has every server
process's memory series and the requests of each kind, none failed. (How memory
behaves over a long soak is the benchmark's to measure, not a test's.)"""
from __future__ import annotations

import json

import pytest

import bench.soak
from bench.soak import summarise
from tests.support.bench_keys import assert_keys_documented
from tests.support.serving_harness import fermoe

pytest.importorskip("httpx")


def test_soak_reports_every_server_process_memory_over_time(tiny_q4_path):
    run = fermoe("bench", "http", tiny_q4_path, "--soak", 0.05, "--clients", 3, "--sample-every", 0.5, "--idle", 1)
    out = json.loads(run.stdout)
    names = set(out["rss_kb"])
    assert {"coordinator", "http"} <= names and any(n.startswith("worker ") for n in names), names
    assert names == set(out["pids"])
    for name, rss in out["rss_kb"].items():
        series = rss["series"]
        assert rss["samples"] == len(series) >= 4, name                  # 3 s of load and 1 idle, every 0.5 s
        assert all(t1 > t0 for (t0, *_), (t1, *_) in zip(series, series[1:])), name
        assert all(vmrss >= anon + shmem and anon > 0 for _, vmrss, anon, shmem in series), name
        assert series[-1][0] >= round(out["load_end_s"] + 1, 2) > 3, name   # through the idle second (0.01 s rounded)
    assert out["requests_total"] == sum(out["requests"].values()) > 0 and out["requests_per_s"] > 0
    assert set(out["requests"]) <= {"stream", "plain", "disconnect", "malformed"}
    assert out["errors"] == {}, out["errors"]
    assert_keys_documented(out, bench.soak)


def test_soak_summary_tells_a_level_from_a_slope():
    """The slope is RssAnon's over the load's second half: the shared arena (RssShmem, in
    VmRSS) filling with snapshots is no leak of the process."""
    flat = [[t, 9000 + 50 * t, 1000 + (t < 10) * t, 8000 + 50 * t] for t in range(0, 61, 5)]   # grows, levels
    leak = [[t, 9000, 1000 + 3 * t, 8000] for t in range(0, 61, 5)]
    assert summarise(flat, 60)["growth_kb_per_min"] == 0.0
    assert summarise(leak, 60)["growth_kb_per_min"] == 180.0
    idle = summarise(leak + [[70, 9000, 1100, 8000]], 60)
    assert (idle["anon_load_end_kb"], idle["idle_change_kb"], idle["anon_max_kb"]) == (1180, -80, 1180)
