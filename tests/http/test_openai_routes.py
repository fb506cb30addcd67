"""OpenAI's routes (/v1/models, /v1/completions, /v1/chat/completions) answered by the real app
in this process, against a scripted coordinator (tests/support/inprocess_frontend.py): exact
bodies, exact event sequences, and the exact Generate the coordinator receives, each derived by
hand from what the coordinator was scripted to send."""
from __future__ import annotations

import hashlib
import importlib.metadata
import time

import pytest

from shared import protocol as P
from shared.grammar import json_schema_text
from shared.sampling import SamplingParams
from tests.support.inprocess_frontend import InProcessFrontend, data_lines, done, error, started, token

NAMES = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "frequency_penalty",
         "presence_penalty", "seed", "logit_bias"]
# OpenAI's system_fingerprint: one per fermoe version and model file (the StatusReply's fingerprint)
FINGERPRINT = "fp_" + hashlib.sha256(f"fermoe {importlib.metadata.version('fermoe')} 0123456789abcdef".encode()
                                     ).hexdigest()[:10]
HI = [{"role": "user", "content": "Hi"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "limit": {"type": "integer"}}}}}]
CALL = ["Hm.</think>\n\nReading.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\n",
        "a.py\n</parameter>\n<parameter=limit>\n20\n</parameter>\n</function>\n</tool_call>"]


def error_body(message, type_="invalid_request_error", param=None, code=None, **extra) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


def envelope(r, obj: str, generate: P.Generate, before: float) -> dict:
    """The fields every body and chunk carries; `created` is checked to be the request's time."""
    streamed = r.headers["content-type"].startswith("text/event-stream")
    created = (data_lines(r.text)[0] if streamed else r.json())["created"]
    assert int(before) <= created <= time.time()
    return {"id": generate.request_id, "object": obj, "created": created, "model": "tiny",
            "system_fingerprint": FINGERPRINT}


def usage(prompt, completion, cached=0, reasoning=0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "completion_tokens_details": {
                "reasoning_tokens": reasoning}}


def text_choice(text, finish=None, logprobs=None) -> dict:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}


def delta(fields, finish=None, logprobs=None) -> dict:
    return {"index": 0, "delta": fields, "logprobs": logprobs, "finish_reason": finish}


# ---- /v1/models ---------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, name", [({}, "tiny"), ({"alias": "qwen"}, "qwen")])
def test_models_list_the_one_model_under_its_name(settings, name):
    """Guards: the model listed under another name than --alias or the coordinator's, or a
    /v1/models/{id} or /models answer unlike the list's entry."""
    before = int(time.time())
    with InProcessFrontend(settings) as fe:
        listed = fe.get("/v1/models").json()
        card = listed["data"][0]
        assert before <= card["created"] <= time.time()
        assert listed == {"object": "list", "data": [{"id": name, "object": "model", "created": card["created"],
                                                      "owned_by": "fermoe", "aliases": [name], "tags": []}]}
        assert fe.get("/v1/models/anything/at-all").json() == card
        assert fe.get("/models").json() == listed


# ---- /v1/completions ----------------------------------------------------------------------------
def test_completion_body_usage_timings_and_the_generate_sent():
    """Guards: text, finish reason, usage (cached tokens), timings or the fingerprint misreported,
    or the Generate losing the request's sampling, its stop string as a list, max_tokens, the
    unset list (the fields left to the server's defaults) or the front end's --max-queue."""
    before = time.time()
    with InProcessFrontend({"max_queue": 3}) as fe:
        fe.coordinator.script(started(5, 2), token(1785, "Hello"), token(5, ""), token(324, " w"),
                              done("length", prompt_tokens=5, cached_prompt_tokens=2, completion_tokens=3,
                                   prefill_ms=3.0, decode_tok_s=40.0))
        r = fe.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0.5, "stop": "END",
                                             "seed": 7, "top_k": -1})
        generate = fe.coordinator.generates[0]
    assert r.status_code == 200 and r.headers["x-request-id"] == generate.request_id
    assert generate.request_id.startswith("cmpl-")
    assert r.json() == envelope(r, "text_completion", generate, before) | {
        "choices": [text_choice("Hello w", "length")], "usage": usage(5, 3, cached=2),
        "timings": {"cache_n": 2, "prompt_n": 3, "prompt_ms": 3.0, "prompt_per_token_ms": 1.0,
                    "prompt_per_second": 1000.0, "predicted_n": 3, "predicted_ms": 75.0,
                    "predicted_per_token_ms": 25.0, "predicted_per_second": 40.0}}
    assert (generate.prompt, generate.max_tokens, generate.stop, generate.max_queue) == ("Hi", 3, ["END"], 3)
    assert generate.sampling == SamplingParams(temperature=0.5, seed=7, top_k=0)     # top_k -1: off
    assert generate.unset == ["top_p", "min_p", "repeat_penalty", "repeat_last_n", "frequency_penalty",
                              "presence_penalty", "logit_bias"]
    assert (generate.logprobs, generate.grammar, generate.messages) == (None, None, None)


