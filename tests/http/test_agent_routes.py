"""The Responses API (/v1/responses) and Anthropic's Messages API (/v1/messages,
/v1/messages/count_tokens) answered by the real app in this process, against a scripted
coordinator (tests/support/inprocess_frontend.py): exact bodies and event sequences, refusals
before and after the headers in each API's error shape, and the Generate the coordinator gets;
each expected value derived by hand from what the coordinator was scripted to send."""
from __future__ import annotations

import hashlib
import time

import pytest

from frontend import streaming
from shared import protocol as P
from shared.gguf_file import GGUFFile
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from tests.support.inprocess_frontend import MODEL_PATH, InProcessFrontend, done, error, named_events, started, token

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}
CALL = ["Hm.</think>\n\nReading.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\n",
        "a.py\n</parameter>\n<parameter=limit>\n20\n</parameter>\n</function>\n</tool_call>"]
THINK_THEN_TEXT = [token(1, "Hm."), token(2, "</think>"), token(3, "\n\nHi"), token(4, " there.")]
TOO_LONG = dict(code="context_length_exceeded", n_prompt_tokens=300, n_ctx=256)
MISSING_KEY = ("You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
               "(Authorization: Bearer YOUR_KEY) or in x-api-key.")


def calls():
    return [token(i, t) for i, t in enumerate(CALL)]


def signature(text: str) -> str:
    return "fermoe-" + hashlib.sha256(text.encode()).hexdigest()[:32]


@pytest.fixture
def slow_headers(monkeypatch):
    """A streamed request's headers go out after 50 ms without a reply (a second, in service)."""
    monkeypatch.setattr(streaming, "HEADERS_AFTER_S", 0.05)


# ---- /v1/responses ------------------------------------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "parameters": SCHEMA}]


def response_body(rid, created, status, output, usage, **fields) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "instructions": None, "max_output_tokens": None, "model": "tiny",
            "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": None,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": None,
            "truncation": "disabled", "metadata": {}, "user": None, "usage": usage} | fields


def responses_usage(prompt, completion, cached=0, reasoning=0) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


def test_responses_output_items_usage_and_the_generate_sent():
    """Guards: an output item misshapen (reasoning, message, function_call), a request field not
    echoed, usage's cached or reasoning tokens wrong, or the Generate losing the instructions,
    max_output_tokens, temperature or tools."""
    before = int(time.time())
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(12, 8), *calls(), done("stop", prompt_tokens=12, cached_prompt_tokens=8,
                                                             completion_tokens=2))
        r = fe.post("/v1/responses", json={"model": "m", "input": "Hi", "instructions": "Be brief",
                                           "max_output_tokens": 9, "temperature": 0.5, "tools": RESPONSES_TOOLS,
                                           "metadata": {"k": "v"}, "reasoning": {"effort": "high"}})
        generate = fe.coordinator.generates[0]
    body = r.json()
    assert r.status_code == 200 and r.headers["x-request-id"] == generate.request_id
    ids = [item["id"] for item in body["output"]]
    assert [i[:3] for i in ids] == ["rs_", "msg", "fc_"] and ids[1].startswith("msg_") and len(set(ids)) == 3
    call_id = body["output"][2]["call_id"]
    assert call_id.startswith("call_") and generate.request_id.startswith("resp_")
    assert before <= body["created_at"] <= time.time()
    assert body == response_body(generate.request_id, body["created_at"], "completed", [
        {"id": ids[0], "status": "completed", "type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"id": ids[1], "status": "completed", "type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Reading.", "annotations": [], "logprobs": []}]},
        {"id": ids[2], "status": "completed", "type": "function_call", "call_id": call_id,
         "arguments": '{"path": "a.py", "limit": 20}', "name": "read_file"}],
        responses_usage(12, 2, cached=8, reasoning=1), instructions="Be brief", max_output_tokens=9,
        temperature=0.5, tools=RESPONSES_TOOLS, metadata={"k": "v"}, reasoning={"effort": "high", "summary": None})
    assert generate.messages == [P.ChatMessage(role="system", content="Be brief"),
                                 P.ChatMessage(role="user", content="Hi")]
    assert (generate.max_tokens, generate.sampling, generate.chat_template_kwargs) == (
        9, SamplingParams(temperature=0.5), {"enable_thinking": True})
    assert generate.tools == [{"type": "function", "function": {"name": "read_file", "parameters": SCHEMA}}]


def test_responses_cut_by_the_limit_are_incomplete(front):
    """Guards: a turn the limit cut reported completed, without incomplete_details."""
    front.coordinator.script(*THINK_THEN_TEXT, done("length", prompt_tokens=3, completion_tokens=4))
    body = front.post("/v1/responses", json={"input": "Hi"}).json()
    assert (body["status"], body["incomplete_details"], body["usage"]) == (
        "incomplete", {"reason": "max_output_tokens"}, responses_usage(3, 4, reasoning=2))
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]


