"""frontend/responses_request.py on its own: a Responses body decoded and turned into the chat
request the chat path serves, item by item and field by field, and each refusal's status,
`param`, `code` and message exactly (the message is what names the problem to the user)."""
from __future__ import annotations

import json
import logging

import pytest

from frontend.errors import APIError
from tests.support.request_units import set_fields
from frontend.responses_request import ResponsesRequest, chat_request, flat_name, namespaced

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
NOT_KEPT = "fermoe keeps no responses: send the whole conversation in `input` (with store: false)"
DEFAULTS = {"stream": False, "ignore_eos": False}
IMAGE = "data:image/png;base64,iVBORw0KGgo="




def convert(**body) -> dict:
    return set_fields(chat_request(ResponsesRequest.decode(json.dumps(body).encode())))


def history(*items) -> list:
    return convert(input=list(items))["messages"]


def refusal(raw: bytes | dict) -> APIError:
    raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(APIError) as e:
        chat_request(ResponsesRequest.decode(raw))
    return e.value


def text_part(t: str, kind: str = "input_text") -> dict:
    return {"type": kind, "text": t}


def user(t: str) -> dict:
    return {"role": "user", "content": t}


# ---- decoding -------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, param, code, message", [
    (b"{", None, "invalid_json", "We could not parse the JSON body of your request."),
    (b"[]", None, "invalid_json", "the request body must be a JSON object"),
    (b"{}", "input", "missing_required_parameter", "Missing required parameter: 'input'."),
    (b'{"input": "x", "temperature": 2.5}', "temperature", "invalid_value",
     "Invalid 'temperature': Expected `float` <= 2.0"),
    (b'{"input": "x", "max_output_tokens": 0}', "max_output_tokens", "invalid_value",
     "Invalid 'max_output_tokens': Expected `int` >= 1"),
    (b'{"input": "x", "previous_response_id": "resp_1"}', "previous_response_id", "invalid_value",
     f"previous_response_id: {NOT_KEPT}"),
    (b'{"input": "x", "conversation": "conv_1"}', "conversation", "invalid_value", f"conversation: {NOT_KEPT}"),
    (b'{"input": "x", "background": true}', "background", "unsupported_parameter",
     "background: background responses are not supported"),
    (b'{"input": "x", "top_logprobs": 1}', "top_logprobs", "unsupported_parameter",
     "top_logprobs: logprobs are not supported on /v1/responses yet (/v1/chat/completions has them)"),
    (b'{"input": "x", "top_logprobs": 2}', "top_logprobs", "unsupported_parameter",
     "top_logprobs: logprobs are not supported on /v1/responses yet (/v1/chat/completions has them)"),
    (b'{"input": "x", "top_logprobs": true}', "top_logprobs", "unsupported_parameter",
     "top_logprobs: logprobs are not supported on /v1/responses yet (/v1/chat/completions has them)"),
    (b'{"input": []}', "messages", "invalid_value", "Invalid 'messages': Expected `array` of length >= 1"),
    (b'{"input": "x", "include": ["message.output_text.logprobs"]}', "include", "unsupported_parameter",
     "include: message.output_text.logprobs is not supported yet (/v1/chat/completions has logprobs)"),
])
def test_decode_refusals(raw, param, code, message):
    """Guards: a body that is not an object, misses or misfills a field, asks for a kept
    response, a background run or logprobs, or has no messages at all (an empty input),
    accepted or refused without naming why."""
    e = refusal(raw)
    assert (e.status, e.param, e.code, e.message) == (400, param, code, message)


