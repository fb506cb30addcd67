"""The Responses and Anthropic Messages APIs in this process, no model: request bodies -> the
chat request they translate to, and recorded model text (a reasoning, some text, a tool call)
answered as each API answers, read back by the vendor's own client (`openai`, `anthropic`)
through a mock transport: its stream parser and accumulator check the event sequences."""
from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import msgspec
import openai
import pytest

from frontend import openai_request
from frontend.anthropic_api import MessagesResponse, signature
from frontend.anthropic_request import AnthropicError, MessagesRequest
from frontend.anthropic_request import chat_request as anthropic_chat
from frontend.errors import APIError
from frontend.formats import ChatFormat
from frontend.metrics import Metrics
from frontend.responses_api import ResponsesResponse
from frontend.responses_request import ResponsesRequest
from frontend.responses_request import chat_request as responses_chat
from tests.support import recorded_response as recorded
from tests.support.recorded_response import RECORDED, TYPED_ARGUMENTS, TYPED_CALL, TYPED_SCHEMA, NoUpstream

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}


def answer(make, pieces, finish="stop", stop_reason=None) -> bytes:
    return recorded.answer(make, pieces, finish=finish, prompt_tokens=50, cached_prompt_tokens=30, stop_reason=stop_reason)


def transport(body: bytes, streaming: bool, http=httpx):
    """A client of `http` (httpx for openai, httpx2 for anthropic) answering every request with `body`."""
    kind = "text/event-stream" if streaming else "application/json"
    return http.Client(transport=http.MockTransport(lambda request: http.Response(
        200, content=body, headers={"content-type": kind})))


# ---- Anthropic --------------------------------------------------------------------------------
ANTHROPIC = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Show me a.py"}],
             "tools": [{"name": "read_file", "input_schema": SCHEMA}]}


def anthropic_response(streaming: bool, pieces=RECORDED, **done) -> anthropic.Anthropic:
    req = MessagesRequest.decode(json.dumps(ANTHROPIC | {"stream": streaming}).encode())
    body = anthropic_chat(req, streaming)
    parser = openai_request.chat_parser(body, openai_request.chat_generate(body), True, "deepseek")
    raw = answer(lambda s: MessagesResponse(NoUpstream(), s, ChatFormat(), "m", streaming, Metrics(), parser),
                 pieces, **done)
    return anthropic.Anthropic(base_url="http://x", api_key="k", http_client=transport(raw, streaming, httpx2))


def test_anthropic_message_with_thinking_text_and_tool_use():
    m = anthropic_response(False).messages.create(**ANTHROPIC)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "The user wants a.py." and m.content[0].signature
    assert m.content[1].text == "Reading it."
    assert (m.content[2].name, m.content[2].input) == ("read_file", {"path": "src/ünï.py", "limit": 20})
    assert m.content[2].id.startswith("toolu_") or m.content[2].id.startswith("call_")
    assert m.stop_reason == "tool_use" and m.usage.input_tokens == 20 and m.usage.cache_read_input_tokens == 30


def test_anthropic_stream_is_accumulated_by_the_sdk():
    with anthropic_response(True).messages.stream(**ANTHROPIC) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "thinking", "input_json", "signature")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"}
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"path": "src/ünï.py", "limit": 20} and final.stop_reason == "tool_use"
    assert final.content[0].thinking == "The user wants a.py." and final.content[0].signature
    assert final.usage.output_tokens == len(RECORDED) and final.usage.cache_read_input_tokens == 30


def sse(raw: bytes) -> list[tuple[str, dict]]:
    """A stream's events as sent: (the `event:` line's name, its data)."""
    out = []
    for e in raw.decode().strip().split("\n\n"):
        name, data = e.split("\n", 1)
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def anthropic_raw(pieces, streaming: bool, request=ANTHROPIC, **done) -> bytes:
    req = MessagesRequest.decode(json.dumps(request | {"stream": streaming}).encode())
    body = anthropic_chat(req, streaming)
    parser = openai_request.chat_parser(body, openai_request.chat_generate(body), True, "deepseek")
    return answer(lambda s: MessagesResponse(NoUpstream(), s, ChatFormat(), "m", streaming, Metrics(), parser),
                  pieces, **done)


