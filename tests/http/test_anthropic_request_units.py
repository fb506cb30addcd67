"""frontend/anthropic_request.py on its own: an Anthropic Messages body decoded and turned into
the OpenAI chat request the chat path serves, field by field, and each refusal's status,
error type, `param` and message exactly (the message is what names the problem to the user)."""
from __future__ import annotations

import json
import logging

import pytest

from frontend.anthropic_request import (AnthropicError, CountTokensRequest, MessagesRequest, as_anthropic,
                                        chat_request)
from frontend.errors import APIError
from tests.support.request_units import set_fields

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
PNG = "iVBORw0KGgo="




def convert(body: dict, kind=MessagesRequest, stream: bool = False) -> dict:
    return set_fields(chat_request(kind.decode(json.dumps(body).encode()), stream))


def messages_body(messages, **fields) -> dict:
    return {"model": "m", "max_tokens": 7, "messages": messages} | fields


def refusal(body: dict, kind=MessagesRequest) -> AnthropicError:
    with pytest.raises(AnthropicError) as e:
        chat_request(kind.decode(json.dumps(body).encode()), False)
    return e.value


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def user_text(t: str) -> dict:
    return {"role": "user", "content": [text(t)]}


DEFAULTS = {"stream": False, "ignore_eos": False}
HI = [{"role": "user", "content": "Hi"}]


# ---- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (413, "request_too_large"),
    (429, "rate_limit_error"), (503, "overloaded_error"), (500, "api_error"), (502, "api_error")])
def test_error_body_names_anthropics_error_type_per_status(status, kind):
    """Guards: a status mapped to the wrong Anthropic error type (clients retry on
    overloaded_error and rate_limit_error, and give up on the others), or the body's shape."""
    assert AnthropicError(status, "no").body() == {"type": "error", "error": {"type": kind, "message": "no"}}


def test_as_anthropic_prefixes_the_param_once_and_keeps_status_code_and_headers():
    """Guards: the offending field left out of the message (Anthropic's errors have no `param`),
    named twice, or the status, param, code or headers (Retry-After) lost on the way."""
    e = as_anthropic(APIError(429, "queue full", param="model", code="busy", headers={"Retry-After": "1"}))
    assert (type(e), e.status, e.message, e.param, e.code, e.headers) == (
        AnthropicError, 429, "model: queue full", "model", "busy", {"Retry-After": "1"})
    assert as_anthropic(APIError(400, "Invalid 'top_k': too big", param="top_k")).message == "Invalid 'top_k': too big"
    assert as_anthropic(APIError(400, "plain")).message == "plain"
    same = AnthropicError(400, "x")
    assert as_anthropic(same) is same


@pytest.mark.parametrize("raw, message", [
    (b"{", "the request body is not valid JSON"),
    (b"[1]", "the request body must be a JSON object"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}', "Missing required parameter: 'max_tokens'."),
    (b'{"model": "m", "max_tokens": 1, "messages": []}',
     "Invalid 'messages': Expected `array` of length >= 1"),
    (b'{"model": "m", "max_tokens": 1, "temperature": 1.5, "messages": [{"role": "user", "content": "Hi"}]}',
     "Invalid 'temperature': Expected `float` <= 1.0"),
])
def test_decode_refusals(raw, message):
    """Guards: a body that is not JSON, not an object, or misses or misfills a field answered
    otherwise than a 400 naming it (Anthropic's temperature stops at 1, OpenAI's at 2)."""
    with pytest.raises(AnthropicError) as e:
        MessagesRequest.decode(raw)
    assert (e.value.status, e.value.message) == (400, message)


def test_unknown_top_level_fields_are_ignored_not_refused_and_logged(caplog):
    """Guards: a field of a newer API version (context_management, say) refusing the request,
    or the log line that names the fields ignored (what an operator reads to learn why a
    client's option had no effect) naming others or none."""
    caplog.set_level(logging.INFO, logger="fermoe.http")
    assert convert(messages_body(HI, context_management={"edits": []}, betas=["x"])) == DEFAULTS | {
        "max_tokens": 7, "messages": [user_text("Hi")]}
    assert [r.getMessage() for r in caplog.records] == ["ignored MessagesRequest fields: betas, context_management"]