def test_completion_stream_with_usage():
    """Guards: a chunk for textless tokens, the finish chunk without its reason or timings, the
    usage chunk missing or carrying choices, `usage: null` missing from the other chunks, or no
    [DONE]."""
    before = time.time()
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(4), token(1785, "Hello"), token(5, ""), token(324, " w"),
                              done("stop", prompt_tokens=4, completion_tokens=3, prefill_ms=2.0, decode_tok_s=30.0))
        r = fe.post("/v1/completions", json={"prompt": [1785], "stream": True,
                                             "stream_options": {"include_usage": True}})
        generate = fe.coordinator.generates[0]
    base = envelope(r, "text_completion", generate, before)
    assert generate.tokens == [1785] and r.headers["x-request-id"] == generate.request_id
    assert data_lines(r.text) == [
        base | {"choices": [text_choice("Hello")], "usage": None},
        base | {"choices": [text_choice(" w")], "usage": None},
        base | {"choices": [text_choice("", "stop")], "usage": None, "timings": {
            "cache_n": 0, "prompt_n": 4, "prompt_ms": 2.0, "prompt_per_token_ms": 0.5, "prompt_per_second": 2000.0,
            "predicted_n": 3, "predicted_ms": 100.0, "predicted_per_token_ms": 33.333, "predicted_per_second": 30.0}},
        base | {"choices": [], "usage": usage(4, 3)},
        "[DONE]"]


def test_completion_logprobs_in_the_legacy_shape_whole_and_streamed(front):
    """Guards: token_logprobs, top_logprobs or text_offset misaligned (the offset not carried from
    chunk to chunk), a token without a logprob (held-back text) listed, or logprobs not asked of
    the coordinator."""
    script = [token(1785, "Hello", -0.5, [(1785, -0.5), (324, -1.5)]), token(324, " w", -1.0, [(324, -1.0)]),
              token(-1, "!"), done("stop", completion_tokens=2)]
    front.coordinator.script(*script)
    body = front.post("/v1/completions", json={"prompt": "Hi", "logprobs": 2}).json()
    assert front.coordinator.generates[0].logprobs == 2
    assert body["choices"] == [text_choice("Hello w!", "stop", {
        "tokens": ["Hello", " w"], "token_logprobs": [-0.5, -1.0], "top_logprobs": [{"Hello": -0.5, " w": -1.5},
                                                                                    {" w": -1.0}],
        "text_offset": [0, 5]})]
    front.coordinator.script(*script)
    events = data_lines(front.post("/v1/completions", json={"prompt": "Hi", "logprobs": 0, "stream": True}).text)
    assert front.coordinator.generates[1].logprobs == 0
    assert [e["choices"] for e in events[:-1]] == [
        [text_choice("Hello", None, {"tokens": ["Hello"], "token_logprobs": [-0.5],
                                     "top_logprobs": [{"Hello": -0.5, " w": -1.5}], "text_offset": [0]})],
        [text_choice(" w", None, {"tokens": [" w"], "token_logprobs": [-1.0], "top_logprobs": [{" w": -1.0}],
                                  "text_offset": [5]})],
        [text_choice("!", None, None)],
        [text_choice("", "stop", None)]]


@pytest.mark.parametrize("finish, reason", [("stop", "stop"), ("length", "length"), ("cancelled", "stop")])
def test_completion_finish_reasons(front, finish, reason):
    """Guards: the coordinator's finish reasons mapped onto OpenAI's wrongly (a cancel is `stop`)."""
    front.coordinator.script(token(1785, "Hello"), done(finish, completion_tokens=1))
    assert front.post("/v1/completions", json={"prompt": "Hi"}).json()["choices"][0]["finish_reason"] == reason