def test_responses_reasoning_tokens_count_sampled_tokens_only(front):
    """Guards: the text held back to the end (token -1, no sampled token) counted as a reasoning token."""
    front.coordinator.script(token(1, "Hm."), token(2, " Let"), token(-1, " me"), done("length", completion_tokens=2))
    body = front.post("/v1/responses", json={"input": "Hi"}).json()
    assert (body["usage"]["output_tokens_details"], body["output"][0]["content"]) == (
        {"reasoning_tokens": 2}, [{"type": "reasoning_text", "text": "Hm. Let me"}])


def test_responses_stream_events_in_their_exact_order():
    """Guards: an event missing, out of order or misnumbered (sequence_number), a block not
    closed before the next opens, a delta on the wrong item, or the final event not carrying the
    whole response and its usage."""
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(5), *THINK_THEN_TEXT, done("stop", prompt_tokens=5, completion_tokens=4))
        r = fe.post("/v1/responses", json={"input": "Hi", "stream": True})
        rid = fe.coordinator.generates[0].request_id
    events = named_events(r.text)
    created = events[0][1]["response"]["created_at"]
    rs, msg = events[2][1]["item"]["id"], events[8][1]["item"]["id"]
    assert rs.startswith("rs_") and msg.startswith("msg_")
    snapshot = response_body(rid, created, "in_progress", [], None)
    reasoning = {"type": "reasoning_text", "text": "Hm."}
    text = {"type": "output_text", "text": "Hi there.", "annotations": [], "logprobs": []}
    at_rs, at_msg = {"item_id": rs, "output_index": 0}, {"item_id": msg, "output_index": 1}
    expected = [
        ("response.created", {"response": snapshot}), ("response.in_progress", {"response": snapshot}),
        ("response.output_item.added", {"output_index": 0, "item": {
            "id": rs, "status": "in_progress", "type": "reasoning", "summary": [], "content": []}}),
        ("response.content_part.added", at_rs | {"content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
        ("response.reasoning_text.delta", at_rs | {"content_index": 0, "delta": "Hm."}),
        ("response.reasoning_text.done", at_rs | {"content_index": 0, "text": "Hm."}),
        ("response.content_part.done", at_rs | {"content_index": 0, "part": reasoning}),
        ("response.output_item.done", {"output_index": 0, "item": {
            "id": rs, "status": "completed", "type": "reasoning", "summary": [], "content": [reasoning]}}),
        ("response.output_item.added", {"output_index": 1, "item": {
            "id": msg, "status": "in_progress", "type": "message", "role": "assistant", "content": []}}),
        ("response.content_part.added", at_msg | {"content_index": 0, "part": text | {"text": ""}}),
        ("response.output_text.delta", at_msg | {"content_index": 0, "delta": "Hi", "logprobs": []}),
        ("response.output_text.delta", at_msg | {"content_index": 0, "delta": " there.", "logprobs": []}),
        ("response.output_text.done", at_msg | {"content_index": 0, "text": "Hi there.", "logprobs": []}),
        ("response.content_part.done", at_msg | {"content_index": 0, "part": text}),
        ("response.output_item.done", {"output_index": 1, "item": {
            "id": msg, "status": "completed", "type": "message", "role": "assistant", "content": [text]}}),
        ("response.completed", {"response": response_body(rid, created, "completed", [
            {"id": rs, "status": "completed", "type": "reasoning", "summary": [], "content": [reasoning]},
            {"id": msg, "status": "completed", "type": "message", "role": "assistant", "content": [text]}],
            responses_usage(5, 4, reasoning=2))})]
    assert events == [(name, {"type": name, "sequence_number": i} | data) for i, (name, data) in enumerate(expected)]


def test_responses_stream_of_a_call(front):
    """Guards: a call's arguments not streamed as function_call_arguments events, or its item
    without call_id and name."""
    front.coordinator.script(*calls(), done("stop", completion_tokens=2))
    events = named_events(front.post("/v1/responses", json={"input": "Hi", "stream": True,
                                                            "tools": RESPONSES_TOOLS}).text)
    fc = [data for name, data in events if name == "response.output_item.added"][2]["item"]
    at = {"item_id": fc["id"], "output_index": 2}
    tail = [(name, {k: v for k, v in data.items() if k not in ("type", "sequence_number")})
            for name, data in events if data.get("output_index") == 2]
    assert tail == [
        ("response.output_item.added", {"output_index": 2, "item": fc}),
        ("response.function_call_arguments.delta", at | {"delta": '{"path": '}),
        ("response.function_call_arguments.delta", at | {"delta": '"a.py", "limit": 20}'}),
        ("response.function_call_arguments.done", at | {"name": "read_file",
                                                        "arguments": '{"path": "a.py", "limit": 20}'}),
        ("response.output_item.done", {"output_index": 2, "item": fc | {
            "status": "completed", "arguments": '{"path": "a.py", "limit": 20}'}})]
    assert fc == {"id": fc["id"], "status": "in_progress", "type": "function_call", "call_id": fc["call_id"],
                  "arguments": "", "name": "read_file"}


def test_a_responses_refusal_before_the_headers_is_its_status_and_after_them_response_failed(front, slow_headers):
    """Guards: a refusal after response.created lost (the client waits for an end that never
    comes), or not in response.failed with the refusal's code; before the headers, anything
    but the 400 naming `input`."""
    front.coordinator.script(error("the prompt is too long", **TOO_LONG))
    r = front.post("/v1/responses", json={"input": "Hi", "stream": True})
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": "the prompt is too long", "type": "invalid_request_error", "param": "input",
        "code": "context_length_exceeded", "n_prompt_tokens": 300, "n_ctx": 256}})
    front.coordinator.script(0.3, error("the prompt is too long", **TOO_LONG))
    r = front.post("/v1/responses", json={"input": "Hi", "stream": True})
    rid = front.coordinator.generates[1].request_id
    events = named_events(r.text)
    created = events[0][1]["response"]["created_at"]
    snapshot = response_body(rid, created, "in_progress", [], None)
    assert r.status_code == 200 and events == [
        ("response.created", {"type": "response.created", "sequence_number": 0, "response": snapshot}),
        ("response.in_progress", {"type": "response.in_progress", "sequence_number": 1, "response": snapshot}),
        ("response.failed", {"type": "response.failed", "sequence_number": 2, "response": response_body(
            rid, created, "failed", [], None, error={"code": "context_length_exceeded",
                                                      "message": "the prompt is too long"})})]