# ---- the conversion -------------------------------------------------------------------------------
def test_sampling_fields_stop_and_stream_carried():
    """Guards: max_tokens, temperature, top_p, top_k or stop_sequences dropped or renamed wrongly,
    or `stream` not the caller's."""
    body = messages_body(HI, temperature=0.25, top_p=0.5, top_k=3, stop_sequences=["END", "##"],
                         metadata={"user_id": "u"}, service_tier="auto")
    assert convert(body, stream=True) == DEFAULTS | {
        "stream": True, "max_tokens": 7, "temperature": 0.25, "top_p": 0.5, "top_k": 3, "stop": ["END", "##"],
        "messages": [user_text("Hi")]}


def test_zero_sampling_values_are_sent_not_dropped():
    """Guards: a temperature or top_k of 0 (greedy) taken for unset."""
    assert convert(messages_body(HI, temperature=0.0, top_p=0.0, top_k=0, stop_sequences=[])) == DEFAULTS | {
        "max_tokens": 7, "temperature": 0.0, "top_p": 0.0, "top_k": 0, "messages": [user_text("Hi")]}


def test_count_tokens_request_has_no_sampling_fields():
    """Guards: count_tokens' request (no max_tokens) failing on the fields only Messages has."""
    body = {"model": "m", "messages": HI, "system": "S"}
    assert convert(body, CountTokensRequest) == DEFAULTS | {
        "messages": [{"role": "system", "content": "S"}, user_text("Hi")]}


def test_system_string_blocks_and_empty():
    """Guards: system text blocks not joined by a newline, an empty system sent as an empty
    system message, or a system block of another type accepted."""
    assert convert(messages_body(HI, system=[text("A"), text("B")]))["messages"][0] == {
        "role": "system", "content": "A\nB"}
    assert convert(messages_body(HI, system=""))["messages"] == [user_text("Hi")]
    assert convert(messages_body(HI, system=[]))["messages"] == [user_text("Hi")]
    e = refusal(messages_body(HI, system=[text("A"), {"type": "image"}]))
    assert (e.status, e.param, e.message) == (400, "system.1", "system.1: system holds text blocks only, not 'image'")
    e = refusal(messages_body([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                              "content": ["A"]}]}]))
    assert e.message == "messages.0.content.0.content.0: tool_result holds text blocks only, not 'str'"
    e = refusal(messages_body(HI, system=[{"type": "text", "text": 5}]))
    assert e.message == "system.0: system holds text blocks only, not 'text'"


def test_mid_conversation_system_message_in_place():
    """Guards: a system message inside `messages` moved, dropped, or its blocks not joined."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "system", "content": [text("X"), text("Y")]},
            {"role": "assistant", "content": "Yo"}, {"role": "system", "content": "Z"}]
    assert convert(messages_body(msgs))["messages"] == [
        user_text("Hi"), {"role": "system", "content": "X\nY"},
        {"role": "assistant", "content": [text("Yo")]}, {"role": "system", "content": "Z"}]
    e = refusal(messages_body([{"role": "system", "content": [{"type": "text", "text": None}]}]))
    assert (e.param, e.message) == ("messages.0.content.0",
                                    "messages.0.content.0: a system message holds text blocks only, not 'text'")


def test_user_blocks_images_and_tool_results_in_order():
    """Guards: a tool_result not split out as a tool message where it stands, user text after it
    lost or merged into the text before, an image's data URL misbuilt, or a tool_result's
    blocks not joined by a newline."""
    msgs = [{"role": "user", "content": [
        text("a"), {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "tool_result", "tool_use_id": "t1", "content": [text("r1"), text("r2")], "is_error": True},
        {"type": "tool_result", "tool_use_id": "t2", "content": "r3"},
        {"type": "tool_result", "tool_use_id": "t3"},
        {"type": "tool_result", "tool_use_id": "t4", "content": None},
        text("b")]}]
    assert convert(messages_body(msgs))["messages"] == [
        {"role": "user", "content": [text("a"), {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
        {"role": "tool", "tool_call_id": "t2", "content": "r3"},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
        {"role": "tool", "tool_call_id": "t4", "content": ""},
        user_text("b")]


def test_user_message_of_only_tool_results_and_of_no_blocks():
    """Guards: a user turn of tool results followed by an empty user message, or a user
    message with no blocks dropped (the turn must stay)."""
    msgs = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]
    assert convert(messages_body(msgs))["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "ok"}]
    assert convert(messages_body([{"role": "user", "content": []}]))["messages"] == [{"role": "user", "content": []}]


def test_assistant_thinking_text_and_tool_use():
    """Guards: thinking blocks not joined into reasoning_content, redacted_thinking kept, text
    or a tool_use's id, name or input misplaced, or content not None when there is no text."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t1", "signature": "s"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "thinking", "thinking": "t2"}, text("say"),
        {"type": "tool_use", "id": "c1", "name": "read", "input": {"path": "a"}},
        {"type": "tool_use", "id": "c2", "name": "ls", "input": {}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c3", "name": "ls", "input": {}}]},
        {"role": "assistant", "content": [text("only")]}]
    assert convert(messages_body(msgs))["messages"] == [user_text("Hi"), {
        "role": "assistant", "content": [text("say")], "reasoning_content": "t1\nt2", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": {"path": "a"}}},
            {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": {}}}]},
        {"role": "assistant", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "ls", "arguments": {}}}]},
        {"role": "assistant", "content": [text("only")]}]