@pytest.mark.parametrize("fields, expected", [
    (dict(echo=True), error_body("echo is not supported", param="echo", code="unsupported_parameter")),
    (dict(suffix="s"), error_body("suffix is not supported", param="suffix", code="unsupported_parameter")),
    (dict(best_of=2), error_body("best_of = 2: only one choice per request is supported", param="best_of",
                                 code="unsupported_parameter")),
    (dict(n=0), error_body("n must be in [1, 16], got 0", param="n", code="invalid_value")),
    (dict(prompt=["a", "b"]), error_body("a batch of 2 prompts: only one prompt per request is supported",
                                         param="prompt", code="unsupported_parameter")),
    (dict(prompt=[]), error_body("Invalid 'prompt': expected a string or a non-empty list of token ids",
                                 param="prompt", code="invalid_value")),
    (dict(stream_options={"include_usage": True}), error_body(
        "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options",
        code="invalid_value")),
    (dict(logprobs=True), error_body("logprobs must be an integer, got True", param="logprobs",
                                     code="invalid_type")),
    (dict(logprobs=21), error_body("logprobs must be in [0, 20], got 21", param="logprobs", code="invalid_value")),
    (dict(temperature=3), error_body("Invalid 'temperature': Expected `float` <= 2.0", param="temperature",
                                     code="invalid_value")),
    (dict(top_p=0.0), error_body("top_p must be in (0, 1], got 0.0", param="top_p", code="invalid_value"))])
def test_bad_completions_are_400s_that_never_reach_the_coordinator(front, fields, expected):
    """Guards: a field we cannot honour accepted silently, or a refusal not naming its field."""
    r = front.post("/v1/completions", json={"prompt": "Hi"} | fields)
    assert (r.status_code, r.json()) == (400, expected) and front.coordinator.generates == []


# ---- /v1/chat/completions -----------------------------------------------------------------------
def test_chat_body_splits_reasoning_from_content_and_counts_reasoning_tokens():
    """Guards: the reasoning the template opened left in the content, usage's reasoning or cached
    tokens lost, or the Generate's messages (developer as system), max_tokens
    (max_completion_tokens first) or turn settings wrong."""
    before = time.time()
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(12, 8), token(1, "Let me"), token(2, " see."), token(3, "</think>"),
                              token(4, "\n\nHello"), token(5, " there."),
                              done("stop", prompt_tokens=12, cached_prompt_tokens=8, completion_tokens=5,
                                   reasoning_tokens=3, prefill_ms=8.0, decode_tok_s=50.0))
        r = fe.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "Be brief"}] + HI,
                                                  "max_completion_tokens": 9, "max_tokens": 4, "min_p": 0.1})
        generate = fe.coordinator.generates[0]
    assert r.status_code == 200 and generate.request_id.startswith("chatcmpl-")
    assert r.json() == envelope(r, "chat.completion", generate, before) | {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there.",
                                             "reasoning_content": "Let me see."},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": usage(12, 5, cached=8, reasoning=3),
        "timings": {"cache_n": 8, "prompt_n": 4, "prompt_ms": 8.0, "prompt_per_token_ms": 2.0,
                    "prompt_per_second": 500.0, "predicted_n": 5, "predicted_ms": 100.0,
                    "predicted_per_token_ms": 20.0, "predicted_per_second": 50.0}}
    assert generate.messages == [P.ChatMessage(role="system", content="Be brief"), P.ChatMessage(role="user",
                                                                                                 content="Hi")]
    assert (generate.max_tokens, generate.sampling, generate.unset) == (9, SamplingParams(min_p=0.1),
                                                                        [n for n in NAMES if n != "min_p"])
    assert (generate.add_generation_prompt, generate.continue_final_message, generate.tools) == (True, False, None)


@pytest.mark.parametrize("fields, settings, message", [
    ({"reasoning_format": "none"}, {}, {"content": "Let me see.</think>\n\nHello there."}),
    ({}, {"reasoning_format": "none"}, {"content": "Let me see.</think>\n\nHello there."}),
    ({"reasoning_format": "both"}, {}, {"content": "Hello there.", "reasoning_content": "Let me see.",
                                        "reasoning": "Let me see."}),
    (NO_THINKING, {}, {"content": "Let me see.</think>\n\nHello there."})])