def test_fields_taken_without_effect_and_unknown_ones_logged(caplog):
    """Guards: a falsy top_logprobs, background false, store, metadata or user refused; an
    `include` that is not a list taken for one; or the log line naming the ignored fields
    wrong (what an operator reads to learn why a client's option had no effect)."""
    caplog.set_level(logging.INFO, logger="fermoe.http")
    assert convert(input="x", top_logprobs=0, background=False, store=False, metadata={"k": "v"}, user="u",
                   include="message.output_text.logprobs", model="m") == DEFAULTS | {"messages": [user("x")]}
    assert convert(input="x", top_logprobs=False)["messages"] == [user("x")]
    assert [r.getMessage() for r in caplog.records] == ["ignored Responses fields: include, top_logprobs",
                                                        "ignored Responses fields: top_logprobs"]


# ---- the request's own fields ---------------------------------------------------------------------
def test_sampling_fields_stream_and_effort_carried():
    """Guards: instructions not the first (system) message, max_output_tokens not max_tokens,
    temperature, top_p, parallel_tool_calls, stream or reasoning.effort dropped."""
    assert convert(input="Hi", instructions="Be brief", max_output_tokens=9, temperature=0.0, top_p=0.5,
                   parallel_tool_calls=False, stream=True, reasoning={"effort": "low", "summary": "auto"}) == {
        "stream": True, "ignore_eos": False, "max_tokens": 9, "temperature": 0.0, "top_p": 0.5,
        "parallel_tool_calls": False, "reasoning_effort": "low",
        "messages": [{"role": "system", "content": "Be brief"}, user("Hi")]}


def test_empty_instructions_and_a_non_string_effort_are_left_out():
    """Guards: an empty system message sent, or a reasoning object without a string effort
    taken for one."""
    assert convert(input="Hi", instructions="", reasoning={"effort": None, "summary": "auto"}) == DEFAULTS | {
        "messages": [user("Hi")]}
    assert convert(input="Hi", reasoning={"effort": 3}) == DEFAULTS | {"messages": [user("Hi")]}


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "text"}, {"type": "text"}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True, "description": "d", "extra": 1},
     {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True, "description": "d"}}),
    ({"type": "json_schema", "schema": SCHEMA}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
])
def test_text_format_onto_response_format(fmt, expected):
    """Guards: a format kind mapped wrongly, or json_schema's name, schema, strict or
    description not moved under json_schema (or a key of its own passed with them)."""
    assert convert(input="x", text={"format": fmt, "verbosity": "low"})["response_format"] == expected


def test_text_without_a_format_and_bad_formats():
    """Guards: a text object without `format` taken for one, or a format of no known type
    (or not an object) accepted."""
    assert "response_format" not in convert(input="x", text={"verbosity": "low"})
    for fmt, kind in (({"type": "xml"}, "'xml'"), ("json", "None")):
        e = refusal({"input": "x", "text": {"format": fmt}})
        assert (e.status, e.param, e.code, e.message) == (
            400, "text.format", "invalid_value", f"text.format: expected type text, json_object or json_schema, got {kind}")


# ---- tools ----------------------------------------------------------------------------------------
def test_function_namespace_and_other_tools():
    """Guards: a function's name, schema (null taken as {}) or description misplaced, a
    namespace's functions not flattened to NS__NAME (or its inner `type` required), or
    another kind of tool not passed on by type alone for the chat path to leave out."""
    tools = [{"type": "function", "name": "read", "description": "Read", "parameters": SCHEMA, "strict": True},
             {"type": "function", "name": "ls", "parameters": None, "description": 7},
             {"type": "namespace", "name": "agents", "tools": [
                 {"name": "spawn", "parameters": SCHEMA, "description": "Spawn one"},
                 {"type": "function", "name": "wait", "parameters": {}}]},
             {"type": "web_search", "search_context_size": "low"}]
    assert convert(input="x", tools=tools)["tools"] == [
        {"type": "function", "function": {"name": "read", "parameters": SCHEMA, "description": "Read"}},
        {"type": "function", "function": {"name": "ls", "parameters": {}}},
        {"type": "function", "function": {"name": "agents__spawn", "parameters": SCHEMA, "description": "Spawn one"}},
        {"type": "function", "function": {"name": "agents__wait", "parameters": {}}},
        {"type": "web_search"}]
    assert convert(input="x", tools=[])["tools"] == []


