"""The HTTP front end under the conditions a server meets: clients that leave, a full
queue, an API key, 32 concurrent streams, a port in use, a front end that dies.
Real processes on the tiny model; cancellation is observed in the coordinator's own
status (running and queued), not inferred from the HTTP side."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import Client
from shared import protocol as P
from tests.support.http_server import HttpDaemon, LocalEngine, Serve
from tests.support.serving_harness import free_port, wait_until

MAX_SEQUENCES = 2           # a worker this full makes the next request wait in the coordinator's queue
KEY = "sk-test-key"
# Cancelling takes a round trip through three processes; the requests cancelled here
# would otherwise decode for minutes (up to the model's 262144 positions).
CANCEL_DEADLINE_S = 15.0
ENDLESS = {"prompt": "Go on and on", "max_tokens": 200000, "ignore_eos": True, "stream": True}
STREAMS, STREAM_TOKENS = 32, 8
ALIAS = "tiny-load"
MAX_REQUEST = 8 << 20       # the coordinator's --max-request-size; a front end of its own takes more
PAGE = "http://page.example"


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    d = HttpDaemon(tiny_q4_path, "--max-sequences", str(MAX_SEQUENCES), "--alias", ALIAS, "--max-request-size",
                   "8MiB")
    yield d
    assert d.stop() == 0


def status(daemon):
    with Client(daemon.addr) as c:
        return c.status()


def idle(daemon) -> bool:
    st = status(daemon)
    return st.running == 0 and st.queued == 0


def gauge(url: str, name: str, headers=None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@contextlib.contextmanager
def endless_stream(url: str):
    """A stream that would run for minutes, open once its first token has come."""
    with httpx.stream("POST", f"{url}/v1/completions", json=ENDLESS, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines)[6:])["object"] == "text_completion"
        yield r


def raw_request(url: str, path: str, body: dict) -> socket.socket:
    """An HTTP request written on a plain socket, so the test can drop the connection at will."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_disconnect_mid_stream_cancels_the_request(daemon):
    with endless_stream(daemon.url):
        st = status(daemon)
        assert st.running == 1 and gauge(daemon.url, "fermoe:num_requests_running") == 1
    wait_until(lambda: idle(daemon), CANCEL_DEADLINE_S,
               "the coordinator still runs the request of a client that left")
    assert gauge(daemon.url, "fermoe:num_requests_running") == 0


def test_disconnect_before_the_first_token_leaves_the_queue(daemon):
    with contextlib.ExitStack() as stack:
        for _ in range(MAX_SEQUENCES):
            stack.enter_context(endless_stream(daemon.url))
        sock = raw_request(daemon.url, "/v1/completions", {"prompt": "I wait", "max_tokens": 4})
        wait_until(lambda: status(daemon).queued == 1, CANCEL_DEADLINE_S, "the request never reached the queue")
        sock.close()
        wait_until(lambda: status(daemon).queued == 0, CANCEL_DEADLINE_S, "a queued request outlived its client")
        assert status(daemon).running == MAX_SEQUENCES
    wait_until(lambda: idle(daemon), CANCEL_DEADLINE_S, "streams not cancelled")


def test_disconnected_streams_are_counted_as_aborts_with_their_tokens(daemon):
    def sample(name):
        text = httpx.get(f"{daemon.url}/metrics", timeout=30).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
                   and s.labels.get("finished_reason", "abort") == "abort")
    names = ["fermoe:request_success_total", "fermoe:generation_tokens_total", "fermoe:prompt_tokens_total"]
    prompt_tokens = httpx.post(f"{daemon.url}/v1/completions", json=ENDLESS | {"stream": False, "max_tokens": 1},
                               timeout=60).json()["usage"]["prompt_tokens"]
    before = {n: sample(n) for n in names}
    received = 0
    for _ in range(2):                                 # each left after 5 chunks of text
        with httpx.stream("POST", f"{daemon.url}/v1/completions", json=ENDLESS, timeout=60) as r:
            data = (line for line in r.iter_lines() if line.startswith("data: "))
            received += sum(1 for _, _ in zip(data, range(5)))
    wait_until(lambda: idle(daemon), CANCEL_DEADLINE_S, "streams not cancelled")
    grew = wait_until(lambda: (g := {n: sample(n) - before[n] for n in names})["fermoe:request_success_total"] == 2
                      and g, CANCEL_DEADLINE_S, "two aborts counted")
    assert grew["fermoe:prompt_tokens_total"] == 2 * prompt_tokens
    assert grew["fermoe:generation_tokens_total"] >= received


def test_api_key_and_max_queue_on_a_front_end_of_its_own(daemon):
    front = Serve(daemon.addr, "--api-key", KEY, "--max-queue", "1", "--alias", "served", "--cors-origins", PAGE)
    try:
        front.wait_http(front.url)                     # /health needs no key
        _check_the_key(front.url)
        _check_cors_under_the_key(front.url)
        _check_the_queue_limit(daemon, front.url)
    finally:
        assert front.stop() == 0


def test_the_model_is_named_by_its_alias(daemon):
    assert [m["id"] for m in httpx.get(f"{daemon.url}/v1/models").json()["data"]] == [ALIAS]
    r = httpx.post(f"{daemon.url}/v1/completions", json={"model": "anything", "prompt": "x", "max_tokens": 1})
    assert r.json()["model"] == ALIAS


