"""frontend/streaming.py's details by exact value: the raw ASGI messages of a JSON answer, a
stream's headers, llama-server's timings_per_token on chat's chunks (a held-back piece's
chunk included), a stream whose tokens come apart, and a failure without a message."""
from __future__ import annotations

import asyncio

from frontend.streaming import send_json
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