CUT_IN_THE_CALL = RECORDED[:13]         # the limit fell inside the call's `path` value


@pytest.mark.parametrize("pieces, done, reason, sequence", [
    (CUT_IN_THE_CALL, dict(finish="length"), "max_tokens", None),
    (RECORDED, dict(finish="length"), "max_tokens", None),
    (RECORDED[:7], dict(finish="length"), "max_tokens", None),
    (RECORDED, dict(finish="stop"), "tool_use", None),
    (RECORDED, dict(finish="stop", stop_reason="</tool_call>"), "tool_use", None),
    (RECORDED[:7], dict(finish="stop", stop_reason="it."), "stop_sequence", "it."),
    (RECORDED[:7], dict(finish="stop"), "end_turn", None)])
def test_anthropic_stop_reasons(pieces, done, reason, sequence):
    """Each stop_reason, in the whole message and in the stream's message_delta. Fault guarded:
    the tool_use test before the length one called a turn the limit cut inside its call
    `tool_use`: the client then runs a call whose arguments were cut short."""
    m = anthropic_response(False, pieces, **done).messages.create(**ANTHROPIC)
    assert (m.stop_reason, m.stop_sequence) == (reason, sequence)
    assert [b.type for b in m.content][-1] == ("tool_use" if len(pieces) > 7 else "text")
    events = sse(anthropic_raw(pieces, True, **done))
    assert events[-2] == ("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": reason, "stop_sequence": sequence}, "usage": {
        "input_tokens": 20, "output_tokens": len(pieces), "cache_read_input_tokens": 30,
        "cache_creation_input_tokens": 0}})
    assert events[-1] == ("message_stop", {"type": "message_stop"})


def test_anthropic_stream_events_in_their_exact_order():
    """Fault guarded: a block's content_block_stop sent before its signature_delta (or a
    message_delta before the last block's stop) passed tests that only counted the kinds."""
    events = sse(anthropic_raw(RECORDED, True))
    shape = []
    for name, data in events:
        assert data["type"] == name
        delta = data.get("delta", {}).get("type") if name == "content_block_delta" else None
        block = data.get("content_block", {}).get("type")
        shape.append((name, data.get("index"), delta or block))
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use")] + [("content_block_delta", 2, "input_json_delta")] * 4 + [
        ("content_block_stop", 2, None), ("message_delta", None, None), ("message_stop", None, None)]
    assert events[4][1]["delta"]["signature"] == signature("The user wants a.py.")
    assert "".join(d["delta"]["partial_json"] for n, d in events if d.get("index") == 2 and n ==
                   "content_block_delta") == '{"path": "src/ünï.py", "limit": 20}'


def test_anthropic_history_becomes_the_chat_history():
    req = MessagesRequest.decode(json.dumps({
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be terse.", "cache_control": {}}],
        "stop_sequences": ["END"], "thinking": {"type": "disabled"},
        "tools": ANTHROPIC["tools"] + [{"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "tool", "name": "read_file"}, "context_management": {"edits": []},
        "messages": [{"role": "user", "content": "Show me a.py"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "need it", "signature": "sig"},
                         {"type": "redacted_thinking", "data": "xx"}, {"type": "text", "text": "Reading."},
                         {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text",
                                                                                        "text": "print(1)"}]},
                         {"type": "text", "text": "Now explain."}]}]}).encode())
    body = anthropic_chat(req, False)
    assert [m.role for m in body.messages] == ["system", "user", "assistant", "tool", "user"]
    a = body.messages[2]
    assert (a.reasoning_content, a.content[0].text, a.tool_calls[0].id) == ("need it", "Reading.", "toolu_1")
    assert a.tool_calls[0].function.arguments == {"path": "a.py"} and body.messages[3].content == "print(1)"
    assert body.stop == ["END"] and body.chat_template_kwargs == {"enable_thinking": False}
    assert body.tool_choice == {"type": "function", "function": {"name": "read_file"}}
    assert len(body.tools) == 2
    assert len(openai_request.chat_generate(msgspec.structs.replace(body, tool_choice=None)).tools) == 1