def _check_cors_under_the_key(url: str) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": PAGE} | preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE     # no key asked
    assert r.headers["vary"] == "Origin"
    r = httpx.get(f"{url}/v1/models", headers={"Origin": PAGE})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE     # the page reads the 401
    r = httpx.get(f"{url}/v1/models", headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
    assert r.json()["data"][0]["id"] == "served" and r.headers["access-control-allow-origin"] == PAGE
    r = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": "http://elsewhere.example"} | preflight)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "--cors-origins" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/models", headers={"Origin": "http://elsewhere.example"})
    assert r.status_code == 401 and "access-control-allow-origin" not in r.headers


def test_one_request_size_limit_over_http_and_zeromq(daemon):
    prompt = "x" * (MAX_REQUEST + 1)
    r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": prompt}, timeout=60)
    assert r.status_code == 413 and "the server's --max-request-size" in r.json()["error"]["message"]
    front = Serve(daemon.addr)                         # its own limit, the default: above the coordinator's
    try:
        front.wait_http(front.url)
        r = httpx.post(f"{front.url}/v1/completions", json={"prompt": prompt}, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 413 and f"over the limit of {MAX_REQUEST} bytes (8 MiB)" in message
        assert "the coordinator's --max-request-size" in message
    finally:
        assert front.stop() == 0
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.addr)
    try:
        sock.send(P.encode(P.Generate(request_id="big", prompt=prompt)))
        assert sock.poll(30000)
        error = P.decode(sock.recv(), P.CLIENT_REPLIES)
    finally:
        sock.close()
    assert isinstance(error, P.Error) and "--max-request-size" in error.message and str(MAX_REQUEST) in error.message


def _check_the_key(url: str) -> None:
    for headers, code in [({}, "missing_api_key"), ({"Authorization": "Bearer wrong"}, "invalid_api_key"),
                          ({"Authorization": KEY}, "missing_api_key")]:
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(f"{url}{path}", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == code, (path, headers)
        r = httpx.post(f"{url}/v1/completions", headers=headers, json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401
    for path in ("/health", "/v1/health", "/", "/favicon.ico"):    # what a browser loads before the key is typed
        assert httpx.get(f"{url}{path}").status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=good.models.list().data[0].id, prompt="x", max_tokens=2,
                                   extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def _check_the_queue_limit(daemon, url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    waited = []
    with contextlib.ExitStack() as stack:
        for _ in range(MAX_SEQUENCES):
            stack.enter_context(endless_stream(daemon.url))
        waiter = threading.Thread(target=lambda: waited.append(httpx.post(
            f"{url}/v1/completions", headers=auth, timeout=120,
            json={"prompt": "I wait", "max_tokens": 2, "ignore_eos": True})))
        waiter.start()
        wait_until(lambda: gauge(url, "fermoe:http_requests_waiting", auth) == 1, CANCEL_DEADLINE_S,
                   "the waiting request")
        r = httpx.post(f"{url}/v1/completions", headers=auth, json={"prompt": "one too many", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        # a bad request gets its own 400 however full the queue (fault guarded: the front end
        # counted it against --max-queue before the coordinator had looked at it)
        bad = httpx.post(f"{url}/v1/completions", headers=auth, json={"prompt": [10**9], "max_tokens": 2})
        assert bad.status_code == 400 and "token ids must be in" in bad.json()["error"]["message"], bad.text
        assert status(daemon).queued == 1
    waiter.join(120)                                   # the endless streams are gone: it runs now
    assert waited[0].status_code == 200 and waited[0].json()["usage"]["completion_tokens"] == 2
    wait_until(lambda: idle(daemon), CANCEL_DEADLINE_S, "streams not cancelled")


def test_32_concurrent_streams_each_arrive_whole(daemon, tiny_q4_path):
    local = LocalEngine(tiny_q4_path)
    prompts = [f"Client {i} asks about the snapshot cache" for i in range(STREAMS)]
    expected = [local.text(local.tok.encode(p), STREAM_TOKENS, ignore_eos=True, seed=i)[0]
                for i, p in enumerate(prompts)]

    async def one(http, i):
        body = {"prompt": prompts[i], "max_tokens": STREAM_TOKENS, "seed": i, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        chunks = [json.loads(d) for d in data[:-1]]
        return data[-1], "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks[-1]["usage"]

    async def all_of_them():
        limits = httpx.Limits(max_connections=STREAMS)
        async with httpx.AsyncClient(base_url=daemon.url, timeout=180, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(STREAMS)))

    results = asyncio.run(all_of_them())
    assert [r[0] for r in results] == ["[DONE]"] * STREAMS
    assert [r[1] for r in results] == expected
    assert [r[2]["completion_tokens"] for r in results] == [STREAM_TOKENS] * STREAMS
    assert httpx.get(f"{daemon.url}/health").status_code == 200 and idle(daemon)
    assert all(w.alive for w in status(daemon).workers) and daemon.proc.poll() is None
    assert gauge(daemon.url, "fermoe:http_requests_waiting") == 0


def test_a_front_end_that_dies_is_restarted_on_the_same_port(daemon):
    pids = [int(m) for line in daemon.log for m in re.findall(r"started the HTTP front end \(pid (\d+)\)", line)]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: len([line for line in daemon.log if "started the HTTP front end" in line]) == 2,
               30, "no restart")
    daemon.wait_http(daemon.url)
    assert httpx.post(f"{daemon.url}/v1/completions", json={"prompt": "back", "max_tokens": 2}).status_code == 200


def test_a_port_in_use_is_one_clear_error(tiny_q4_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "coordinator.daemon", "--model", str(tiny_q4_path), "--bind",
               f"tcp://127.0.0.1:{free_port()}", "--snapshot-mem", "0", "--http", f"127.0.0.1:{port}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (f"coordinator: error: --http 127.0.0.1:{port}: cannot listen "
                                                   f"there: Address already in use")
    bad = subprocess.run([sys.executable, "-m", "fermoe.cli", "serve", "--max-queue", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip() == "fermoe: error: --max-queue 0: must be >= 1"
