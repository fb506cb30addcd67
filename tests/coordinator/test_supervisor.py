"""Worker supervision without a daemon: a worker that cannot start is restarted a
few times, then given up on (the daemon then fails its queued requests)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from coordinator.supervisor import MAX_RESTARTS, Supervisor


def test_a_worker_that_cannot_start_is_given_up(tmp_path):
    opts = SimpleNamespace(cpu_workers_per_socket=1, threads_per_worker=1, model_path=str(tmp_path / "none.gguf"),
                           engine="reference", numa_interleave=False)
    sup = Supervisor(opts, "tcp://127.0.0.1:9")
    sup.start_all()
    starts = 1
    deadline = time.monotonic() + 120
    while not sup.all_given_up and time.monotonic() < deadline:
        for wid in sup.reap():
            sup.restart(wid)
            starts += wid not in sup.given_up
        time.sleep(0.05)
    assert sup.all_given_up
    assert starts == MAX_RESTARTS + 1
    assert not sup.procs