@pytest.mark.parametrize("fields, word", [
    (dict(max_tokens=None), "max_tokens"),
    (dict(messages=[{"role": "user", "content": [{"type": "video"}]}]), "unknown block type 'video'"),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "not supported"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]),
     "not fetched"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                             "media_type": "text/plain"}}]}]),
     "image/* type"),
    (dict(tools=[{"name": "read_file"}]), "input_schema"),
    (dict(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "tool_use_id"),
])
def test_anthropic_bad_requests_name_the_field(fields, word):
    body = {k: v for k, v in (ANTHROPIC | fields).items() if v is not None}
    with pytest.raises(AnthropicError) as e:
        anthropic_chat(MessagesRequest.decode(json.dumps(body).encode()), False)
    assert e.value.status == 400 and word in e.value.message, e.value.message
    assert e.value.body()["type"] == "error" and e.value.body()["error"]["type"] == "invalid_request_error"


# ---- Responses --------------------------------------------------------------------------------
RESPONSES = {"model": "m", "input": "Show me a.py", "tools": [{"type": "function", "name": "read_file",
                                                              "parameters": SCHEMA}, {"type": "web_search"}]}


def responses_client(streaming: bool, pieces=RECORDED, **done) -> openai.OpenAI:
    req = ResponsesRequest.decode(json.dumps(RESPONSES | {"stream": streaming}).encode())
    body = responses_chat(req)
    parser = openai_request.chat_parser(body, openai_request.chat_generate(body), True, "deepseek")
    raw = answer(lambda s: ResponsesResponse(NoUpstream(), s, ChatFormat(), "m", streaming, Metrics(), parser,
                                             request=req), pieces, **done)
    return openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=transport(raw, streaming))


def test_responses_output_items():
    r = responses_client(False).responses.create(**RESPONSES)
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "The user wants a.py." and r.output_text == "Reading it."
    call = r.output[2]
    assert call.name == "read_file" and call.arguments == '{"path": "src/ünï.py", "limit": 20}'
    assert call.call_id.startswith("call_") and r.status == "completed"
    assert (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) == (50, 30)
    assert r.usage.output_tokens_details.reasoning_tokens == RECORDED.index("</think>") + 1    # its tag too
    assert [t.name for t in r.tools] == ["read_file"]


def test_responses_stream_is_accumulated_by_the_sdk():
    with responses_client(True).responses.stream(**RESPONSES) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.reasoning_text.delta", "response.output_text.delta", "response.output_text.done",
                 "response.function_call_arguments.delta", "response.function_call_arguments.done"):
        assert kind in kinds, kind
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Reading it." and final.output[2].arguments == '{"path": "src/ünï.py", "limit": 20}'
    assert final.usage.output_tokens_details.reasoning_tokens == RECORDED.index("</think>") + 1


def responses_raw(pieces, streaming=True, request=RESPONSES, **done) -> bytes:
    req = ResponsesRequest.decode(json.dumps(request | {"stream": streaming}).encode())
    body = responses_chat(req)
    parser = openai_request.chat_parser(body, openai_request.chat_generate(body), True, "deepseek")
    return answer(lambda s: ResponsesResponse(NoUpstream(), s, ChatFormat(), "m", streaming, Metrics(), parser,
                                              request=req), pieces, **done)


def _item_events(kind: str, n_deltas: int) -> list[str]:
    """The events of one output item, in the order OpenAI sends them."""
    if kind == "function_call":
        return (["response.output_item.added"] + ["response.function_call_arguments.delta"] * n_deltas
                + ["response.function_call_arguments.done", "response.output_item.done"])
    text = "reasoning_text" if kind == "reasoning" else "output_text"
    return (["response.output_item.added", "response.content_part.added"] + [f"response.{text}.delta"] * n_deltas
            + [f"response.{text}.done", "response.content_part.done", "response.output_item.done"])