@pytest.mark.parametrize("role, block, param, message", [
    ("user", {"type": "document"}, "messages.0.content.0",
     "messages.0.content.0: document blocks are not supported (text only)"),
    ("user", {"type": "search_result"}, "messages.0.content.0",
     "messages.0.content.0: search_result blocks are not supported (text only)"),
    ("assistant", {"type": "server_tool_use"}, "messages.0.content.0",
     "messages.0.content.0: server_tool_use blocks are not supported (text only)"),
    ("user", {"type": "container_upload"}, "messages.0.content.0",
     "messages.0.content.0: container_upload blocks are not supported (text only)"),
    ("user", {"type": "web_search_tool_result"}, "messages.0.content.0",
     "messages.0.content.0: web_search_tool_result blocks are not supported (text only)"),
    ("user", {"type": "thinking", "thinking": "x"}, "messages.0.content.0.type",
     "messages.0.content.0.type: unknown block type 'thinking' in a user message "
     "(expected one of text, image, tool_result)"),
    ("assistant", {"type": "image"}, "messages.0.content.0.type",
     "messages.0.content.0.type: unknown block type 'image' in an assistant message "
     "(expected one of text, thinking, redacted_thinking, tool_use)"),
    ("system", {"type": "image"}, "messages.0.content.0.type",
     "messages.0.content.0.type: unknown block type 'image' in a system message (expected one of text)"),
    ("user", {"text": "no type"}, "messages.0.content.0.type",
     "messages.0.content.0.type: unknown block type None in a user message "
     "(expected one of text, image, tool_result)"),
])
def test_block_type_refusals(role, block, param, message):
    """Guards: a block fermoe cannot serve (or one of a type it does not know, or of a type the
    role does not take) passing silently, or its refusal not naming where and what."""
    e = refusal(messages_body([{"role": role, "content": [block]}]))
    assert (e.status, e.param, e.message) == (400, param, message)