def test_a_responses_refusal_without_a_code_after_the_headers_is_a_server_error(front, slow_headers):
    """Guards: response.failed's error without a code (the Responses API always names one) when
    the coordinator's refusal came after the headers and gave none."""
    front.coordinator.script(0.3, error("no worker can run it"))
    events = named_events(front.post("/v1/responses", json={"input": "Hi", "stream": True}).text)
    assert events[-1][0] == "response.failed" and events[-1][1]["response"]["error"] == {
        "code": "server_error", "message": "no worker can run it"}


def test_a_responses_generation_that_fails_is_response_failed(front):
    """Guards: a failed generation's stream ending as completed, or its whole answer a 200."""
    front.coordinator.script(token(1, "Hm"), done("error", error="the worker died"))
    r = front.post("/v1/responses", json={"input": "Hi"})
    assert (r.status_code, r.json()) == (500, {"error": {"message": "the worker died", "type": "server_error",
                                                         "param": None, "code": None}})
    front.coordinator.script(token(1, "Hm"), done("error", error="the worker died"))
    name, last = named_events(front.post("/v1/responses", json={"input": "Hi", "stream": True}).text)[-1]
    assert (name, last["response"]["status"], last["response"]["error"], last["response"]["usage"]) == (
        "response.failed", "failed", {"code": "server_error", "message": "the worker died"}, None)


def test_a_responses_stream_that_fails_keeps_the_items_it_closed_and_says_the_request_failed(front):
    """Guards: response.failed dropping the output items the stream had already closed (the
    reasoning, when the failure came during the text), or, when the failure has no message,
    its error saying anything but that the request failed."""
    front.coordinator.script(*THINK_THEN_TEXT, done("error"))
    name, last = named_events(front.post("/v1/responses", json={"input": "Hi", "stream": True}).text)[-1]
    output = last["response"]["output"]
    assert (name, last["response"]["error"]) == ("response.failed", {"code": "server_error",
                                                                    "message": "the request failed"})
    assert [(o["type"], o["status"], o["content"]) for o in output] == [
        ("reasoning", "completed", [{"type": "reasoning_text", "text": "Hm."}])]


