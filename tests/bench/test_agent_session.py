"""The session recorder and replayer (bench/agent_session.py) against a stub server that
answers in each API's shape: what passes through is unchanged, and each record's usage,
errors and time to first token are read from the answer as each API writes them."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from bench.agent_session import Recorder, load, replay, session_summary, usage_of
from tests.support.serving_harness import free_port, wait_until


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


ANSWERS = {
    "/v1/messages": sse({"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 0,
                                                                         "cache_read_input_tokens": 30}}},
                        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}},
                        {"type": "message_delta", "usage": {"input_tokens": 5, "output_tokens": 2,
                                                            "cache_read_input_tokens": 30}}),
    "/v1/responses": sse({"type": "response.created", "response": {"usage": None}},
                         {"type": "response.output_text.delta", "delta": "Hi"},
                         {"type": "response.completed", "response": {"usage": {
                             "input_tokens": 35, "input_tokens_details": {"cached_tokens": 30}, "output_tokens": 2,
                             "total_tokens": 37}}}),
    "/v1/chat/completions": sse({"choices": [{"delta": {"role": "assistant"}}]},
                                {"choices": [{"delta": {"content": "Hi"}}]},
                                {"choices": [], "usage": {"prompt_tokens": 35, "completion_tokens": 2,
                                                          "prompt_tokens_details": {"cached_tokens": 30}}}) + b"data: [DONE]\n\n",
    "/failing": sse({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
}


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Stub.seen.append((self.path, self.headers.get("anthropic-beta"), json.loads(body)))
        if self.path.startswith("/bad"):
            data, status, kind = b'{"error": {"message": "no"}}', 400, "application/json"
        else:
            data, status, kind = ANSWERS[self.path.partition("?")[0]], 200, "text/event-stream"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def upstream():
    Stub.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_recorder_passes_requests_through_and_reads_each_apis_usage(upstream, tmp_path):
    session = tmp_path / "s.jsonl"
    with Recorder(upstream, session) as rec:
        for path in ("/v1/messages?beta=true", "/v1/responses", "/v1/chat/completions", "/failing"):
            r = httpx.post(rec.url + path, json={"stream": True, "n": path}, headers={"anthropic-beta": "x-1",
                                                                                     "x-api-key": "secret"})
            assert r.status_code == 200 and r.content == ANSWERS[path.partition("?")[0]]
        # a body sent in chunks, as some clients send one; and a refusal, passed on as it is
        r = httpx.post(rec.url + "/bad", content=iter([b'{"stream"', b': false}']))
        assert r.status_code == 400 and r.json() == {"error": {"message": "no"}}
    assert [s[2] for s in Stub.seen][-1] == {"stream": False}
    records = load(session)
    assert records == rec.records
    want = {"prompt_tokens": 35, "cached_tokens": 30, "completion_tokens": 2}
    assert [r["usage"] for r in records[:3]] == [want] * 3
    assert records[0]["query"] == "beta=true" and records[0]["headers"] == {"anthropic-beta": "x-1"}
    assert "secret" not in session.read_text()                  # the API key is never kept
    assert all(r["ttft_s"] is not None and not r["errors"] for r in records[:3])
    assert records[3]["errors"] == [{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}]
    assert records[3]["ttft_s"] is None and records[4]["status"] == 400

    Stub.seen = []
    rows = replay(upstream, records)
    assert [s[:2] for s in Stub.seen] == [("/v1/messages?beta=true", "x-1"), ("/v1/responses", "x-1"),
                                          ("/v1/chat/completions", "x-1"), ("/failing", "x-1"), ("/bad", None)]
    assert [r["usage"] for r in rows[:3]] == [want] * 3
    summary = session_summary(rows)
    assert summary["failed"] == [3, 4] and summary["prompt_tokens"] == 105 and summary["cached_tokens"] == 90


def test_usage_of_a_whole_answer():
    assert usage_of([{"usage": {"input_tokens": 4, "output_tokens": 1, "cache_read_input_tokens": 6}}]) == \
        {"prompt_tokens": 10, "cached_tokens": 6, "completion_tokens": 1}
    assert usage_of([{"choices": []}]) is None


def test_bench_agent_record_runs_until_interrupted(upstream, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fermoe.cli", "bench", "agent", "--record", str(tmp_path / "s.jsonl"),
                             "--upstream", upstream, "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def sent():
        try:
            return httpx.post(f"http://127.0.0.1:{port}/v1/responses", json={"stream": True}).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(sent, 60, "the recorder did not start")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(out)["requests"] == 1 and len(load(tmp_path / "s.jsonl")) == 1


def test_bench_agent_refuses_a_missing_session_or_upstream(tmp_path):
    for args, message in ((["tiny", "--session", str(tmp_path / "none.jsonl")], "no such file"),
                          (["--record", str(tmp_path / "s.jsonl")], "--record needs --upstream"),
                          ([], "the model to serve is missing")):
        r = subprocess.run([sys.executable, "-m", "fermoe.cli", "bench", "agent", *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr
