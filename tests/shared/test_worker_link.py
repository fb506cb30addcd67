"""A worker's link to the coordinator (shared/worker_link.py) where the coordinator takes
nothing: a Ctrl-C must still end the worker at once."""
from __future__ import annotations

import threading

from shared.worker_link import WorkerLink
from tests.support.serving_harness import free_port


def test_heartbeats_and_the_goodbye_never_wait_on_a_coordinator_that_takes_nothing():
    """Fault guarded: the goodbye of a worker stopped with Ctrl-C was a blocking send. A
    worker whose coordinator had gone (its queue full of heartbeats nobody read) waited in
    that send for ever and never exited; each heartbeat was such a send too."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    link = WorkerLink(endpoint, "w", lambda dtype: None)
    link.sock.disconnect(endpoint)          # no peer at all: ZeroMQ's mute state, where a send blocks
    finished = threading.Event()

    def stop_the_worker():
        link._last_beat = 0.0
        link.beat(0)
        link.close()
        finished.set()
    threading.Thread(target=stop_the_worker, daemon=True).start()
    assert finished.wait(10), "a heartbeat or the goodbye blocked on a coordinator that takes nothing"
    assert link.sock.closed