def test_a_responses_stream_writes_utf_8_and_echoes_parallel_tool_calls_false(front):
    """Guards: an event's text escaped to ASCII (the API writes UTF-8), or a request's
    parallel_tool_calls: false answered as true."""
    front.coordinator.script(token(1, "héllo"), done("stop", prompt_tokens=2, completion_tokens=1))
    r = front.post("/v1/responses", json={"input": "Hi", "stream": True, "parallel_tool_calls": False})
    assert '"delta": "héllo"' in r.text
    assert named_events(r.text)[-1][1]["response"]["parallel_tool_calls"] is False


def test_a_responses_stream_whose_tokens_come_apart_sends_them_all(front):
    """Guards: the events written before a pause in the tokens lost, or the stream broken there
    (BlockResponse's send of what has come so far)."""
    front.coordinator.script(token(1, "Hi"), 0.05, token(2, " there"), done("stop", prompt_tokens=2,
                                                                              completion_tokens=2))
    events = named_events(front.post("/v1/responses", json={"input": "Hi", "stream": True}).text)
    deltas = [e["delta"] for name, e in events if name.endswith("_text.delta")]
    assert (deltas, events[-1][0]) == (["Hi", " there"], "response.completed")


@pytest.mark.parametrize("body, param, message, code", [
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id",
     "previous_response_id: fermoe keeps no responses: send the whole conversation in `input` (with store: false)",
     "invalid_value"),
    ({"input": "Hi", "background": True}, "background", "background: background responses are not supported",
     "unsupported_parameter"),
    ({"input": "Hi", "top_logprobs": 2}, "top_logprobs", "top_logprobs: logprobs are not supported on /v1/responses "
     "yet (/v1/chat/completions has them)", "unsupported_parameter"),
    ({"model": "m"}, "input", "Missing required parameter: 'input'.", "missing_required_parameter")])
def test_bad_responses_requests_are_400s(front, body, param, message, code):
    """Guards: a request fermoe cannot serve (a stored response, background) accepted, or its
    refusal not in OpenAI's shape naming the field."""
    r = front.post("/v1/responses", json=body)
    assert (r.status_code, r.json()) == (400, {"error": {"message": message, "type": "invalid_request_error",
                                                         "param": param, "code": code}})
    assert front.coordinator.generates == []


# ---- /v1/messages -------------------------------------------------------------------------------
ANTHROPIC = {"model": "m", "max_tokens": 64, "system": "Be brief", "messages": [{"role": "user", "content": "Hi"}]}
ANTHROPIC_TOOLS = [{"name": "read_file", "input_schema": SCHEMA}]