@pytest.mark.parametrize("tool, param, code, message", [
    ("read", "tools[0]", "invalid_value", "Invalid 'tools[0]': Expected `object`, got `str`"),
    ({"name": "read"}, "tools[0]", "invalid_value", "tools[0]: a tool is an object with a `type`"),
    ({"type": "function", "name": "f"}, "tools[0].parameters", "missing_required_parameter",
     "tools[0].parameters: Missing required parameter: a function tool needs its JSON schema (null for none)"),
    ({"type": "function", "parameters": {}}, "tools[0].name", "missing_required_parameter",
     "tools[0].name: Missing required parameter"),
    ({"type": "function", "name": 3, "parameters": {}}, "tools[0].name", "invalid_type",
     "tools[0].name: expected a string"),
    ({"type": "namespace", "tools": []}, "tools[0].name", "missing_required_parameter",
     "tools[0].name: Missing required parameter"),
    ({"type": "namespace", "name": "ns"}, "tools[0].tools", "invalid_value",
     "tools[0].tools: a namespace tool needs its `tools`, a list of functions"),
    ({"type": "namespace", "name": "ns", "tools": [{"name": "a", "parameters": {}}, {"type": "web_search"}]},
     "tools[0].tools[1]", "invalid_value", "tools[0].tools[1]: a namespace holds function tools only"),
    ({"type": "namespace", "name": "ns", "tools": ["a"]}, "tools[0].tools[0]", "invalid_value",
     "tools[0].tools[0]: a namespace holds function tools only"),
    ({"type": "namespace", "name": "ns", "tools": [{"name": "a"}]}, "tools[0].tools[0].parameters",
     "missing_required_parameter", "tools[0].tools[0].parameters: Missing required parameter: a function tool "
                                   "needs its JSON schema (null for none)"),
])
def test_tool_refusals(tool, param, code, message):
    """Guards: a tool without a type, a function without its schema or name, or a namespace
    without its functions (or holding something else) accepted."""
    e = refusal({"input": "x", "tools": [tool]})
    assert (e.status, e.param, e.code, e.message) == (400, param, code, message)


@pytest.mark.parametrize("choice, expected", [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "read"}, {"type": "function", "function": {"name": "read"}})])
def test_tool_choice_mapping(choice, expected):
    """Guards: a choice changed on its way to chat's, or a forced function's name lost."""
    got = convert(input="x", tools=[{"type": "function", "name": "read", "parameters": SCHEMA}], tool_choice=choice)
    assert got["tool_choice"] == expected


@pytest.mark.parametrize("choice", [{"type": "function"}, {"type": "allowed_tools", "name": "read"},
                                    {"type": "function", "name": 1}])
def test_bad_tool_choices(choice):
    """Guards: a forced choice without a function name (or of another kind) accepted."""
    e = refusal({"input": "x", "tool_choice": choice})
    assert (e.status, e.param, e.code, e.message) == (
        400, "tool_choice", "invalid_value",
        "tool_choice: expected 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": NAME}")


def test_namespaced_maps_flat_names_back():
    """Guards: a namespace's function not found under its flat name (its calls then answered
    without their namespace), or a malformed tool breaking the lookup."""
    tools = [{"type": "namespace", "name": "ns", "tools": [{"name": "a"}, {"name": 3}, "b", {"name": "c"}]},
             {"type": "namespace", "name": 5, "tools": [{"name": "x"}]}, {"type": "namespace", "name": "empty"},
             {"type": "function", "name": "f"}, "junk"]
    assert namespaced(tools) == {"ns__a": ("ns", "a"), "ns__c": ("ns", "c")}
    assert namespaced(None) == {}
    assert flat_name("mcp", "read") == "mcp__read"


