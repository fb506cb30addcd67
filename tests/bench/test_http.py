"""`fermoe bench http` on the tiny model: it starts the coordinator with its HTTP front
end, drives every concurrency and the HTTP/ZeroMQ pairs, and stops it."""
from __future__ import annotations

import pytest

pytest.importorskip("httpx")


def test_bench_http_on_the_tiny_model(tiny_q4_path):
    import bench.http
    from bench.http import CONCURRENCY, run
    from tests.support.bench_keys import assert_keys_documented
    requests, pairs = 4, 4
    out = run(str(tiny_q4_path), prompt_tokens=8, max_tokens=3, requests=requests, pairs=pairs, extra=[])
    for clients in CONCURRENCY:
        load = out["concurrency"][str(clients)]
        assert load["requests"] == clients * -(-requests // clients)          # every client's share, rounded up
        assert load["tokens_per_s"] > 0 and load["ttft_ms"]["p50"] <= load["ttft_ms"]["p99"]
    added = out["added_latency_vs_zmq"]
    assert added["pairs"] == pairs and added["http_ttft_median_ms"] > 0 and added["zmq_ttft_median_ms"] > 0
    assert_keys_documented(out, bench.http)