@pytest.mark.parametrize("role, block, param, message", [
    ("user", {"type": "text"}, "messages.0.content.0.text", "messages.0.content.0.text: Field required (str)"),
    ("user", {"type": "text", "text": 3}, "messages.0.content.0.text",
     "messages.0.content.0.text: expected str, got int"),
    ("user", {"type": "tool_result", "content": "x"}, "messages.0.content.0.tool_use_id",
     "messages.0.content.0.tool_use_id: Field required (str)"),
    ("user", {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]},
     "messages.0.content.0.content.0", "messages.0.content.0.content.0: tool_result holds text blocks only, not 'image'"),
    ("assistant", {"type": "thinking"}, "messages.0.content.0.thinking",
     "messages.0.content.0.thinking: Field required (str)"),
    ("assistant", {"type": "text", "text": []}, "messages.0.content.0.text",
     "messages.0.content.0.text: expected str, got list"),
    ("assistant", {"type": "tool_use", "name": "f", "input": {}}, "messages.0.content.0.id",
     "messages.0.content.0.id: Field required (str)"),
    ("assistant", {"type": "tool_use", "id": "c", "input": {}}, "messages.0.content.0.name",
     "messages.0.content.0.name: Field required (str)"),
    ("assistant", {"type": "tool_use", "id": "c", "name": "f", "input": "{}"}, "messages.0.content.0.input",
     "messages.0.content.0.input: expected dict, got str"),
])
def test_block_field_refusals(role, block, param, message):
    """Guards: a block missing a field, or holding one of the wrong type, passed on (a 500
    later, or a wrong prompt) instead of a 400 naming the field."""
    e = refusal(messages_body([{"role": role, "content": [block]}]))
    assert (e.status, e.param, e.message) == (400, param, message)


@pytest.mark.parametrize("block, param, message", [
    ({"type": "image"}, "messages.0.content.0.source", "messages.0.content.0.source: Field required (dict)"),
    ({"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}, "messages.0.content.0.source",
     "messages.0.content.0.source: url image sources are not fetched (the server fetches nothing); send the "
     "image as a base64 source"),
    ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "messages.0.content.0.source.type",
     "messages.0.content.0.source.type: expected 'base64', got 'file'"),
    ({"type": "image", "source": {"type": "base64", "data": PNG}}, "messages.0.content.0.source.media_type",
     "messages.0.content.0.source.media_type: Field required (str)"),
    ({"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": PNG}},
     "messages.0.content.0.source.media_type",
     "messages.0.content.0.source.media_type: expected an image/* type, got 'text/plain'"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, "messages.0.content.0.source.data",
     "messages.0.content.0.source.data: Field required (str)"),
])
def test_image_source_refusals(block, param, message):
    """Guards: a url source fetched or passed on, a source of another kind or type taken, or
    a base64 source without its data accepted."""
    e = refusal(messages_body([{"role": "user", "content": [block]}]))
    assert (e.status, e.param, e.message) == (400, param, message)


def test_tools_custom_server_and_description():
    """Guards: a custom tool's name, schema or description misplaced, a tool typed `custom`
    taken for a server tool, a non-string description sent, or a server tool kept as a
    function (it is passed on by type only, for the chat path to leave out)."""
    tools = [{"name": "read", "description": "Read a file", "input_schema": SCHEMA},
             {"type": "custom", "name": "ls", "input_schema": {"type": "object"}, "description": 5},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    assert convert(messages_body(HI, tools=tools))["tools"] == [
        {"type": "function", "function": {"name": "read", "parameters": SCHEMA, "description": "Read a file"}},
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
        {"type": "web_search_20250305"}]


@pytest.mark.parametrize("tool, param, message", [
    ({"name": "f"}, "tools.0.input_schema", "tools.0.input_schema: Field required: a custom tool needs its input_schema"),
    ({"name": "f", "input_schema": "{}"}, "tools.0.input_schema", "tools.0.input_schema: must be a JSON schema object"),
    ({"input_schema": {}}, "tools.0.name", "tools.0.name: Field required (str)"),
    ({"type": "custom", "name": "f"}, "tools.0.input_schema",
     "tools.0.input_schema: Field required: a custom tool needs its input_schema"),
])
def test_tool_refusals(tool, param, message):
    """Guards: a custom tool without a schema object or a name accepted."""
    e = refusal(messages_body(HI, tools=[tool]))
    assert (e.status, e.param, e.message) == (400, param, message)


@pytest.mark.parametrize("choice, fields", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "tool", "name": "read"}, {"tool_choice": {"type": "function", "function": {"name": "read"}}}),
    ({"type": "auto", "disable_parallel_tool_use": True}, {"tool_choice": "auto", "parallel_tool_calls": False}),
    ({"type": "any", "disable_parallel_tool_use": False}, {"tool_choice": "required"}),
    ({"type": "auto", "disable_parallel_tool_use": 1}, {"tool_choice": "auto"}),
])
def test_tool_choice_mapping(choice, fields):
    """Guards: a tool_choice kind mapped to the wrong OpenAI choice, the forced tool's name
    lost, or disable_parallel_tool_use (only `true`) not turning parallel calls off."""
    tool = {"name": "read", "input_schema": SCHEMA}
    got = convert(messages_body(HI, tools=[tool], tool_choice=choice))
    assert {k: got.get(k) for k in ("tool_choice", "parallel_tool_calls") if k in got} == fields