# ---- input items ----------------------------------------------------------------------------------
def test_messages_of_each_role_and_part_kind():
    """Guards: a role changed (developer stays developer for chat to render as system), a
    message's text parts not joined by a newline, a refusal part's text lost, or an item with
    a role but no type not taken for a message."""
    assert history(
        {"role": "developer", "content": [text_part("a"), text_part("b", "text")]},
        {"type": "message", "role": "system", "content": "s"},
        {"role": "user", "content": [text_part("u1"), text_part("u2")]},
        {"role": "assistant", "content": [text_part("o", "output_text"), {"type": "refusal", "refusal": "no"}]},
    ) == [{"role": "developer", "content": "a\nb"}, {"role": "system", "content": "s"}, user("u1\nu2"),
          {"role": "assistant", "content": "o\nno"}]


def test_a_user_message_with_images_is_parts_in_order():
    """Guards: an image's data: URL misplaced, text around it lost or reordered, or an upper
    case DATA: scheme refused."""
    upper = "DATA:image/png;base64,AA=="
    assert history({"role": "user", "content": [
        text_part("look"), {"type": "input_image", "image_url": IMAGE, "detail": "auto"},
        {"type": "input_image", "image_url": upper, "file_id": "f"}, text_part("done")]}) == [
        {"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": IMAGE}},
            {"type": "image_url", "image_url": {"url": upper}}, {"type": "text", "text": "done"}]}]


