"""The chat endpoint's tools and reasoning in this process, no model: request fields -> the
Generate (tools, chat_template_kwargs, the history's calls and reasoning), the 400s, and the
response a stream of recorded model text becomes, streamed and not, read back with the
official `openai` client's own types; and the API key on every route of the table."""
from __future__ import annotations

import json

import msgspec
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from frontend import openai_request
from frontend.formats import ChatFormat
from frontend.metrics import Metrics
from frontend.schemas import APIError, ChatCompletionRequest, decode_body
from frontend.streaming import GenerationResponse
from shared import protocol as P
from tests.support.recorded_response import RECORDED, TYPED_ARGUMENTS, TYPED_CALL, TYPED_SCHEMA, NoUpstream, answer

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}}},
    {"type": "web_search"}]
USER = [{"role": "user", "content": "Show me a.py"}]
# RECORDED's call's arguments as sent: compared as text, where `20.0` would not pass for `20`
ARGUMENTS = '{"path": "src/ünï.py", "limit": 20}'


def body(**fields) -> ChatCompletionRequest:
    return decode_body(msgspec.json.encode({"messages": USER} | fields), ChatCompletionRequest)


def test_tools_history_and_template_settings_reach_the_generate():
    history = USER + [
        {"role": "assistant", "content": None, "reasoning": "need it", "tool_calls": [
            {"id": "call_1", "type": "function", "index": 0,
             "function": {"name": "read_file", "arguments": '{"path": "a.py", "limit": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}]
    g = openai_request.chat_generate(body(messages=history, tools=TOOLS, reasoning_effort="none",
                                          chat_template_kwargs={"preserve_thinking": True}))
    assert g.tools == TOOLS[:1]                                             # web_search left out
    assert g.chat_template_kwargs == {"preserve_thinking": True, "enable_thinking": False}
    a = g.messages[1]
    assert (a.reasoning_content, a.tool_calls[0].id, a.tool_calls[0].function.arguments) == \
        ("need it", "call_1", {"path": "a.py", "limit": 3})
    assert (g.messages[2].role, g.messages[2].tool_call_id) == ("tool", "call_1")
    explicit = openai_request.chat_generate(body(reasoning_effort="none",
                                                 chat_template_kwargs={"enable_thinking": True}))
    assert explicit.chat_template_kwargs == {"enable_thinking": True}      # the template kwargs say
    # an effort above none asks for reasoning, over a server's --reasoning off
    assert openai_request.chat_generate(body(reasoning_effort="high")).chat_template_kwargs == {"enable_thinking": True}
    assert openai_request.chat_generate(body()).chat_template_kwargs is None


@pytest.mark.parametrize("fields, param, word", [
    (dict(tool_choice="auto"), "tool_choice", "only allowed when 'tools'"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm"}}), "tool_choice", "'rm'"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "forces a call"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "integre"}}}}}], tool_choice="required"), "tools[0].function.parameters.properties.n",
     "integre"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "'required'"),
    (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name", "function.name"),
    (dict(tools=["read_file"]), "tools[0]", "type"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}),
     "response_format.json_schema.schema", "objekt"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": "x"}}}}}), "response_format.json_schema.schema", "minimum"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
     "response_format.json_schema.schema", "JSON schema object"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
     "response_format.json_schema.strict", "boolean"),
    (dict(response_format={"type": "yaml"}), "response_format", "'yaml'"),
    (dict(messages=USER + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "read_file", "arguments": "{oops"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "not JSON"),
    (dict(messages=USER + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "read_file", "arguments": "[1]"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]),
     "messages[0].tool_calls", "assistant"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs", "add_generation_prompt"),
    (dict(reasoning_format="deepseek-legacy"), "reasoning_format", "deepseek-legacy"),
])
def test_bad_tool_requests_are_400s_naming_the_field(fields, param, word):
    with pytest.raises(APIError) as e:
        openai_request.chat_generate(body(**fields))
    assert (e.value.status, e.value.param) == (400, param) and word in e.value.message, e.value.message


def test_tool_choice_and_response_format_become_the_generates_grammar():
    forced = openai_request.chat_generate(body(tools=TOOLS, parallel_tool_calls=False,
                                               tool_choice={"type": "function", "function": {"name": "read_file"}}))
    assert forced.grammar.kind == "lark" and "<function=read_file>" in forced.grammar.text
    assert '("\\n" call)*' not in forced.grammar.text                       # exactly one call
    assert '("\\n" call)*' in openai_request.chat_generate(body(tools=TOOLS, tool_choice="required")).grammar.text
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    answer = openai_request.chat_generate(body(response_format=fmt)).grammar
    assert answer.kind == "json_schema" and json.loads(answer.text)["properties"] == schema["properties"]
    either = openai_request.chat_generate(body(tools=TOOLS, response_format=fmt)).grammar
    assert either.kind == "lark" and either.text.startswith("start: answer | calls")
    assert openai_request.chat_generate(body(tools=TOOLS, tool_choice="none", response_format=fmt)).grammar.kind == \
        "json_schema"
    assert openai_request.chat_generate(body(tools=TOOLS)).grammar is None
    b = body(tools=TOOLS, tool_choice="required")
    parser = openai_request.chat_parser(b, openai_request.chat_generate(b), False, "deepseek")
    assert set(parser.schemas) == {"read_file"}


def test_tool_choice_none_renders_the_tools_and_parses_no_call():
    b = body(tools=TOOLS, tool_choice="none")
    msg = openai_request.chat_generate(b)
    assert msg.tools == TOOLS[:1] and openai_request.chat_parser(b, msg, False, "deepseek").schemas == {}
    b = body(tools=TOOLS)
    parser = openai_request.chat_parser(b, openai_request.chat_generate(b), False, "deepseek")
    assert set(parser.schemas) == {"read_file"}


# ---- recorded model text -> the response ------------------------------------------------------
def respond(pieces, streaming: bool, finish="stop", reasoning_format="deepseek", tools=TOOLS):
    b = body(tools=tools)
    fmt = ChatFormat(openai_request.chat_parser(b, openai_request.chat_generate(b), True, reasoning_format),
                     reasoning_format)
    return answer(lambda stream: GenerationResponse(NoUpstream(), stream, fmt, "m", streaming, False, Metrics()),
                  pieces, request_id="chatcmpl-x", finish=finish, prompt_tokens=5)


def chunks(raw: bytes) -> list[ChatCompletionChunk]:
    events = raw.decode().removesuffix("\n\n").split("\n\n")
    assert events[-1] == "data: [DONE]"
    return [ChatCompletionChunk.model_validate_json(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_call_comes_back_whole_as_openai_returns_it():
    r = ChatCompletion.model_validate_json(respond(RECORDED, streaming=False))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Reading it."
    assert choice.message.model_extra["reasoning_content"] == "The user wants a.py."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and len(call.id) == 29 and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("read_file", ARGUMENTS)


def test_a_call_streams_as_openai_streams_it():
    got = chunks(respond(RECORDED, streaming=True))
    deltas = [c.choices[0].delta for c in got]
    assert deltas[0].role == "assistant"
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert (reasoning, content) == ("The user wants a.py.", "Reading it.")
    assert calls[0].id.startswith("call_") and calls[0].function.name == "read_file" and calls[0].type == "function"
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert args == ARGUMENTS
    assert any(tc.function.arguments == '"path": "src/ü' for tc in calls)     # the string before it closed
    assert [c.choices[0].finish_reason for c in got] == [None] * (len(got) - 1) + ["tool_calls"]


def test_a_turn_cut_by_the_limit_is_length_and_its_call_still_parses():
    r = ChatCompletion.model_validate_json(respond(RECORDED[:13], streaming=False, finish="length"))
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"path": "src/ü"}'


TYPED = [{"type": "function", "function": {"name": "configure", "parameters": TYPED_SCHEMA}}]


def test_tool_arguments_keep_their_json_types_on_the_wire():
    """The `arguments` text compared as sent. Fault guarded: an integer converted as a float
    went out as `3.0`, which json.loads(...) == {"n": 3} passes (3 == 3.0) and a typed
    client (Go, Rust, a JSON schema with "type": "integer") refuses."""
    whole = ChatCompletion.model_validate_json(respond(TYPED_CALL, streaming=False, tools=TYPED))
    assert whole.choices[0].message.tool_calls[0].function.arguments == TYPED_ARGUMENTS
    streamed = chunks(respond(TYPED_CALL, streaming=True, tools=TYPED))
    calls = [tc for c in streamed for tc in c.choices[0].delta.tool_calls or []]
    assert "".join(tc.function.arguments or "" for tc in calls) == TYPED_ARGUMENTS


def test_reasoning_formats():
    both = ChatCompletion.model_validate_json(respond(RECORDED[:6], streaming=False, reasoning_format="both"))
    extra = both.choices[0].message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == "The user wants a.py."
    none = ChatCompletion.model_validate_json(respond(RECORDED[:6], streaming=False, reasoning_format="none"))
    assert none.choices[0].message.content == "".join(RECORDED[:6])
    assert "reasoning_content" not in none.choices[0].message.model_extra


def test_without_tools_a_call_is_content_and_the_reason_stop():
    r = ChatCompletion.model_validate_json(respond(RECORDED, streaming=False, tools=None))
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("Reading it.\n\n<tool_call>\n<function=read_file>")


# ---- the API key on every route ---------------------------------------------------------------
# Every route the app serves, written out here (not read from the app): (path, method, open without
# the key). The chat page and its icon are static (the page asks for the key), health is for probes.
ROUTES = [
    ("/", "GET", True), ("/favicon.ico", "GET", True), ("/health", "GET", True), ("/v1/health", "GET", True),
    ("/metrics", "GET", False), ("/tokenize", "POST", False), ("/detokenize", "POST", False),
    ("/v1/models", "GET", False), ("/v1/models/{model:path}", "GET", False), ("/models", "GET", False),
    ("/models/{model:path}", "GET", False), ("/v1/chat/completions", "POST", False),
    ("/chat/completions", "POST", False), ("/v1/completions", "POST", False), ("/completions", "POST", False),
    ("/v1/responses", "POST", False), ("/v1/messages", "POST", False), ("/v1/messages/count_tokens", "POST", False),
    ("/completion", "POST", False), ("/props", "GET", False), ("/apply-template", "POST", False),
    ("/slots", "GET", False)]


def test_every_route_is_listed_here_and_only_the_open_ones_answer_without_the_key(monkeypatch):
    """Faults guarded: a route added to the app, or a path added to its open list, passed a
    test that took both from the app itself; here a route the list lacks (or lists and the
    app lacks) fails, and each route's need of the key is the list's, not the app's."""
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from frontend.app import build_app
    from frontend.core import Settings
    from frontend.upstream import Upstream
    status = Upstream.status            # no coordinator there: its silence known in 0.2 s, not 5
    monkeypatch.setattr(Upstream, "status", lambda self, timeout_s=0.2: status(self, timeout_s))
    app = build_app(Settings(connect="tcp://127.0.0.1:9", api_key="sekrit"))
    served = sorted((r.path, m) for r in app.routes if isinstance(r, Route) for m in r.methods - {"HEAD"})
    assert served == sorted((path, method) for path, method, _ in ROUTES)
    assert len(app.routes) == len(ROUTES)                   # nothing but these (no mount, no other kind of route)
    with TestClient(app) as http:
        for route, method, open_ in ROUTES:
            path = route.replace("{model:path}", "some/model")
            r = http.request(method, path, json={})
            if open_:
                assert r.status_code != 401, (method, path)
                if path in ("/", "/favicon.ico"):
                    assert r.status_code == 200, (method, path)
                continue
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path)
            if path.startswith("/v1/messages"):         # Anthropic's error shape on its paths
                assert r.json() == {"type": "error", "error": {"type": "authentication_error", "message": (
                    "You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
                    "(Authorization: Bearer YOUR_KEY) or in x-api-key.")}}, (method, path)
            else:
                assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("missing_api_key", None)
            for wrong in ({"Authorization": "Bearer nope"}, {"x-api-key": "nope"}, {"Authorization": "Basic sekrit"}):
                assert http.request(method, path, json={}, headers=wrong).status_code == 401, (method, path, wrong)
            for right in ({"Authorization": "Bearer sekrit"}, {"x-api-key": "sekrit"}):
                if path in ("/v1/messages", "/v1/models", "/metrics"):  # past the key (to a coordinator not there)
                    got = http.request(method, path, json={}, headers=right)
                    assert got.status_code not in (401, 404, 405), (method, path, got.text)
        assert http.get("/no/such/route").status_code == 401      # the key first: unknown paths tell nothing


# ---- the same over ZeroMQ ---------------------------------------------------------------------
def test_generate_carries_tools_calls_and_template_settings_over_the_wire():
    from shared.errors import ProtocolError
    g = P.Generate(request_id="r", messages=[
        P.ChatMessage(role="user", content="q"),
        P.ChatMessage(role="assistant", content=None, reasoning_content="r", tool_calls=[
            P.ToolCall(id="c", function=P.FunctionCall(name="read_file", arguments={"path": "ü.py"}))]),
        P.ChatMessage(role="tool", content="x", tool_call_id="c", name="read_file")],
        tools=TOOLS[:1], chat_template_kwargs={"enable_thinking": False})
    assert P.decode(P.encode(g), P.CLIENT_MESSAGES) == g
    raw = msgspec.msgpack.decode(P.encode(g))
    raw["messages"][0]["mood"] = "curious"
    with pytest.raises(ProtocolError, match="mood"):
        P.decode(msgspec.msgpack.encode(raw), P.CLIENT_MESSAGES)
    old = {"type": "generate", "request_id": "r", "messages": [{"role": "user", "content": "q"}]}
    assert P.decode(msgspec.msgpack.encode(old), P.CLIENT_MESSAGES).messages[0].reasoning_content is None
