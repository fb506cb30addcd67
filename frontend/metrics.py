"""/metrics in the Prometheus text format, named as vLLM names its metrics (`fermoe:`
for `vllm:`) where vLLM has one.

Two sources: the HTTP process's own accounting of the requests it served (tokens,
prefix-cache queries and hits in tokens from Done.cached_prompt_tokens, time to
first token, inter-token and end-to-end latency), and the coordinator's StatusReply,
fetched at each scrape (requests running and waiting, the snapshot store, each
worker).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared import protocol as P

# vLLM's buckets, with finer ones below 10 ms for small models on fast paths
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# StatusReply.snapshots entries that are levels; the others count events since start
SNAPSHOT_LEVELS = {"slots": "snapshot KV slots in the store", "free_slots": "snapshot KV slots holding nothing",
                   "state_slots": "snapshot state slots in the store",
                   "free_state_slots": "snapshot state slots holding nothing",
                   "entries": "cached prefix snapshots", "states": "cached snapshots with a state (resume points)",
                   "pinned": "snapshots in use by running requests",
                   "writing": "snapshot slots being written", "block": "prompt tokens between snapshots",
                   "disk_entries": "snapshots kept on disk", "disk_bytes": "bytes of the snapshots kept on disk",
                   "disk_capacity": "bytes the disk tier may hold"}


class Metrics:
    def __init__(self, waiting=lambda: 0):
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("fermoe:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("fermoe:generation_tokens",
                                         "Generated tokens of finished and aborted requests",
                                         registry=r)
        self.prefix_cache_queries = Counter("fermoe:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix snapshot cache", registry=r)
        self.prefix_cache_hits = Counter("fermoe:prefix_cache_hits",
                                         "Prompt tokens served from the prefix snapshot cache", registry=r)
        self.request_success = Counter("fermoe:request_success", "Finished requests by finish reason "
                                       "(abort: the client went away or cancelled it)",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("fermoe:time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fermoe:inter_token_latency_seconds", "Time between successive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("fermoe:e2e_request_latency_seconds", "Time from arrival to the end of a request",
                             buckets=E2E_BUCKETS, registry=r)
        self.prefills = Counter("fermoe:prefills", "Finished requests by where their prompt was prefilled "
                                "(gpu, cpu, or none: resumed whole from the snapshot cache)", ["device"], registry=r)
        self.prefill_estimate = Histogram("fermoe:prefill_estimate_seconds",
                                          "The chosen device's estimate of a prompt's prefill, by device",
                                          ["device"], buckets=TTFT_BUCKETS, registry=r)
        self.http_requests = Counter("fermoe:http_requests", "HTTP requests answered, by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        Gauge("fermoe:http_requests_waiting", "Requests of this HTTP server without a first reply yet "
              "(what --max-queue counts)", registry=r).set_function(waiting)
        self.llama = LlamaServerMetrics(r)
        self.status = StatusCollector()
        r.register(self.status)

    def finished(self, done: P.Done, e2e_s: float, reason: str | None = None) -> None:
        """One request's end; `reason` "abort" (vLLM's) for one whose client went away."""
        reason = reason or done.finish_reason
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.completion_tokens)
        self.prefix_cache_queries.inc(done.prompt_tokens)
        self.prefix_cache_hits.inc(done.cached_prompt_tokens)
        self.request_success.labels(finished_reason=reason).inc()
        self.e2e.observe(e2e_s)
        self.llama.finished(done)
        device = done.prefill_device or "none"
        self.prefills.labels(device=device).inc()
        if device in done.prefill_estimates_ms:
            self.prefill_estimate.labels(device=device).observe(done.prefill_estimates_ms[device] / 1000)

    def render(self, status: P.StatusReply | None) -> bytes:
        self.status.latest = status
        return generate_latest(self.registry)


class LlamaServerMetrics:
    """llama-server's `llamacpp:` metrics, so that dashboards made for it work: the prompt
    tokens evaluated (not found cached) and the time it took, the tokens generated and the
    time they took, and their averages."""

    def __init__(self, r: CollectorRegistry):
        self.prompt = [0, 0.0]                  # tokens, seconds
        self.predicted = [0, 0.0]
        self.prompt_tokens = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed.", registry=r)
        self.prompt_seconds = Counter("llamacpp:prompt_seconds", "Prompt process time", registry=r)
        self.tokens_predicted = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed.",
                                        registry=r)
        self.predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Predict process time", registry=r)
        Gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
              registry=r).set_function(lambda: _rate(self.prompt))
        Gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
              registry=r).set_function(lambda: _rate(self.predicted))

    def finished(self, done: P.Done) -> None:
        evaluated, prompt_s = done.prompt_tokens - done.cached_prompt_tokens, done.prefill_ms / 1000
        # the first token comes with the prefill; the rest at decode_tok_s
        decoded = max(done.completion_tokens - 1, 0)
        predicted_s = decoded / done.decode_tok_s if done.decode_tok_s > 0 else 0.0
        for total, n, s in ((self.prompt, evaluated, prompt_s), (self.predicted, done.completion_tokens, predicted_s)):
            total[0] += n
            total[1] += s
        self.prompt_tokens.inc(evaluated)
        self.prompt_seconds.inc(prompt_s)
        self.tokens_predicted.inc(done.completion_tokens)
        self.predicted_seconds.inc(predicted_s)


def _rate(total: list) -> float:
    return total[0] / total[1] if total[1] > 0 else 0.0


class StatusCollector:
    """The coordinator's state as of the StatusReply taken for this scrape."""

    def __init__(self):
        self.latest: P.StatusReply | None = None

    def describe(self):
        return []                          # collected only at scrape time, never at registration

    def collect(self):
        st = self.latest
        up = GaugeMetricFamily("fermoe:coordinator_up", "1 when the coordinator answered this scrape's status")
        up.add_metric([], 0 if st is None else 1)
        yield up
        if st is None:
            return
        yield _gauge("fermoe:num_requests_running", "Requests in prefill or decode on the workers", st.running)
        yield _gauge("fermoe:num_requests_waiting", "Requests queued in the coordinator", st.queued)
        yield from _snapshot_metrics(st.snapshots)
        yield from _worker_metrics(st.workers)
        yield from _llama_server_status(st)


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _snapshot_metrics(stats: dict[str, int]):
    for key, value in sorted(stats.items()):
        if key in SNAPSHOT_LEVELS:
            yield _gauge(f"fermoe:snapshot_{key}", SNAPSHOT_LEVELS[key].capitalize(), value)
        else:
            yield CounterMetricFamily(f"fermoe:snapshot_{key}", f"Snapshot store {key.replace('_', ' ')}",
                                      value=value)
    slots = stats.get("slots", 0)
    # as vllm:kv_cache_usage_perc, a fraction: the slots holding or being given a snapshot
    yield _gauge("fermoe:snapshot_usage_perc", "Fraction of the snapshot store in use",
                 (slots - stats.get("free_slots", 0)) / slots if slots else 0.0)