def anthropic_usage(fresh, output, cached=0) -> dict:
    return {"input_tokens": fresh, "output_tokens": output, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def test_messages_content_blocks_usage_and_the_generate_sent():
    """Guards: a block misshapen (thinking without its signature, tool_use input not the
    arguments object), stop_reason not tool_use, usage counting cached tokens as input, or the
    Generate losing system, max_tokens, stop_sequences, top_k or the tools."""
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(12, 8), *calls(), done("stop", prompt_tokens=12, cached_prompt_tokens=8,
                                                             completion_tokens=2))
        r = fe.post("/v1/messages", json=ANTHROPIC | {"tools": ANTHROPIC_TOOLS, "stop_sequences": ["END"],
                                                      "top_k": 5})
        generate = fe.coordinator.generates[0]
    body = r.json()
    use_id = body["content"][2]["id"]
    assert use_id.startswith("toolu_") and len(use_id) == 30 and generate.request_id.startswith("msg_")
    assert r.status_code == 200 and body == {
        "id": generate.request_id, "type": "message", "role": "assistant", "model": "tiny", "content": [
            {"type": "thinking", "thinking": "Hm.", "signature": signature("Hm.")},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": use_id, "name": "read_file", "input": {"path": "a.py", "limit": 20}}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": anthropic_usage(4, 2, cached=8)}
    assert generate.messages == [P.ChatMessage(role="system", content="Be brief"),
                                 P.ChatMessage(role="user", content="Hi")]
    assert (generate.max_tokens, generate.stop, generate.sampling) == (64, ["END"], SamplingParams(top_k=5))
    assert [t["function"]["name"] for t in generate.tools] == ["read_file"]
    assert generate.tools[0]["function"]["parameters"] == SCHEMA


@pytest.mark.parametrize("script, ending, reason, sequence", [
    (THINK_THEN_TEXT, dict(finish_reason="stop"), "end_turn", None),
    (THINK_THEN_TEXT, dict(finish_reason="stop", stop_reason="END"), "stop_sequence", "END"),
    (THINK_THEN_TEXT, dict(finish_reason="length"), "max_tokens", None),
    (THINK_THEN_TEXT, dict(finish_reason="cancelled"), "end_turn", None),
    (calls(), dict(finish_reason="stop"), "tool_use", None),
    (calls(), dict(finish_reason="length"), "max_tokens", None)])
def test_messages_stop_reasons(front, script, ending, reason, sequence):
    """Guards: a stop sequence's end, a limit or a plain end of turn given another stop_reason; a
    turn the limit cut after a call called tool_use (the client would run it as if whole)."""
    front.coordinator.script(*script, done(**ending, prompt_tokens=3, completion_tokens=4))
    body = front.post("/v1/messages", json=ANTHROPIC | {"tools": ANTHROPIC_TOOLS}).json()
    assert (body["stop_reason"], body["stop_sequence"], body["content"][1]) == (
        reason, sequence, {"type": "text", "text": "Hi there." if script is THINK_THEN_TEXT else "Reading."})


def test_messages_stream_events_in_their_exact_order():
    """Guards: message_start without the prompt's usage (from Started), a block's start, deltas,
    signature or stop missing or misindexed, or message_delta's stop_reason or usage wrong."""
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(12, 8), *THINK_THEN_TEXT, done("stop", prompt_tokens=12,
                                                                     cached_prompt_tokens=8, completion_tokens=4))
        r = fe.post("/v1/messages", json=ANTHROPIC | {"stream": True})
        rid = fe.coordinator.generates[0].request_id
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    expected = [
        ("message_start", {"message": {"id": rid, "type": "message", "role": "assistant", "model": "tiny",
                                       "content": [], "stop_reason": None, "stop_sequence": None,
                                       "usage": anthropic_usage(4, 0, cached=8)}}),
        ("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": "Hm."}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": signature("Hm.")}}),
        ("content_block_stop", {"index": 0}),
        ("content_block_start", {"index": 1, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 1, "delta": {"type": "text_delta", "text": "Hi"}}),
        ("content_block_delta", {"index": 1, "delta": {"type": "text_delta", "text": " there."}}),
        ("content_block_stop", {"index": 1}),
        ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": anthropic_usage(4, 4, cached=8)}),
        ("message_stop", {})]
    assert named_events(r.text) == [(name, {"type": name} | data) for name, data in expected]


def test_messages_stream_of_a_call(front):
    """Guards: a tool_use block's start without its id and name, or its input not streamed as
    input_json_delta."""
    front.coordinator.script(*calls(), done("stop", completion_tokens=2))
    events = named_events(front.post("/v1/messages", json=ANTHROPIC | {"stream": True,
                                                                       "tools": ANTHROPIC_TOOLS}).text)
    use_id = events[8][1]["content_block"]["id"]
    assert use_id.startswith("toolu_")
    assert events[8:] == [
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": use_id, "name": "read_file", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": '{"path": '}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": '"a.py", "limit": 20}'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": anthropic_usage(0, 2)}),
        ("message_stop", {"type": "message_stop"})]


