"""frontend/streaming.py's details by exact value: the raw ASGI messages of a JSON answer, a
stream's headers, llama-server's timings_per_token on chat's chunks (a held-back piece's
chunk included), a stream whose tokens come apart, a failure without a message, a stream's own
ASGI messages, and the latency counted in /metrics."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from frontend.streaming import send_json
from shared import protocol as P
from tests.support.inprocess_frontend import data_lines, done, token

HI = [{"role": "user", "content": "Hi"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
PARTIAL = ["predicted_ms", "predicted_n", "predicted_per_second", "predicted_per_token_ms", "prompt_ms"]
FINAL = ["cache_n", "predicted_ms", "predicted_n", "predicted_per_second", "predicted_per_token_ms", "prompt_ms",
         "prompt_n", "prompt_per_second", "prompt_per_token_ms"]


def test_send_json_writes_lower_case_header_names():
    """Guards: header names sent in another case than ASGI's lower case (servers may pass them
    on as given), or a header value not a string's bytes."""
    sent = []

    async def send(message):
        sent.append(message)
    asyncio.run(send_json(send, 503, {"a": 1}, {"Retry-After": 1, "X-Request-Id": "r"}))
    assert sent == [{"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"retry-after", b"1"), (b"x-request-id", b"r")]},
        {"type": "http.response.body", "body": b'{"a":1}'}]


def test_a_stream_is_not_cached(front):
    """Guards: a stream sent without cache-control: no-cache (a proxy may buffer it whole)."""
    front.coordinator.script(token(1, "Hi"), done("stop", completion_tokens=1))
    r = front.post("/v1/chat/completions", json={"messages": HI, "stream": True})
    assert (r.headers["cache-control"], r.headers["content-type"]) == ("no-cache", "text/event-stream; charset=utf-8")


def test_chat_chunks_carry_timings_per_token_and_tokens_apart_all_arrive(front):
    """Guards: timings_per_token not honoured on chat's chunks of text, or on the chunk of a
    piece held back to the end (under another key, or not at all), the finish chunk not
    carrying the final timings, or a stream whose second token comes after the first was
    sent losing its tail."""
    front.coordinator.script(token(1, "Hi"), 0.05, token(2, " <"), done("stop", completion_tokens=2))
    events = data_lines(front.post("/v1/chat/completions", json={
        "messages": HI, "stream": True, "tools": TOOLS, "timings_per_token": True} | NO_THINKING).text)
    assert events[-1] == "[DONE]"
    assert [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"], sorted(e.get("timings", {})),
             e.get("timings", {}).get("predicted_n")) for e in events[:-1]] == [
        ({"role": "assistant", "content": ""}, None, [], None),
        ({"content": "Hi"}, None, PARTIAL, 1),
        ({"content": " <"}, None, PARTIAL, 2),
        ({}, "stop", FINAL, 2)]


def test_a_failure_without_a_message_says_the_request_failed(front):
    """Guards: a failed generation answered with an empty or other message when the
    coordinator's Done gave none."""
    front.coordinator.script(token(1, "Hm"), done("error"))
    r = front.post("/v1/chat/completions", json={"messages": HI})
    assert (r.status_code, r.json()) == (500, {"error": {"message": "the request failed", "type": "server_error",
                                                         "param": None, "code": None}})


def test_a_whole_answer_waits_for_its_first_reply_past_the_streams_deadline(front, monkeypatch):
    """Guards: a request that is not streamed given a stream's headers (an event stream, not
    its JSON) when its first reply takes longer than a stream's headers wait."""
    from frontend import streaming
    monkeypatch.setattr(streaming, "HEADERS_AFTER_S", 0.05)
    front.coordinator.script(0.3, token(1, "Hi"), done("stop", prompt_tokens=3, completion_tokens=1))
    r = front.post("/v1/chat/completions", json={"messages": HI} | NO_THINKING)
    assert (r.status_code, r.headers["content-type"], r.json()["choices"][0]["message"]["content"]) == (
        200, "application/json", "Hi")


class _Closed:
    """An upstream whose request has ended: nothing left to cancel."""
    def cancel(self, rid, on_done=None):
        return False


def asgi_messages(streaming: bool, replies: list, delay: float = 0.0, metrics=None, upstream=None,
                  leaves: bool = False) -> list[dict]:
    """The ASGI messages a GenerationResponse sends for `replies` (pushed after `delay` s), its
    client never leaving (or, with `leaves`, gone at once); 5 s at most."""
    from frontend.formats import TextFormat
    from frontend.metrics import Metrics
    from frontend.streaming import GenerationResponse
    from frontend.upstream import RequestStream

    async def go():
        stream, sent = RequestStream("r"), []

        async def receive():
            if not leaves:
                await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        async def feed():
            await asyncio.sleep(delay)
            for reply in replies:
                stream.push(reply)
        feeding = asyncio.ensure_future(feed())
        await GenerationResponse(upstream or _Closed(), stream, TextFormat(), "m", streaming, False,
                                 metrics or Metrics())(None, receive, send)
        await feeding
        return sent
    try:
        return asyncio.run(asyncio.wait_for(go(), 5))
    except TimeoutError:
        raise AssertionError("the response did not end in 5 s: nothing woke its wait for the next reply") from None