def test_tool_choice_without_tools_is_dropped_and_a_bad_kind_refused():
    """Guards: a choice sent without tools (the chat path refuses that; Anthropic does not), or
    an unknown choice kind or a forced tool without its name accepted."""
    got = convert(messages_body(HI, tool_choice={"type": "any"}))
    assert "tool_choice" not in got and "tools" not in got
    tools = [{"name": "read", "input_schema": SCHEMA}]
    e = refusal(messages_body(HI, tools=tools, tool_choice={"type": "required"}))
    assert (e.status, e.param, e.message) == (
        400, "tool_choice.type", "tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got 'required'")
    e = refusal(messages_body(HI, tools=tools, tool_choice={"type": "tool"}))
    assert (e.param, e.message) == ("tool_choice.name", "tool_choice.name: Field required (str)")


@pytest.mark.parametrize("thinking, fields", [
    ({"type": "enabled", "budget_tokens": 1024}, {"chat_template_kwargs": {"enable_thinking": True},
                                                  "reasoning_budget": 1024}),
    ({"type": "enabled", "budget_tokens": 0}, {"chat_template_kwargs": {"enable_thinking": True},
                                               "reasoning_budget": 0}),
    ({"type": "adaptive"}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "disabled", "budget_tokens": 9}, {"chat_template_kwargs": {"enable_thinking": False}}),
])
def test_thinking_mapping(thinking, fields):
    """Guards: thinking turned on or off wrongly, the budget lost (or sent where no budget
    applies), or a budget of 0 refused."""
    got = convert(messages_body(HI, thinking=thinking))
    assert {k: got[k] for k in ("chat_template_kwargs", "reasoning_budget") if k in got} == fields


@pytest.mark.parametrize("thinking, param, message", [
    ({"type": "on"}, "thinking.type", "thinking.type: expected 'enabled', 'disabled' or 'adaptive', got 'on'"),
    ({}, "thinking.type", "thinking.type: expected 'enabled', 'disabled' or 'adaptive', got None"),
    ({"type": "enabled"}, "thinking.budget_tokens",
     "thinking.budget_tokens: thinking.budget_tokens: expected an integer >= 0, got None"),
    ({"type": "enabled", "budget_tokens": -1}, "thinking.budget_tokens",
     "thinking.budget_tokens: thinking.budget_tokens: expected an integer >= 0, got -1"),
    ({"type": "enabled", "budget_tokens": True}, "thinking.budget_tokens",
     "thinking.budget_tokens: thinking.budget_tokens: expected an integer >= 0, got True"),
    ({"type": "enabled", "budget_tokens": 5.0}, "thinking.budget_tokens",
     "thinking.budget_tokens: thinking.budget_tokens: expected an integer >= 0, got 5.0"),
])
def test_thinking_refusals(thinking, param, message):
    """Guards: an unknown thinking type or a budget that is not an integer >= 0 (a bool is not
    one) accepted."""
    e = refusal(messages_body(HI, thinking=thinking))
    assert (e.status, e.param, e.message) == (400, param, message)


def test_a_budget_past_64_bits_is_anthropics_400_naming_it():
    """Guards: a budget_tokens past what MessagePack carries passed on (it failed to serialise
    on its way to the coordinator: a 500)."""
    assert convert(messages_body(HI, thinking={"type": "enabled", "budget_tokens": 2**63 - 1}))[
        "reasoning_budget"] == 2**63 - 1
    e = refusal(messages_body(HI, thinking={"type": "enabled", "budget_tokens": 2**63}))
    assert (e.status, e.param, e.message) == (
        400, "thinking.budget_tokens", "thinking.budget_tokens: expected an integer <= 9223372036854775807, got "
                                       "9223372036854775808")