def test_responses_stream_events_in_their_exact_order():
    """Fault guarded: the closing events of an item in another order (content_part.done
    before output_text.done, output_item.done before content_part.done, the same for a
    reasoning item) passed tests that only checked which kinds came and how many; Codex
    reads the text at output_text.done and the item at output_item.done."""
    events = sse(responses_raw(RECORDED))
    assert [d["type"] for _, d in events] == [name for name, _ in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [name for name, _ in events] == (
        ["response.created", "response.in_progress"] + _item_events("reasoning", 2) + _item_events("message", 2)
        + _item_events("function_call", 4) + ["response.completed"])
    items = [d for name, d in events if name == "response.output_item.done"]
    assert [(d["output_index"], d["item"]["type"]) for d in items] == [(0, "reasoning"), (1, "message"),
                                                                       (2, "function_call")]
    for name, d in events[2:-1]:            # every event of an item names it
        i = d["output_index"]
        assert d.get("item_id", d.get("item", {}).get("id")) == items[i]["item"]["id"], name
    done = {name: d for name, d in events}
    assert done["response.reasoning_text.done"]["text"] == "The user wants a.py."
    assert done["response.content_part.done"]["part"]["text"] == "Reading it."       # the message's, the last
    assert done["response.output_text.done"]["text"] == "Reading it."
    assert done["response.function_call_arguments.done"]["arguments"] == '{"path": "src/ünï.py", "limit": 20}'


def test_responses_stream_cut_inside_a_call_closes_it_then_is_incomplete():
    """Fault guarded: a turn cut inside a call must still close the call's item (its
    arguments valid JSON) before response.incomplete, not end with the item open."""
    events = sse(responses_raw(CUT_IN_THE_CALL, finish="length"))
    assert [name for name, _ in events][-3:] == ["response.function_call_arguments.done",
                                                 "response.output_item.done", "response.incomplete"]
    assert events[-2][1]["item"]["arguments"] == '{"path": "src/ü"}'
    final = events[-1][1]["response"]
    assert (final["status"], final["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def test_responses_cut_by_the_limit_is_incomplete():
    r = responses_client(False, RECORDED[:7], finish="length").responses.create(**RESPONSES)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_responses_input_items_become_the_chat_history():
    req = ResponsesRequest.decode(json.dumps({
        "model": "m", "instructions": "Be terse.", "store": False, "include": ["reasoning.encrypted_content"],
        "text": {"format": {"type": "text"}, "verbosity": "low"}, "reasoning": {"effort": "none"},
        "tools": RESPONSES["tools"], "tool_choice": "auto", "prompt_cache_key": "abc",
        "input": [{"role": "developer", "content": "Use tools."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Show me a.py"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [],
                   "content": [{"type": "reasoning_text", "text": "need it"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Reading."}]},
                  {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "a"}'},
                  {"type": "function_call", "call_id": "call_2", "name": "read_file", "arguments": '{"path": "b"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": "A"},
                  {"type": "function_call_output", "call_id": "call_2", "output": "B"}]}).encode())
    g = openai_request.chat_generate(responses_chat(req))
    assert [m.role for m in g.messages] == ["system", "system", "user", "assistant", "tool", "tool"]
    a = g.messages[3]
    assert (a.reasoning_content, a.content) == ("need it", "Reading.")
    assert [c.id for c in a.tool_calls] == ["call_1", "call_2"] and a.tool_calls[1].function.arguments == {"path": "b"}
    assert g.chat_template_kwargs == {"enable_thinking": False} and len(g.tools) == 1


@pytest.mark.parametrize("fields, param, word", [
    (dict(input=None), "input", "Missing required"),
    (dict(previous_response_id="resp_1"), "previous_response_id", "keeps no responses"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0]", "keeps no responses"),
    (dict(input=[{"type": "local_shell_call"}]), "input[0].type", "unknown input item type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0].image_url", "data: URL"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
     "input[0].content[0].file_id", "keeps no files"),
    (dict(input=[{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]),
     "input[0].content[0]", "not supported here"),
    (dict(tools=[{"type": "function", "name": "f"}]), "tools[0].parameters", "schema"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]),
     "input[0].arguments", "not JSON"),
    (dict(text={"format": {"type": "xml"}}), "text.format", "json_schema"),
    (dict(top_logprobs=3), "top_logprobs", "not supported"),
    (dict(include=["reasoning.encrypted_content", "message.output_text.logprobs"]), "include", "not supported"),
])
def test_responses_bad_requests_name_the_field(fields, param, word):
    body = {k: v for k, v in (RESPONSES | fields).items() if v is not None}
    with pytest.raises(APIError) as e:
        responses_chat(ResponsesRequest.decode(json.dumps(body).encode()))
    assert (e.value.status, e.value.param) == (400, param) and word in e.value.message, e.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "read_file"}])
def test_forced_responses_choices_reach_chats_tool_choice(choice):
    """Mapped onto chat's tool_choice, which forces the call with a grammar."""
    body = responses_chat(ResponsesRequest.decode(json.dumps(RESPONSES | {"tool_choice": choice}).encode()))
    assert body.tool_choice == (choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": "read_file"}})
    grammar = openai_request.chat_generate(body).grammar
    assert grammar is not None and grammar.kind == "lark" and "read_file" in grammar.text


def test_forced_anthropic_choices_reach_chats_tool_choice():
    for choice, chat in [({"type": "any"}, "required"), ({"type": "none"}, "none"), ({"type": "auto"}, "auto")]:
        req = MessagesRequest.decode(json.dumps(ANTHROPIC | {"tool_choice": choice}).encode())
        assert anthropic_chat(req, False).tool_choice == chat
    forced = openai_request.chat_generate(anthropic_chat(MessagesRequest.decode(json.dumps(ANTHROPIC | {"tool_choice": {
        "type": "any"}}).encode()), False))
    assert forced.grammar is not None and forced.grammar.kind == "lark"


# ---- a call's values keep their JSON types ------------------------------------------------------
def test_tool_arguments_keep_their_json_types_on_the_responses_and_messages_wires():
    """The arguments compared as the bytes sent, never after json.loads (where 3 == 3.0). Fault
    guarded: an integer value re-encoded as a float (`3.0`) on its way out, by the parser or
    by the Messages API's parse of the arguments into `input`."""
    responses = RESPONSES | {"tools": [{"type": "function", "name": "configure", "parameters": TYPED_SCHEMA}]}
    whole = json.loads(responses_raw(TYPED_CALL, streaming=False, request=responses))
    assert [(i["type"], i.get("arguments")) for i in whole["output"]] == [("reasoning", None),
                                                                          ("function_call", TYPED_ARGUMENTS)]
    events = sse(responses_raw(TYPED_CALL, request=responses))
    assert "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta") == TYPED_ARGUMENTS
    assert [d["arguments"] for n, d in events if n == "response.function_call_arguments.done"] == [TYPED_ARGUMENTS]
    assert events[-1][1]["response"]["output"][-1]["arguments"] == TYPED_ARGUMENTS

    messages = ANTHROPIC | {"tools": [{"name": "configure", "input_schema": TYPED_SCHEMA}]}
    raw = anthropic_raw(TYPED_CALL, False, request=messages)
    assert raw.endswith(b'"input":{"n":3,"ratio":2.5,"whole":4,"on":true,"tags":[1,2.0],"note":null}}],'   # compact
                        b'"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":20,"output_tokens":4,'
                        b'"cache_read_input_tokens":30,"cache_creation_input_tokens":0}}'), raw
    events = sse(anthropic_raw(TYPED_CALL, True, request=messages))
    assert "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta"
                   and d["delta"]["type"] == "input_json_delta") == TYPED_ARGUMENTS


# ---- what Claude Code and Codex send (issue 38) ----------------------------------------------------
def rendered(body) -> str:
    from shared.chat import render_chat
    from tests.support.qwen_template import qwen_style_tokenizer
    g = openai_request.chat_generate(body)
    return render_chat(qwen_style_tokenizer(), g.messages, g.tools, g.chat_template_kwargs)


def test_a_system_message_inside_anthropic_messages_is_rendered_as_a_late_system_message():
    """Claude Code (beta mid-conversation-system) sends messages[1] with role system."""
    req = MessagesRequest.decode(json.dumps(ANTHROPIC | {"system": [{"type": "text", "text": "You are Claude Code.",
                                                                      "cache_control": {"type": "ephemeral"}}],
                                                         "thinking": {"type": "adaptive"},
                                                         "output_config": {"effort": "high"},
                                                         "messages": [
        {"role": "user", "content": "Show me a.py"},
        {"role": "system", "content": "Available agent types for the Agent tool: general"},
        {"role": "user", "content": [{"type": "text", "text": "Go."}]}]}).encode())
    body = anthropic_chat(req, True)
    assert [m.role for m in body.messages] == ["system", "user", "system", "user"]
    text = rendered(body)
    assert text.startswith("<|im_start|>system\n") and text.count("<|im_start|>system") == 1
    assert "You are Claude Code." in text.split("<|im_end|>")[0]
    assert ("<|im_start|>user\nShow me a.py<|im_end|>\n<|im_start|>user\nAvailable agent types for the Agent tool: "
            "general<|im_end|>\n<|im_start|>user\nGo.<|im_end|>") in text
    with pytest.raises(AnthropicError, match="unknown block type .image. in a system message"):
        anthropic_chat(MessagesRequest.decode(json.dumps(ANTHROPIC | {"messages": [
            {"role": "user", "content": "x"}, {"role": "system", "content": [{"type": "image"}]}]}).encode()), False)


def test_codexs_two_leading_developer_messages_are_one_system_turn():
    req = ResponsesRequest.decode(json.dumps({"model": "m", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Base instructions."}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Show me a.py"}]}]}).encode())
    text = rendered(responses_chat(req))
    assert text.startswith("<|im_start|>system\nBase instructions.\n\nSkills.<|im_end|>\n<|im_start|>user\n"
                           "Show me a.py<|im_end|>")


