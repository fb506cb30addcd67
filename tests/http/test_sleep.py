"""--sleep-idle-seconds (llama-server's): idle that long, the coordinator stops the workers it
started, freeing the model's memory; /props says is_sleeping; the next request starts them
again and is answered as it would have been awake."""
from __future__ import annotations

import os
import time

import httpx
import pytest

from coordinator.client import Client
from shared.builtin import BUILTIN
from tests.support.http_server import HttpDaemon

PROMPT = {"prompt": "The json module", "temperature": 0, "n_predict": 6}


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(BUILTIN["tiny"], "--sleep-idle-seconds", "1")
    yield d
    assert d.stop() == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait(check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_idle_workers_stop_and_the_next_request_wakes_them(daemon):
    """Guards: workers kept (their memory not freed) or restarted as if they had died while
    asleep, is_sleeping not shown, a request while asleep lost or answered differently, or the
    server slept while a request ran."""
    awake = httpx.post(f"{daemon.url}/completion", json=PROMPT, timeout=60).json()["content"]
    with Client(daemon.addr) as client:
        pids = [w.pid for w in client.status().workers]
    assert pids and httpx.get(f"{daemon.url}/props", timeout=10).json()["is_sleeping"] is False
    _wait(lambda: httpx.get(f"{daemon.url}/props", timeout=10).json()["is_sleeping"])
    _wait(lambda: not any(_alive(pid) for pid in pids))
    time.sleep(1.0)                                     # (a worker restarted as if it had died would be up by now)
    with Client(daemon.addr) as client:
        assert client.status().workers == []
    health = httpx.get(f"{daemon.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["sleeping"] is True
    assert httpx.post(f"{daemon.url}/completion", json=PROMPT, timeout=120).json()["content"] == awake
    assert httpx.get(f"{daemon.url}/props", timeout=10).json()["is_sleeping"] is False
    with Client(daemon.addr) as client:
        assert [w.pid for w in client.status().workers] != pids
    # a generation longer than the idle time is not cut by sleep
    long = httpx.post(f"{daemon.url}/completion", json={**PROMPT, "n_predict": 1500, "ignore_eos": True},
                      timeout=120).json()
    assert long["tokens_predicted"] == 1500 and long["stop_type"] == "limit"
    assert long["timings"]["predicted_ms"] > 1000, long["timings"]        # (longer than the idle time)