def test_reasoning_calls_and_outputs_make_the_assistant_turns():
    """Guards: reasoning not the next assistant turn's (content before summary, items joined by
    a newline, empty ones skipped), calls not merged into the turn they follow (or merged into
    one reasoning separates them from), a namespace call not renamed NS__NAME, empty
    arguments refused, or outputs not tool messages matched by call_id."""
    assert history(
        user("go"),
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}],
         "content": [{"type": "reasoning_text", "text": "r1"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r2"}], "content": []},
        {"type": "reasoning", "summary": [], "content": None},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": ""}]},
        {"role": "assistant", "content": [text_part("A", "output_text")]},
        {"role": "assistant", "content": "B"},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path": "a"}'},
        {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "A"},
        {"type": "function_call_output", "call_id": "c2", "output": [text_part("x", "output_text"), text_part("y")]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r3"}]},
        {"type": "function_call", "call_id": "c3", "name": "ls", "namespace": "", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3"},
    ) == [user("go"),
          {"role": "assistant", "content": "AB", "reasoning_content": "r1\nr2", "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a"}'}},
              {"id": "c2", "type": "function", "function": {"name": "agents__spawn", "arguments": ""}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "A"},
          {"role": "tool", "tool_call_id": "c2", "content": "x\ny"},
          {"role": "assistant", "reasoning_content": "r3", "tool_calls": [
              {"id": "c3", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c3", "content": ""}]


def test_a_turn_that_was_all_reasoning_is_an_empty_assistant_message():
    """Guards: reasoning sent back without a message after it (Codex's turn that only thought)
    lost, or joined to the next user message."""
    assert history(user("a"), {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
                   user("b")) == [user("a"), {"role": "assistant", "content": "", "reasoning_content": "hm"}, user("b")]
    assert history(user("a"), {"role": "assistant", "content": "x"},
                   {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
                   {"role": "assistant", "content": "y"}) == [
        user("a"), {"role": "assistant", "content": "x"},
        {"role": "assistant", "content": "y", "reasoning_content": "hm"}]


@pytest.mark.parametrize("item, param, code, message", [
    ({"type": "message", "role": "tool", "content": "x"}, "input[0].role", "invalid_value",
     "input[0].role: expected user, system, developer or assistant, got 'tool'"),
    ({"type": "message", "content": "x"}, "input[0].role", "invalid_value",
     "input[0].role: expected user, system, developer or assistant, got None"),
    ({"role": "user"}, "input[0].content", "missing_required_parameter", "input[0].content: Missing required parameter"),
    ({"content": "x"}, "input[0].type", "invalid_value",
     "input[0].type: unknown input item type None (expected message, function_call, function_call_output or "
     "reasoning)"),
    ({"type": "local_shell_call"}, "input[0].type", "invalid_value",
     "input[0].type: unknown input item type 'local_shell_call' (expected message, function_call, "
     "function_call_output or reasoning)"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0]", "invalid_value", f"input[0]: {NOT_KEPT}"),
    ({"role": "system", "content": 5}, "input[0].content", "invalid_value",
     "input[0].content: expected a string or a list of content parts"),
    ({"role": "assistant", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]",
     "unsupported_parameter", "input[0].content[0]: content parts of type 'input_file' are not supported here "
                              "(text only; input_image in user messages)"),
    ({"role": "system", "content": [{"type": "input_audio"}]}, "input[0].content[0]", "unsupported_parameter",
     "input[0].content[0]: content parts of type 'input_audio' are not supported here (text only; input_image "
     "in user messages)"),
    ({"role": "user", "content": [{"type": "video", "text": "x"}]}, "input[0].content[0]", "invalid_value",
     "input[0].content[0]: unknown content part 'video' (expected input_text or output_text)"),
    ({"role": "user", "content": ["x"]}, "input[0].content[0]", "invalid_value",
     "input[0].content[0]: unknown content part None (expected input_text or output_text)"),
    ({"role": "user", "content": [{"type": "input_text", "text": 1}]}, "input[0].content[0]", "invalid_value",
     "input[0].content[0]: unknown content part 'input_text' (expected input_text or output_text)"),
    ({"role": "user", "content": [{"type": "refusal"}]}, "input[0].content[0]", "invalid_value",
     "input[0].content[0]: unknown content part 'refusal' (expected input_text or output_text)"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}, {"type": "x"}]},
     "input[0].content[1][0]", "invalid_value",
     "input[0].content[1][0]: unknown content part 'x' (expected input_text or output_text)"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}, "input[0].content[0].file_id",
     "unsupported_parameter", "input[0].content[0].file_id: file ids are not supported (fermoe keeps no files): "
                              "send image_url as a base64 data: URL"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]},
     "input[0].content[0].image_url", "invalid_value",
     "input[0].content[0].image_url: expected a base64 data: URL (data:image/png;base64,...); the server fetches "
     "nothing"),
    ({"role": "user", "content": [{"type": "input_image"}]}, "input[0].content[0].image_url", "invalid_value",
     "input[0].content[0].image_url: expected a base64 data: URL (data:image/png;base64,...); the server fetches "
     "nothing"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id", "missing_required_parameter",
     "input[0].call_id: Missing required parameter"),
    ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input[0].name", "missing_required_parameter",
     "input[0].name: Missing required parameter"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}, "input[0].arguments", "invalid_type",
     "input[0].arguments: expected a string"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}, "input[0].arguments", "invalid_value",
     "input[0].arguments: not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ({"type": "function_call_output", "call_id": 7, "output": "x"}, "input[0].call_id", "invalid_type",
     "input[0].call_id: expected a string"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}, "input[0].output[0]",
     "unsupported_parameter", "input[0].output[0]: content parts of type 'input_image' are not supported here "
                              "(text only; input_image in user messages)"),
    ({"type": "reasoning", "content": [{"type": "input_image"}]}, "input[0].content[0]", "unsupported_parameter",
     "input[0].content[0]: content parts of type 'input_image' are not supported here (text only; input_image in "
     "user messages)"),
    ({"type": "reasoning", "content": "thought"}, None, None, None),
])
def test_input_item_refusals(item, param, code, message):
    """Guards: an item of an unknown type or role, without its content, call id, name or JSON
    arguments, or holding parts fermoe cannot serve, accepted (or refused without naming the
    item and field)."""
    if message is None:             # a reasoning item's content as a plain string is its text
        assert history(item, user("x")) == [{"role": "assistant", "content": "", "reasoning_content": "thought"},
                                            user("x")]
        return
    e = refusal({"input": [item]})
    assert (e.status, e.param, e.code, e.message) == (400, param, code, message)