SPAWN = {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}
CODEX = {"model": "m", "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
         "reasoning": {"effort": "medium", "summary": "auto"}, "tool_choice": "auto", "parallel_tool_calls": True,
         "prompt_cache_key": "k", "client_metadata": {},
         "tools": [{"type": "function", "name": "exec_command", "parameters": SCHEMA}, {"type": "web_search"},
                   {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
                       {"type": "function", "name": "spawn_agent", "description": "Spawn one.", "strict": False,
                        "parameters": SPAWN}]}],
         "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Base."}]},
                   {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Split it."}]},
                   {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
                    "content": [{"type": "reasoning_text", "text": "Two agents."}]},
                   {"type": "function_call", "call_id": "call_1", "name": "spawn_agent", "namespace": "multi_agent_v1",
                    "arguments": '{"task": "a"}'},
                   {"type": "function_call_output", "call_id": "call_1", "output": "spawned"}]}
SPAWNING = ["Another", " one.", "\n</think>\n\n", "<tool_call>\n<function=multi_agent_v1__spawn_agent>\n",
            "<parameter=task>\nb\n</parameter>\n</function>\n</tool_call>"]


def test_codexs_namespace_tool_is_flattened_and_its_calls_named_back():
    req = ResponsesRequest.decode(json.dumps(CODEX).encode())
    body = responses_chat(req)
    g = openai_request.chat_generate(body)
    assert [t["function"]["name"] for t in g.tools] == ["exec_command", "multi_agent_v1__spawn_agent"]
    assert [m.role for m in g.messages] == ["system", "system", "user", "assistant", "tool"]
    a = g.messages[3]
    assert a.reasoning_content == "Two agents." and a.tool_calls[0].function.name == "multi_agent_v1__spawn_agent"
    text = rendered(body)
    assert "<|im_start|>system\n" in text and text.count("<|im_start|>system") == 1 and "Base.\n\nSkills." in text
    assert "<function=multi_agent_v1__spawn_agent>" in text
    parser = openai_request.chat_parser(body, g, True, "deepseek")
    raw = answer(lambda s: ResponsesResponse(NoUpstream(), s, ChatFormat(), "m", True, Metrics(), parser,
                                             request=req), SPAWNING)
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=transport(raw, True))
    with client.responses.stream(model="m", input="Split it.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert (added[0].name, added[0].namespace) == ("spawn_agent", "multi_agent_v1")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "spawn_agent"
    call = final.output[-1]
    assert (call.type, call.name, call.namespace, json.loads(call.arguments)) == (
        "function_call", "spawn_agent", "multi_agent_v1", {"task": "b"})
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == "Another one."


# ---- a long prefill: the opening event at once, keep-alives until the first token -----------------------
def slowly(make, pieces, monkeypatch, after_s=0.5, refusal=None) -> tuple[list[tuple[float, dict]], bytes]:
    """What make(stream) sends (with the time each message went) when the first reply comes
    after `after_s`: `pieces` of model text and a Done, or the Error `refusal`. The headers wait
    0.05 s at most, keep-alives come every 0.1 s (patched from seconds)."""
    import asyncio
    import time

    from frontend import streaming
    from frontend.upstream import RequestStream
    from shared import protocol as P
    monkeypatch.setattr(streaming, "HEADERS_AFTER_S", 0.05, raising=False)
    monkeypatch.setattr(streaming, "KEEPALIVE_S", 0.1, raising=False)

    async def go():
        stream, sent, t0 = RequestStream("r"), [], time.perf_counter()
        response = make(stream)

        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            sent.append((time.perf_counter() - t0, message))
        task = asyncio.create_task(response(None, receive, send))
        await asyncio.sleep(after_s)
        if refusal is not None:
            stream.push(refusal)
        for i, text in enumerate(pieces):
            stream.push(P.Token(request_id="r", token=i, text=text))
        if refusal is None:
            stream.push(P.Done(request_id="r", finish_reason="stop", completion_tokens=len(pieces), prompt_tokens=9))
        await asyncio.wait_for(task, 10)
        return sent
    sent = asyncio.run(go())
    return sent, b"".join(m.get("body", b"") for _, m in sent[1:])


def before(sent, after_s=0.5) -> bytes:
    """The body sent before the first reply came."""
    return b"".join(m.get("body", b"") for t, m in sent[1:] if t < after_s)


TOO_LONG = dict(message="the prompt is 300000 tokens, over the context's 262144", code="context_length_exceeded",
                n_prompt_tokens=300000, n_ctx=262144)


def messages_response(streaming=True):
    req = MessagesRequest.decode(json.dumps(ANTHROPIC | {"stream": streaming}).encode())
    body = anthropic_chat(req, streaming)
    parser = openai_request.chat_parser(body, openai_request.chat_generate(body), True, "deepseek")
    return lambda s: MessagesResponse(NoUpstream(), s, ChatFormat(), "m", streaming, Metrics(), parser)


def test_a_slow_prefill_gets_message_start_at_once_then_pings(monkeypatch):
    sent, raw = slowly(messages_response(), RECORDED, monkeypatch)
    assert sent[0][1]["status"] == 200 and sent[0][0] < 0.3
    early = before(sent)
    assert early.startswith(b"event: message_start\n") and early.count(b"event: ping\ndata: {\"type\": \"ping\"}") >= 2
    assert b"content_block_start" not in early
    client = anthropic.Anthropic(base_url="http://x", api_key="k", http_client=transport(raw, True, httpx2))
    with client.messages.stream(**ANTHROPIC) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.stop_reason == "tool_use"


def test_a_slow_prefill_gets_response_created_and_the_first_chat_chunk_at_once_then_comments(monkeypatch):
    from frontend.streaming import GenerationResponse
    req = ResponsesRequest.decode(json.dumps(RESPONSES | {"stream": True}).encode())
    body = responses_chat(req)
    parser = openai_request.chat_parser(body, openai_request.chat_generate(body), True, "deepseek")
    sent, raw = slowly(lambda s: ResponsesResponse(NoUpstream(), s, ChatFormat(), "m", True, Metrics(), parser,
                                                   request=req), RECORDED, monkeypatch)
    early = before(sent)
    assert early.startswith(b"event: response.created\n") and early.count(b": keep-alive\n\n") >= 2
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=transport(raw, True))
    with client.responses.stream(model="m", input="x") as stream:
        assert [i.type for i in stream.get_final_response().output] == ["reasoning", "message", "function_call"]

    sent, raw = slowly(lambda s: GenerationResponse(NoUpstream(), s, ChatFormat(), "m", True, False, Metrics()),
                       ["Hello", " there."], monkeypatch)
    early = before(sent)
    assert early.startswith(b"data: ") and b'"role":"assistant"' in early.split(b"\n\n")[0]
    assert early.count(b": keep-alive\n\n") >= 2
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=transport(raw, True))
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there."