def test_a_messages_refusal_before_the_headers_is_its_status_and_after_them_an_error_event(front, slow_headers):
    """Guards: an over-long prompt not in Anthropic's words (clients parse them to compact), a
    refusal in OpenAI's shape on this path, or one after message_start lost; a full queue not
    Anthropic's overloaded_error."""
    too_long = {"type": "error", "error": {"type": "invalid_request_error",
                                           "message": "prompt is too long: 300 tokens > 256 maximum"}}
    front.coordinator.script(error("the prompt is 300 tokens, over the context's 256", **TOO_LONG))
    r = front.post("/v1/messages", json=ANTHROPIC | {"stream": True})
    assert (r.status_code, r.json()) == (400, too_long)
    front.coordinator.script(0.3, error("the prompt is 300 tokens, over the context's 256", **TOO_LONG))
    r = front.post("/v1/messages", json=ANTHROPIC | {"stream": True})
    rid = front.coordinator.generates[1].request_id
    assert r.status_code == 200 and named_events(r.text) == [
        ("message_start", {"type": "message_start", "message": {
            "id": rid, "type": "message", "role": "assistant", "model": "tiny", "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}}),
        ("error", too_long)]
    front.coordinator.script(0.3, error("the grammar does not compile", code="invalid_grammar"))
    events = named_events(front.post("/v1/messages", json=ANTHROPIC | {"stream": True}).text)
    assert events[1:] == [("error", {"type": "error", "error": {"type": "invalid_request_error",
                                                                "message": "the grammar does not compile"}})]
    front.coordinator.script(error("3 requests wait", code="queue_full"))
    r = front.post("/v1/messages", json=ANTHROPIC)
    assert (r.status_code, r.headers["retry-after"], r.json()) == (503, "1", {"type": "error", "error": {
        "type": "overloaded_error", "message": "3 requests wait"}})


def test_a_messages_generation_that_fails_is_an_api_error(front):
    """Guards: a failed generation answered as a message, or its stream ending with message_stop."""
    front.coordinator.script(token(1, "Hm"), done("error", error="the worker died"))
    r = front.post("/v1/messages", json=ANTHROPIC)
    assert (r.status_code, r.json()) == (500, {"type": "error", "error": {"type": "api_error",
                                                                          "message": "the worker died"}})
    front.coordinator.script(token(1, "Hm"), done("error", error="the worker died"))
    events = named_events(front.post("/v1/messages", json=ANTHROPIC | {"stream": True}).text)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "the worker died"}}


@pytest.mark.parametrize("raw, message", [
    (b"not json", "the request body is not valid JSON"),
    (b"[1]", "the request body must be a JSON object"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}', "Missing required parameter: 'max_tokens'."),
    (b'{"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}',
     "Invalid 'max_tokens': Expected `int` >= 1"),
    (b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], '
     b'"thinking": {"type": "sometimes"}}', "thinking.type: expected 'enabled', 'disabled' or 'adaptive', got "
                                            "'sometimes'")])
def test_bad_messages_requests_are_anthropic_400s(front, raw, message):
    """Guards: a bad request answered in OpenAI's shape on Anthropic's path, or sent on."""
    r = front.post("/v1/messages", content=raw)
    assert (r.status_code, r.json()) == (400, {"type": "error", "error": {"type": "invalid_request_error",
                                                                          "message": message}})
    assert front.coordinator.generates == []


def test_count_tokens_counts_the_rendered_prompt(front):
    """Guards: the count of anything but the prompt as the template renders it (system and the
    generation prompt included)."""
    f = GGUFFile(MODEL_PATH)
    tok = Tokenizer.from_metadata(f.metadata)
    f.close()
    prompt = "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    r = front.post("/v1/messages/count_tokens", json={"model": "m", "system": "Be brief", "messages": [
        {"role": "user", "content": "Hi"}]})
    assert (r.status_code, r.json()) == (200, {"input_tokens": len(tok.encode(prompt))})
    r = front.post("/v1/messages/count_tokens", json={"model": "m", "messages": []})
    assert (r.status_code, r.json()) == (400, {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Invalid 'messages': Expected `array` of length >= 1"}})


def test_the_key_is_refused_in_each_apis_shape():
    """Guards: Anthropic's clients given OpenAI's error shape for a missing key, or a path let
    through without it."""
    with InProcessFrontend({"api_key": "k"}) as fe:
        r = fe.post("/v1/messages", json=ANTHROPIC)
        assert (r.status_code, r.json()) == (401, {"type": "error", "error": {"type": "authentication_error",
                                                                              "message": MISSING_KEY}})
        r = fe.post("/v1/responses", json={"input": "Hi"}, headers={"authorization": "Bearer nope"})
        assert (r.status_code, r.json()) == (401, {"error": {"message": "Incorrect API key provided.",
                                                             "type": "invalid_request_error", "param": None,
                                                             "code": "invalid_api_key"}})
        fe.coordinator.script(token(1, "x"), done("stop", completion_tokens=1))
        r = fe.post("/v1/messages", json=ANTHROPIC, headers={"x-api-key": "k"})
        assert r.status_code == 200 and fe.coordinator.generates[0].max_tokens == 64
