"""Scheduling against a daemon whose workers take one sequence each (--max-sequences 1),
two of them on this node where it has two physical cores (--cpu-workers-per-socket),
on the reference engine (--engine reference) and a worker endpoint of our choosing
(--worker-bind): requests go to the least busy worker, wait in a queue in arrival
order when every worker is full, and a queued one can be cancelled before it ever
runs. Replies are read in arrival order, to see which request ran before which."""
from __future__ import annotations

import re

import pytest

from coordinator.client import Client
from shared.topology import numa_nodes, physical_cores
from shared import protocol as P
from shared.sampling import SamplingParams
from tests.support.serving_harness import Daemon, OrderedClient, free_port, local_ids, streamed_ids, wait_until

PER_SOCKET = 2 if len(physical_cores(numa_nodes()[min(numa_nodes())])) >= 2 else 1
ENDLESS = 100_000            # tokens: a request that holds its worker until cancelled


@pytest.fixture(scope="module")
def queue_daemon(tiny_q4_path):
    worker_bind = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(tiny_q4_path, "--max-sequences", "1", "--cpu-workers-per-socket", str(PER_SOCKET),
               "--worker-bind", worker_bind, "--engine", "reference")
    d.worker_bind = worker_bind
    yield d
    assert d.stop() == 0


def test_workers_per_socket_on_their_own_cores_at_the_given_endpoint(queue_daemon, tiny_q4_path):
    with Client(queue_daemon.addr) as c:
        assert c.status().model == str(tiny_q4_path)
        c.wait_ready(60)

        def all_alive():
            workers = c.status().workers
            return workers if len(workers) >= PER_SOCKET * len(numa_nodes()) and all(w.alive for w in workers) else []
        workers = wait_until(all_alive, 60, f"{PER_SOCKET} alive workers per node")
    expected = {f"cpu{node}.{i}" for node in numa_nodes() for i in range(PER_SOCKET)}
    assert {w.worker_id for w in workers} == expected and len({w.pid for w in workers}) == len(expected)
    assert all(w.threads == 1 for w in workers)
    assert queue_daemon.worker_endpoint == queue_daemon.worker_bind
    placed = {}                  # worker -> the CPUs the supervisor gave it, from its log line
    for line in queue_daemon.log:
        m = re.search(r"started worker (\S+) \(pid \d+\) on node (\d+), CPUs \[([\d, ]+)\]", line)
        if m:
            placed[m.group(1)] = (int(m.group(2)), {int(c) for c in m.group(3).split(",")})
    assert set(placed) == expected
    for node, cpus in numa_nodes().items():
        shares = [placed[f"cpu{node}.{i}"][1] for i in range(PER_SOCKET)]
        assert all(share <= set(physical_cores(cpus)) for share in shares)
        assert len(set().union(*shares)) == sum(map(len, shares))       # no core given twice


def test_the_engine_option_reaches_the_workers(queue_daemon, tiny_q4_path):
    with Client(queue_daemon.addr, timeout_s=60) as c:
        served = streamed_ids(list(c.generate("Which engine runs this?", max_tokens=8, seed=3, ignore_eos=True)))
    expected = local_ids(tiny_q4_path, "Which engine runs this?", 8, engine="reference", temperature=0.8, seed=3)
    assert served == expected
    assert expected != local_ids(tiny_q4_path, "Which engine runs this?", 8, temperature=0.8, seed=3)   # it tells


def test_full_workers_queue_requests_in_order_and_a_queued_one_cancels_unrun(queue_daemon, tiny_q4_path):
    c = OrderedClient(queue_daemon.addr)
    try:
        before = c.status()
        n_workers = len(before.workers)
        for i in range(n_workers):           # one each: the least busy worker takes the next
            c.send(P.Generate(request_id=f"hold{i}", prompt=f"Holding worker {i}", max_tokens=ENDLESS,
                              ignore_eos=True, sampling=SamplingParams(seed=i)))
            c.until(lambda m: isinstance(m, P.Token) and m.request_id == f"hold{i}")
        status = c.status()
        assert [w.running for w in status.workers] == [1] * n_workers
        assert (status.running, status.queued) == (n_workers, 0)
        for rid in ("queued", "second", "third"):
            c.send(P.Generate(request_id=rid, prompt=f"The {rid} in line", max_tokens=4, sampling=SamplingParams(seed=7),
                              ignore_eos=True))
        status = c.status()
        assert (status.running, status.queued) == (n_workers, 3)
        c.send(P.Cancel(request_id="queued"))
        done = c.until(lambda m: isinstance(m, P.Done))
        assert (done.request_id, done.finish_reason, done.completion_tokens, done.prefill_ms) == \
            ("queued", "cancelled", 0, 0.0)
        status = c.status()
        assert (status.running, status.queued) == (n_workers, 2)
        c.send(P.Cancel(request_id="hold0"))      # frees one worker: the next in line runs, then the last
        for rid in ("hold0", "second", "third"):
            assert c.until(lambda m: isinstance(m, P.Done)).request_id == rid
        for i in range(1, n_workers):
            c.send(P.Cancel(request_id=f"hold{i}"))
            c.until(lambda m: isinstance(m, P.Done) and m.request_id == f"hold{i}")
        after = c.status()
    finally:
        c.close()
    ran = {r.request_id for r in c.replies if isinstance(r, P.Token)}
    assert "queued" not in ran                           # cancelled before it ever ran...
    looked_up = sum(after.snapshots[k] - before.snapshots[k] for k in ("hits", "misses"))
    assert looked_up == n_workers + 2                    # ...or was even looked up in the cache
    order = [r.request_id for r in c.replies if (isinstance(r, P.Done) or isinstance(r, P.Token) and r.token >= 0)
             and r.request_id in ("second", "third")]
    assert order == ["second"] * 5 + ["third"] * 5       # 4 tokens and a Done each, one after the other
    for rid in ("second", "third"):
        ids = [r.token for r in c.replies if isinstance(r, P.Token) and r.request_id == rid]
        assert ids == local_ids(tiny_q4_path, f"The {rid} in line", 4, engine="reference", temperature=0.8, seed=7)
    assert (after.running, after.queued) == (0, 0)