def test_chat_reasoning_format_and_thinking_off(fields, settings, message):
    """Guards: the request's or the server's reasoning format not applied, `both` not copying the
    reasoning under vLLM's name, or reasoning split out of a turn whose template closed it."""
    with InProcessFrontend(settings) as fe:
        fe.coordinator.script(token(1, "Let me see."), token(2, "</think>"), token(3, "\n\nHello there."),
                              done("stop", completion_tokens=3))
        body = fe.post("/v1/chat/completions", json={"messages": HI} | fields).json()
    assert body["choices"][0]["message"] == {"role": "assistant"} | message


def test_chat_stream_role_reasoning_content_finish_and_usage():
    """Guards: the role chunk missing, reasoning streamed as content, the whitespace after
    </think> sent, the finish chunk without timings, or the usage chunk's counts."""
    before = time.time()
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(12), token(1, "Let me"), token(2, " see."), token(3, "</think>"),
                              token(4, "\n\nHello"), token(5, " there."),
                              done("length", prompt_tokens=12, completion_tokens=5, reasoning_tokens=3,
                                   prefill_ms=6.0, decode_tok_s=25.0))
        r = fe.post("/v1/chat/completions", json={"messages": HI, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        generate = fe.coordinator.generates[0]
    base = envelope(r, "chat.completion.chunk", generate, before) | {"usage": None}
    assert r.headers["x-request-id"] == generate.request_id
    assert data_lines(r.text) == [
        base | {"choices": [delta({"role": "assistant", "content": ""})]},
        base | {"choices": [delta({"reasoning_content": "Let me"})]},
        base | {"choices": [delta({"reasoning_content": " see."})]},
        base | {"choices": [delta({"content": "Hello"})]},
        base | {"choices": [delta({"content": " there."})]},
        base | {"choices": [delta({}, "length")], "timings": {
            "cache_n": 0, "prompt_n": 12, "prompt_ms": 6.0, "prompt_per_token_ms": 0.5, "prompt_per_second": 2000.0,
            "predicted_n": 5, "predicted_ms": 200.0, "predicted_per_token_ms": 40.0, "predicted_per_second": 25.0}},
        base | {"choices": [], "usage": usage(12, 5, reasoning=3)},
        "[DONE]"]


def test_chat_tool_call_whole_and_streamed():
    """Guards: a call left in the content, its arguments not JSON of the schema's types,
    finish_reason `stop` instead of `tool_calls`, content "" instead of null beside calls, a
    streamed call's first delta without its id, type and name, or the tools not sent."""
    with InProcessFrontend() as fe:
        fe.coordinator.script(*[token(i, t) for i, t in enumerate(CALL)], done("stop", completion_tokens=2))
        body = fe.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS}).json()
        fe.coordinator.script(*[token(i, t) for i, t in enumerate(CALL)], done("stop", completion_tokens=2))
        events = data_lines(fe.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS,
                                                                   "stream": True}).text)
        generates = fe.coordinator.generates
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["id"].startswith("call_")
    assert body["choices"] == [{"index": 0, "message": {
        "role": "assistant", "content": "Reading.", "reasoning_content": "Hm.", "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": "read_file",
                                                                "arguments": '{"path": "a.py", "limit": 20}'}}]},
        "logprobs": None, "finish_reason": "tool_calls"}]
    assert generates[0].tools == TOOLS and generates[1].tools == TOOLS
    streamed_id = events[3]["choices"][0]["delta"]["tool_calls"][0]["id"]
    assert [e["choices"] for e in events[1:-2]] == [
        [delta({"reasoning_content": "Hm."})], [delta({"content": "Reading."})],
        [delta({"tool_calls": [{"index": 0, "id": streamed_id, "type": "function", "function": {
            "name": "read_file", "arguments": '{"path": '}}]})],
        [delta({"tool_calls": [{"index": 0, "function": {"arguments": '"a.py", "limit": 20}'}}]})]]
    assert events[-2]["choices"] == [delta({}, "tool_calls")] and events[-1] == "[DONE]"


def test_chat_calls_without_text_have_null_content(front):
    """Guards: content "" instead of OpenAI's null in a message that only calls."""
    front.coordinator.script(token(0, "Hm.</think>\n\n" + CALL[0].split("\n\n", 2)[2]), token(1, CALL[1]),
                             done("stop", completion_tokens=2))
    message = front.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS}).json()["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"], len(message["tool_calls"])) == (None, "Hm.", 1)