STREAM_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                  (b"x-request-id", b"r")]


def test_a_streams_asgi_messages_have_lower_case_headers_and_end_with_more_body_false():
    """Guards: a stream's own header names in another case than ASGI's lower case, or its last
    body part's more_body not False (None: a server may wait for more)."""
    sent = asgi_messages(True, [P.Token(request_id="r", token=1, text="Hi"),
                                P.Done(request_id="r", finish_reason="stop", completion_tokens=1)])
    assert [(m["type"], m.get("headers"), m.get("more_body")) for m in sent] == [
        ("http.response.start", STREAM_HEADERS, None), ("http.response.body", None, False)]


def test_a_refusal_after_a_streams_headers_ends_it_with_more_body_false(monkeypatch):
    """Guards: the error events of a refusal that came after the headers sent with more_body
    other than False, or not as chat's error then [DONE]."""
    from frontend import streaming
    monkeypatch.setattr(streaming, "HEADERS_AFTER_S", 0.01)
    sent = asgi_messages(True, [P.Error(request_id="r", message="no worker", code="unavailable")], delay=0.2)
    assert [(m["type"], m.get("headers"), m.get("body"), m.get("more_body")) for m in sent] == [
        ("http.response.start", STREAM_HEADERS, None, None), ("http.response.body", None, b"", True),
        ("http.response.body", None, b'data: {"error":{"message":"no worker","type":"server_error","param":null,'
                                     b'"code":"unavailable"}}\n\ndata: [DONE]\n\n', False)]


def test_a_requests_latency_is_counted_from_its_arrival(monkeypatch):
    """Guards: the end-to-end latency in /metrics not the time since the request arrived (the
    clock's readings added, say)."""
    from frontend import streaming
    from frontend.metrics import Metrics
    clock = iter(1000.0 + 0.25 * i for i in range(100))       # each reading 0.25 s after the last
    monkeypatch.setattr(streaming, "time", SimpleNamespace(time=time.time, perf_counter=lambda: next(clock)))
    metrics = Metrics()
    asgi_messages(False, [P.Token(request_id="r", token=1, text="Hi"),
                          P.Done(request_id="r", finish_reason="stop", completion_tokens=1)], metrics=metrics)
    # read at arrival, at the token, at the Done: 0.5 s
    assert metrics.registry.get_sample_value("fermoe:e2e_request_latency_seconds_sum") == 0.5


def test_first_token_and_inter_token_latencies_are_measured_from_the_right_readings(monkeypatch):
    """Guards: time to first token or inter-token latency not a difference of the clock's
    readings (added), the last token's time not kept (every token a first), or token id 0 not
    timed as a token."""
    from frontend import streaming
    from frontend.metrics import Metrics
    clock = iter(1000.0 + 0.25 * i for i in range(100))
    monkeypatch.setattr(streaming, "time", SimpleNamespace(time=time.time, perf_counter=lambda: next(clock)))
    metrics = Metrics()
    asgi_messages(False, [P.Token(request_id="r", token=0, text="a"), P.Token(request_id="r", token=1, text="b"),
                          P.Done(request_id="r", finish_reason="stop", completion_tokens=2)], metrics=metrics)
    get = metrics.registry.get_sample_value
    assert [get(f"fermoe:{name}_seconds_{part}") for name in ("time_to_first_token", "inter_token_latency")
            for part in ("sum", "count")] == [0.25, 1.0, 0.25, 1.0]


def test_a_client_that_leaves_cancels_its_own_request_and_counts_no_done_it_lacks():
    """Guards: the disconnect watch cancelling another request id than its own, or, for a request
    that had no Done yet and nothing left to cancel, counting a Done it does not have (which
    fails the watch before it ends the response: the response then waits forever)."""
    class Recording(_Closed):
        def __init__(self):
            self.cancelled = []

        def cancel(self, rid, on_done=None):
            self.cancelled.append(rid)
            return False
    upstream = Recording()
    from frontend.metrics import Metrics
    metrics = Metrics()
    assert asgi_messages(True, [], upstream=upstream, leaves=True, metrics=metrics) == []
    assert upstream.cancelled == ["r", "r"]         # the watch's, then the response's own at its end
    assert metrics.registry.get_sample_value("fermoe:e2e_request_latency_seconds_count") == 0.0