def test_an_over_long_prompt_is_anthropics_prompt_is_too_long(monkeypatch):
    from shared import protocol as P
    wording = "prompt is too long: 300000 tokens > 262144 maximum"
    sent, raw = slowly(messages_response(), [], monkeypatch, after_s=0, refusal=P.Error(request_id="r", **TOO_LONG))
    assert sent[0][1]["status"] == 400                       # refused before the headers: its status
    assert json.loads(raw) == {"type": "error", "error": {"type": "invalid_request_error", "message": wording}}
    sent, raw = slowly(messages_response(), [], monkeypatch, refusal=P.Error(request_id="r", **TOO_LONG))
    assert sent[0][1]["status"] == 200 and raw.startswith(b"event: message_start")    # after them: an error event
    assert raw.endswith(b"event: error\ndata: " + json.dumps({"type": "error", "error": {
        "type": "invalid_request_error", "message": wording}}).encode() + b"\n\n")
    client = anthropic.Anthropic(base_url="http://x", api_key="k", http_client=transport(raw, True, httpx2))
    with pytest.raises(anthropic.APIStatusError, match="prompt is too long: 300000 tokens > 262144 maximum"):
        with client.messages.stream(**ANTHROPIC) as stream:
            list(stream)


def test_a_refusal_after_the_headers_is_the_openai_streams_error(monkeypatch):
    from frontend.streaming import GenerationResponse
    from shared import protocol as P
    sent, raw = slowly(lambda s: GenerationResponse(NoUpstream(), s, ChatFormat(), "m", True, False, Metrics()),
                       [], monkeypatch, refusal=P.Error(request_id="r", **TOO_LONG))
    error = json.loads(raw.split(b"\n\n")[-3].removeprefix(b"data: "))["error"]
    assert error["code"] == "context_length_exceeded" and raw.endswith(b"data: [DONE]\n\n")
    req = ResponsesRequest.decode(json.dumps(RESPONSES | {"stream": True}).encode())
    body = responses_chat(req)
    parser = openai_request.chat_parser(body, openai_request.chat_generate(body), True, "deepseek")
    sent, raw = slowly(lambda s: ResponsesResponse(NoUpstream(), s, ChatFormat(), "m", True, Metrics(), parser,
                                                   request=req), [], monkeypatch,
                       refusal=P.Error(request_id="r", **TOO_LONG))
    last = json.loads(raw.strip().split(b"\n\n")[-1].split(b"data: ", 1)[1])
    assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "context_length_exceeded"