def _worker_metrics(workers: list[P.WorkerInfo]):
    alive = GaugeMetricFamily("fermoe:worker_alive", "1 when the worker is up and ready", labels=["worker_id"])
    running = GaugeMetricFamily("fermoe:worker_num_requests_running", "Sequences the worker runs",
                                labels=["worker_id"])
    threads = GaugeMetricFamily("fermoe:worker_threads", "Engine threads of the worker", labels=["worker_id"])
    rate = GaugeMetricFamily("fermoe:worker_prefill_tokens_per_second", "The worker's measured prefill rate, "
                             "by worker and kind (cpu, gpu)", labels=["worker_id", "kind"])
    for w in workers:
        alive.add_metric([w.worker_id], int(w.alive))
        running.add_metric([w.worker_id], w.running)
        threads.add_metric([w.worker_id], w.threads)
        rate.add_metric([w.worker_id, w.kind], w.prefill_tok_s)
    yield from (_gauge("fermoe:num_workers", "Workers known to the coordinator", len(workers)), alive, running,
                threads, rate)


def _llama_server_status(st: P.StatusReply):
    """llama-server's gauges of its slots and KV cache, from the coordinator's state."""
    slots, free = st.snapshots.get("slots", 0), st.snapshots.get("free_slots", 0)
    yield _gauge("llamacpp:requests_processing", "Number of requests processing.", st.running)
    yield _gauge("llamacpp:requests_deferred", "Number of requests deferred.", st.queued)
    yield _gauge("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                 (slots - free) / slots if slots else 0.0)
    yield _gauge("llamacpp:kv_cache_tokens", "KV-cache tokens.", (slots - free) * st.snapshots.get("block", 0))
    yield _gauge("llamacpp:n_tokens_max", "Largest context a request may use.", st.n_ctx)
