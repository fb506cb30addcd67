"""The scheduling policy alone (coordinator/scheduler.py): the next request goes to the
live, ready worker running the fewest sequences, ties by id, never to a full one."""
from __future__ import annotations

from coordinator.scheduler import WorkerView, hybrid_pairs, pick_worker


def _view(wid, running, alive=True, ready=True):
    return WorkerView(wid, alive=alive, ready=ready, requests={f"{wid}-{i}" for i in range(running)})


def test_the_least_busy_worker_gets_the_next_request():
    workers = {w.worker_id: w for w in [_view("a", 3), _view("b", 1), _view("c", 2)]}
    assert pick_worker(workers, max_sequences=8) == "b"
    workers["b"].requests |= {"x", "y"}                  # b now runs 3: c is the least busy
    assert pick_worker(workers, max_sequences=8) == "c"


def test_ties_go_by_worker_id():
    workers = {w.worker_id: w for w in [_view("cpu1.0", 1), _view("cpu0.1", 1), _view("cpu0.0", 2)]}
    assert pick_worker(workers, max_sequences=8) == "cpu0.1"


def test_dead_unready_and_full_workers_get_nothing():
    workers = {w.worker_id: w for w in [_view("a", 0, alive=False), _view("b", 0, ready=False), _view("c", 2)]}
    assert pick_worker(workers, max_sequences=2) is None
    assert pick_worker(workers, max_sequences=3) == "c"
    assert pick_worker({}, max_sequences=8) is None


def _cpu(wid, mailbox="mb", hybrid_with="", ready=True, alive=True):
    return WorkerView(wid, kind="cpu", mailbox=mailbox, hybrid_with=hybrid_with, ready=ready, alive=alive)


def _gpu(wid, ready=True, alive=True):
    return WorkerView(wid, kind="gpu", ready=ready, alive=alive)


def test_several_gpu_workers_share_the_hybrid_decode():
    """Guards the spread: each unserved mailbox goes to the ready GPU worker serving the fewest,
    counting those it already serves; a CPU worker already paired, without a mailbox, or not
    ready is left alone, and dead or unready GPU workers take none."""
    workers = {w.worker_id: w for w in [
        _gpu("gpu0"), _gpu("gpu1"), _gpu("gpu2", ready=False), _gpu("gpu3", alive=False),
        _cpu("cpu0.0", hybrid_with="gpu0"), _cpu("cpu0.1"), _cpu("cpu0.2"), _cpu("cpu0.3"),
        _cpu("cpu1.0", mailbox=""), _cpu("cpu1.1", ready=False)]}
    assert hybrid_pairs(workers) == [("cpu0.1", "gpu1"), ("cpu0.2", "gpu0"), ("cpu0.3", "gpu1")]
    assert hybrid_pairs({"cpu0.0": _cpu("cpu0.0")}) == []          # no GPU worker: nobody paired