def test_chat_stream_sends_text_held_back_for_a_possible_tag_at_the_end(front):
    """Guards: what the parser held back (it could have begun a tag) lost at the end, or sent
    with timings that only timings_per_token asks for."""
    front.coordinator.script(token(1, "Hi"), token(2, " <"), done("stop", completion_tokens=2, decode_tok_s=10.0))
    events = data_lines(front.post("/v1/chat/completions", json={"messages": HI, "stream": True, "tools": TOOLS}
                                   | NO_THINKING).text)
    assert [(e["choices"], "timings" in e) for e in events[:-1]] == [
        ([delta({"role": "assistant", "content": ""})], False), ([delta({"content": "Hi"})], False),
        ([delta({"content": " <"})], False), ([delta({}, "stop")], True)]


@pytest.mark.parametrize("pieces, finish, reason", [
    (CALL, "length", "length"), (CALL, "cancelled", "tool_calls"), (["Hm.</think>\n\nHi."], "cancelled", "stop"),
    (["Hm.</think>\n\nHi."], "length", "length")])
def test_chat_finish_reasons(front, pieces, finish, reason):
    """Guards: a turn the limit cut inside a call called `tool_calls` (the client would run a call
    cut short), or a cancel mapped to anything but stop."""
    front.coordinator.script(*[token(i, t) for i, t in enumerate(pieces)], done(finish, completion_tokens=1))
    body = front.post("/v1/chat/completions", json={"messages": HI, "tools": TOOLS}).json()
    assert body["choices"][0]["finish_reason"] == reason


def test_chat_logprobs_whole_and_streamed(front):
    """Guards: a token's bytes not its own (a part of a character shown whole), top_logprobs
    unlisted, the logprobs of a textless token lost instead of going with the next chunk, or
    top_logprobs not asked of the coordinator."""
    script = [token(1785, "Hello", -0.5, [(1785, -0.5), (324, -1.5)]), token(127, "", -0.25, [(127, -0.25)]),
              token(102, "é", -0.125, []), done("stop", completion_tokens=3)]
    hello = {"token": "Hello", "logprob": -0.5, "bytes": [72, 101, 108, 108, 111]}
    w = {"token": " w", "logprob": -1.5, "bytes": [32, 119]}
    c3 = {"token": "\ufffd", "logprob": -0.25, "bytes": [0xC3]}                  # é is C3 A9, one byte a token
    a9 = {"token": "\ufffd", "logprob": -0.125, "bytes": [0xA9]}
    front.coordinator.script(*script)
    body = front.post("/v1/chat/completions", json={"messages": HI, "logprobs": True, "top_logprobs": 2}
                      | NO_THINKING).json()
    assert front.coordinator.generates[0].logprobs == 2
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Helloé"}, "logprobs": {
        "content": [hello | {"top_logprobs": [hello, w]}, c3 | {"top_logprobs": [c3]}, a9 | {"top_logprobs": []}],
        "refusal": None}, "finish_reason": "stop"}]
    front.coordinator.script(*script)
    events = data_lines(front.post("/v1/chat/completions", json={"messages": HI, "logprobs": True, "stream": True}
                                   | NO_THINKING).text)
    assert front.coordinator.generates[1].logprobs == 0
    assert [e["choices"] for e in events[:-1]] == [
        [delta({"role": "assistant", "content": ""})],
        [delta({"content": "Hello"}, None, {"content": [hello | {"top_logprobs": [hello, w]}], "refusal": None})],
        [delta({"content": "é"}, None, {"content": [c3 | {"top_logprobs": [c3]}, a9 | {"top_logprobs": []}],
                                        "refusal": None})],
        [delta({}, "stop", None)]]


@pytest.mark.parametrize("fields, constraint", [
    ({"grammar": 'root ::= "a"'}, P.Constraint(kind="gbnf", text='root ::= "a"')),
    ({"response_format": {"type": "json_object"}},
     P.Constraint(kind="json_schema", text=json_schema_text({"type": "object"}))),
    ({"response_format": {"type": "text"}, "stop": ["x", "y"]}, None)])
