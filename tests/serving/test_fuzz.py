"""Every ZeroMQ socket that decodes another process's bytes, fuzzed: for each message type
it takes, mutated frames (tests/support/frame_fuzz.py: deep nesting, huge integers, wrong
types, truncated, empty, 8 MiB, unknown types, extra frames) for a bounded number of
rounds; then a normal request is served and no process has exited.

Fault guarded, the one that started this: a frame of 100,000 nested arrays on the
client socket raised RecursionError while the coordinator read its request id, the
event loop died, and every request and worker went with it."""
from __future__ import annotations

import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from coordinator.client import Client
from shared import protocol as P
from shared.model import Model
from tests.support import frame_fuzz
from tests.support.serving_harness import Daemon, free_port, run, unpinned, wait_until

ROUNDS = 2
QUIET_S = 3.0               # no reply for this long: the daemon has answered all it will


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    d = Daemon(tiny_q4_path)            # the default --max-request-size: the 8 MiB frames are decoded
    yield d
    if d.proc.poll() is None:
        d.stop()


def _dealer(addr: str, identity: bytes | None = None):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(addr)
    return sock


def _served_and_alive(daemon, workers_before) -> None:
    assert daemon.proc.poll() is None, "".join(daemon.log[-20:])
    assert run(daemon.addr, "after the fuzz", max_tokens=4, seed=0)[1].finish_reason in ("length", "stop")
    with Client(daemon.addr) as c:
        assert sorted(w.pid for w in c.status().workers) == workers_before, "a worker exited"
    assert not any("Traceback" in line and "RecursionError" in line for line in daemon.log)


def test_the_client_socket(daemon):
    with Client(daemon.addr) as c:
        workers_before = sorted(w.pid for w in c.status().workers)
    sock = _dealer(daemon.addr)
    started: set[str] = set()

    def drain(timeout_ms: int) -> int:
        n = 0
        while sock.poll(timeout_ms):
            reply = msgpack.unpackb(sock.recv(), raw=False)
            if reply.get("type") == "token":        # a mutant that stayed valid: stop it
                started.add(reply["request_id"])
            n, timeout_ms = n + 1, 0
        return n

    def send(what, frames):
        sock.send_multipart(frames)
        drain(0)
    sent = frame_fuzz.fuzz(frame_fuzz.client_messages(), ROUNDS, send)
    last = time.monotonic()
    while time.monotonic() - last < QUIET_S:
        if drain(200):
            last = time.monotonic()
    for rid in started:
        sock.send(P.encode(P.Cancel(request_id=rid)))
    drain(1000)
    sock.close()
    assert sent > 100
    _served_and_alive(daemon, workers_before)


def test_the_worker_socket(daemon, tiny_q4_path):
    """A worker that joined properly, then sends mutants of every message a worker sends."""
    with Client(daemon.addr) as c:
        workers_before = sorted(w.pid for w in c.status().workers)
    sock = _dealer(daemon.worker_endpoint, b"fuzzing-worker")
    sock.send(P.encode(P.Hello(worker_id="fuzzing-worker", pid=1, threads=1,
                               fingerprint=Model(tiny_q4_path).fingerprint)))
    assert sock.poll(30_000) and isinstance(P.decode(sock.recv(), P.TO_WORKER), P.Welcome)
    sent = frame_fuzz.fuzz(frame_fuzz.worker_messages(), ROUNDS, lambda what, frames: sock.send_multipart(frames))
    sock.send(P.encode(P.Goodbye()))            # so that no request of the check below is given to it
    with Client(daemon.addr) as c:
        wait_until(lambda: all(w.worker_id != "fuzzing-worker" for w in c.status().workers), 60,
                   "the fuzzing worker's goodbye handled")
    sock.close()
    assert sent > 100
    _served_and_alive(daemon, workers_before)


def test_a_cpu_workers_socket(tiny_q4_path):
    """A real CPU worker under a coordinator that sends it mutants of every message a
    worker takes: it reports each it cannot take, and then serves an Assign."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    router.bind(addr)
    worker = subprocess.Popen([sys.executable, "-m", "cpu_worker.worker", "--connect", addr, "--model",
                               str(tiny_q4_path), "--threads", "1", "--worker-id", "fuzzed"],
                              stderr=subprocess.PIPE, text=True, preexec_fn=unpinned)
    try:
        def recv(timeout_s: float = 60):
            assert router.poll(int(timeout_s * 1000)), "the worker said nothing"
            return P.decode(router.recv_multipart()[1], P.FROM_WORKER)
        assert isinstance(recv(), P.Hello)
        router.send_multipart([b"fuzzed", P.encode(P.Welcome(arena="", slot_bytes=0, n_slots=0, state_slot_bytes=0,
                                                             n_state_slots=0, block=8, kv_cache_dtype="f16"))])
        assert isinstance(recv(), P.Attached)
        sent = frame_fuzz.fuzz(frame_fuzz.coordinator_messages(), ROUNDS,
                               lambda what, frames: router.send_multipart([b"fuzzed", *frames]))
        assert sent > 50
        router.send_multipart([b"fuzzed", P.encode(P.Assign(
            request_id="after-the-fuzz", tokens=[5, 6, 7], resume=[], snapshots=[], max_tokens=3,
            sampling=P.SamplingParams(seed=1), ignore_eos=True))])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = recv()
            if isinstance(msg, P.Finished) and msg.request_id == "after-the-fuzz":
                break
        assert (msg.finish_reason, msg.completion_tokens) == ("length", 3), msg
        assert worker.poll() is None
    finally:
        worker.terminate()
        _, err = worker.communicate(timeout=30)
        router.close()
    assert worker.returncode == 0, err[-3000:]