def test_chat_constraints_and_stops_reach_the_coordinator(front, fields, constraint):
    """Guards: a grammar or response_format dropped on its way to the coordinator, or stop lists cut."""
    front.coordinator.script(done("stop"))
    assert front.post("/v1/chat/completions", json={"messages": HI} | fields).status_code == 200
    generate = front.coordinator.generates[0]
    assert (generate.grammar, generate.stop) == (constraint, fields.get("stop", []))


@pytest.mark.parametrize("fields, expected", [
    ({"messages": None}, error_body("Invalid 'messages': Expected `array`, got `null`", param="messages",
                                    code="invalid_value")),
    ({"messages": HI, "top_logprobs": 2}, error_body("top_logprobs needs logprobs: true", param="top_logprobs",
                                                     code="invalid_value")),
    ({"messages": HI, "logprobs": 3}, error_body("logprobs must be a boolean, got 3", param="logprobs",
                                                 code="invalid_type")),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, error_body("top_logprobs must be in [0, 20], got 21",
                                                                       param="top_logprobs", code="invalid_value")),
    ({"messages": HI, "logit_bias": {"one": 5}}, error_body("logit_bias keys are token ids, got 'one'",
                                                            param="logit_bias", code="invalid_value")),
    ({"messages": HI, "reasoning_format": "raw"}, error_body(
        "reasoning_format 'raw': expected one of deepseek, auto, none, both", param="reasoning_format",
        code="invalid_value")),
    ({"messages": HI, "grammar": "root ::= x", "response_format": {"type": "json_object"}}, error_body(
        "grammar and response_format: give one", param="grammar", code="invalid_value")),
    ({"messages": [{"role": "robot", "content": "x"}]}, error_body(
        "Invalid 'messages[0].role': Invalid enum value 'robot'", param="messages[0].role", code="invalid_value"))])
def test_bad_chats_are_400s_that_never_reach_the_coordinator(front, fields, expected):
    """Guards: a chat field we cannot honour accepted silently, or a refusal not naming its field."""
    r = front.post("/v1/chat/completions", json=fields)
    assert (r.status_code, r.json()) == (400, expected) and front.coordinator.generates == []


# ---- the coordinator's refusals and failures ----------------------------------------------------
@pytest.mark.parametrize("refusal, status, expected, headers", [
    (error("the prompt is 300 tokens, over the context's 256", code="context_length_exceeded", n_prompt_tokens=300,
           n_ctx=256), 400, error_body("the prompt is 300 tokens, over the context's 256", param="messages",
                                       code="context_length_exceeded", n_prompt_tokens=300, n_ctx=256), {}),
    (error("this client has 3 requests waiting", code="queue_full"), 503,
     error_body("this client has 3 requests waiting", "server_error", code="queue_full"), {"retry-after": "1"}),
    (error("no worker can run it", code="unavailable"), 503,
     error_body("no worker can run it", "server_error", code="unavailable"), {}),
    (error("the grammar does not compile", code="invalid_grammar"), 400,
     error_body("the grammar does not compile", code="invalid_grammar"), {})])
def test_a_chat_the_coordinator_refuses_is_its_status_whole_and_streamed(front, refusal, status, expected, headers):
    """Guards: a refusal before the first token answered 200 (a stream the client cannot tell
    failed), the wrong status for a full queue or no worker, or a full queue without Retry-After."""
    for stream in (False, True):
        front.coordinator.script(refusal)
        r = front.post("/v1/chat/completions", json={"messages": HI, "stream": stream})
        assert (r.status_code, r.json()) == (status, expected)
        assert {k: r.headers[k] for k in headers} == headers and r.headers["content-type"] == "application/json"


def test_a_chat_that_fails_is_a_500_whole_and_an_error_chunk_then_done_streamed(front):
    """Guards: a failed generation answered as a success, or its stream not closed with the error
    object and [DONE]."""
    front.coordinator.script(token(1, "Hm"), done("error", error="the worker died"))
    r = front.post("/v1/chat/completions", json={"messages": HI})
    assert (r.status_code, r.json()) == (500, error_body("the worker died", "server_error"))
    front.coordinator.script(token(1, "Hm"), done("error", error="the worker died"))
    events = data_lines(front.post("/v1/chat/completions", json={"messages": HI, "stream": True}).text)
    assert [e if e == "[DONE]" or "error" in e else e["choices"] for e in events] == [
        [delta({"role": "assistant", "content": ""})], [delta({"reasoning_content": "Hm"})],
        error_body("the worker died", "server_error"), "[DONE]"]
