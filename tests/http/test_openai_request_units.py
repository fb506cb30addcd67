"""frontend/openai_request.py on its own: chat and text completion bodies -> the Generate, and
each refusal's `param`, `code` and message exactly (the message is what names the problem to
the user)."""
from __future__ import annotations

import base64
import json

import pytest

from frontend import openai_request
from frontend.schemas import APIError, ChatCompletionRequest, decode_body
from shared import protocol as P
from tests.support.request_units import chat_generate, completion_generate

USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOL = {"type": "function", "function": {"name": "read", "parameters": SCHEMA}}
PNG = b"\x89PNG\r\n\x1a\n"
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def chat(**fields) -> P.Generate:
    return chat_generate(USER, **fields)


completion = completion_generate


def refused(make, **fields) -> tuple:
    with pytest.raises(APIError) as e:
        make(**fields)
    return e.value.status, e.value.param, e.value.code, e.value.message


def invalid(param, message):
    return 400, param, "invalid_value", message


def unsupported(param, message):
    return 400, param, "unsupported_parameter", message


# ---- sampling fields ------------------------------------------------------------------------------
def test_unset_names_what_the_request_leaves_to_the_server():
    """Guards: a field the request set reported unset (the server's default would replace it),
    or max_tokens reported unset when max_tokens, max_completion_tokens or n_predict gave it."""
    names = ["temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty",
             "repeat_last_n", "seed"]
    g = chat()
    assert set(names) <= set(g.unset) and "max_tokens" in g.unset
    g = chat(temperature=0.5, top_k=-1, seed=-1, max_completion_tokens=3)
    assert "temperature" not in g.unset and "top_k" not in g.unset and "max_tokens" not in g.unset
    assert "seed" in g.unset and (g.sampling.top_k, g.max_tokens) == (0, 3)
    assert "max_tokens" not in chat(max_tokens=2).unset and "max_tokens" not in chat(n_predict=4).unset
    assert "max_tokens" not in completion(max_tokens=2).unset and "max_tokens" in completion().unset


def test_stop_seed_and_ignore_eos_reach_the_generate():
    """Guards: a single stop string not made a list, a seed of 0 dropped, or ignore_eos lost."""
    g = chat(stop="END", seed=0, ignore_eos=True)
    assert (g.stop, g.sampling.seed, g.ignore_eos) == (["END"], 0, True)
    assert (chat(stop=["a", "b"]).stop, chat().stop) == (["a", "b"], [])


@pytest.mark.parametrize("bias, expected", [
    ({"7": 1, "3": -100.0, "12": 0.5}, ((3, -100.0), (7, 1.0), (12, 0.5))),
    ({}, ()),
])
def test_object_bias_pairs_in_id_order(bias, expected):
    """Guards: logit_bias pairs out of id order, ids not ints or biases not floats."""
    assert openai_request.object_bias(bias) == expected
    if bias:
        assert chat(logit_bias=bias).sampling.logit_bias == expected


@pytest.mark.parametrize("bias, message", [
    ([[1, 2.0]], 'logit_bias must be an object: {"token id": bias}'),
    ({"a": 1}, "logit_bias keys are token ids, got 'a'"),
    ({"-1": 1}, "logit_bias keys are token ids, got '-1'"),
    ({"1": True}, "logit_bias['1']: expected a number, got True"),
    ({"1": "2"}, "logit_bias['1']: expected a number, got '2'"),
])
def test_bad_object_bias(bias, message):
    """Guards: a logit_bias that is not {"token id": number} taken."""
    with pytest.raises(APIError) as e:
        openai_request.object_bias(bias)
    assert (e.value.status, e.value.param, e.value.code, e.value.message) == invalid("logit_bias", message)


# ---- content and images ---------------------------------------------------------------------------
def test_message_content_text_parts_joined_and_images_in_order():
    """Guards: text parts not joined by a newline, null content not empty text, or an image's
    bytes and the text around it out of order."""
    g = chat(messages=[{"role": "system", "content": None},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": [{"type": "text", "text": "see"},
                                                    {"type": "image_url", "image_url": {"url": PNG_URL}},
                                                    {"type": "image_url", "image_url": PNG_URL}]}])
    assert [m.content for m in g.messages] == ["", "a\nb", "ok", [P.TextPart(text="see"), P.ImagePart(data=PNG),
                                                                  P.ImagePart(data=PNG)]]


@pytest.mark.parametrize("part, expected", [
    ({"type": "input_audio", "input_audio": {}}, unsupported(
        "messages[0].content[1]", "content parts of type 'input_audio' are not supported (text and image_url only)")),
    ({"type": "text"}, unsupported(
        "messages[0].content[1]", "content parts of type 'text' are not supported (text and image_url only)")),
    ({"type": "image_url", "image_url": {}}, invalid(
        "messages[0].content[1]", "image_url needs a url: a data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": ""}, invalid(
        "messages[0].content[1]", "image_url needs a url: a data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": {"url": "HTTPS://x/a.png"}}, invalid(
        "messages[0].content[1]", "image_url: http(s) URLs are not fetched (the server fetches nothing); send the "
                                  "image inline as a data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": {"url": "http://x/a.png"}}, invalid(
        "messages[0].content[1]", "image_url: http(s) URLs are not fetched (the server fetches nothing); send the "
                                  "image inline as a data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": {"url": "http://host:8080/a.png"}}, invalid(
        "messages[0].content[1]", "image_url: http(s) URLs are not fetched (the server fetches nothing); send the "
                                  "image inline as a data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": {"url": "file:///a.png"}}, invalid(
        "messages[0].content[1]", "image_url: expected a base64 data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64"}}, invalid(
        "messages[0].content[1]", "image_url: expected a base64 data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": {"url": "data:image/png,AAAA"}}, invalid(
        "messages[0].content[1]", "image_url: expected a base64 data: URL (data:image/png;base64,...)")),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA*A"}}, invalid(
        "messages[0].content[1]", "image_url: the data: URL's payload is not valid base64")),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA*"}}, invalid(
        "messages[0].content[1]", "image_url: the data: URL's payload is not valid base64")),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA,AAAA"}}, invalid(
        "messages[0].content[1]", "image_url: the data: URL's payload is not valid base64")),
])
def test_bad_content_parts_and_image_urls(part, expected):
    """Guards: a part of a kind fermoe cannot serve, a URL to fetch, or a data: URL that is not
    base64 (or not valid base64) accepted, or refused without naming the part."""
    content = [{"type": "text", "text": "x"}, part]
    assert refused(chat, messages=[{"role": "user", "content": content}]) == expected


def test_an_image_at_the_size_limit_and_over_it():
    """Guards: the size bound on an image's base64 payload moved (over it: refused before it is
    decoded)."""
    limit = 27962028            # base64 of 20 MiB (P.MAX_IMAGE_BYTES): 4 * ceil(20971520 / 3) characters
    assert openai_request.data_url_bytes("p", "DATA:image/png;BASE64," + "A" * limit) == b"\0" * (limit * 3 // 4)
    with pytest.raises(APIError) as e:
        openai_request.data_url_bytes("p", "data:image/png;base64," + "A" * (limit + 1))
    assert (e.value.status, e.value.param, e.value.code, e.value.message) == invalid(
        "p", "image_url: the image is over the limit of 20971520 bytes")


# ---- text completion prompts ----------------------------------------------------------------------
@pytest.mark.parametrize("prompt, expected", [
    ("Hi", {"prompt": "Hi"}), (["Hi"], {"prompt": "Hi"}), ([1, 2], {"tokens": [1, 2]}), ([[3, 4]], {"tokens": [3, 4]}),
    ([2**63 - 1], {"tokens": [2**63 - 1]}), ([-(2**63) + 1], {"tokens": [-(2**63) + 1]}),
])
def test_prompt_forms(prompt, expected):
    """Guards: one of OpenAI's four prompt forms (a string, token ids, a batch of one of either)
    sent as the wrong kind."""
    g = completion(prompt=prompt)
    assert {k: getattr(g, k) for k in ("prompt", "tokens") if getattr(g, k) is not None} == expected


@pytest.mark.parametrize("prompt, expected", [
    (["a", "b"], unsupported("prompt", "a batch of 2 prompts: only one prompt per request is supported")),
    ([[1], [2], [3]], unsupported("prompt", "a batch of 3 prompts: only one prompt per request is supported")),
    ([], invalid("prompt", "Invalid 'prompt': expected a string or a non-empty list of token ids")),
    ([[]], invalid("prompt", "Invalid 'prompt': expected a string or a non-empty list of token ids")),
    ([1, "a"], invalid("prompt", "Invalid 'prompt': expected a string or a non-empty list of token ids")),
    ([1, True], invalid("prompt", "Invalid 'prompt': expected a string or a non-empty list of token ids")),
    ([-(2**63)], invalid("prompt", "Invalid 'prompt': expected a string or a non-empty list of token ids")),
])
def test_bad_prompts(prompt, expected):
    """Guards: a batch, an empty list, or a list that is not all token ids in range taken."""
    assert refused(completion, prompt=prompt) == expected


def test_completion_refusals_and_the_choices_bound():
    """Guards: echo, suffix or best_of > 1 taken; best_of 1 or n at its bounds refused."""
    assert completion(best_of=1, n=16, suffix="").request_id.startswith("cmpl-")
    assert chat(n=1).request_id.startswith("chatcmpl-")
    assert refused(completion, best_of=0) == unsupported("best_of", "best_of = 0: only one choice per request is "
                                                                    "supported")
    assert refused(chat, n=17) == invalid("n", "n must be in [1, 16], got 17")
    assert refused(completion, n=0) == invalid("n", "n must be in [1, 16], got 0")


# ---- tools and tool_choice ------------------------------------------------------------------------
@pytest.mark.parametrize("tools, expected", [
    ([{"function": {}}], invalid("tools[0]", "tools[0]: a tool is an object with a `type`")),
    (["read"], invalid("tools[0]", "tools[0]: a tool is an object with a `type`")),
    ([TOOL, {"type": "function"}], invalid("tools[1].function.name", "tools[1]: a function tool needs function.name")),
    ([{"type": "function", "function": {"name": " "}}], invalid("tools[0].function.name",
                                                                "tools[0]: a function tool needs function.name")),
    ([{"type": "function", "function": {"name": 1}}], invalid("tools[0].function.name",
                                                              "tools[0]: a function tool needs function.name")),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], invalid(
        "tools[0].function.parameters", "tools[0].function.parameters must be a JSON schema object")),
])
def test_bad_tools(tools, expected):
    """Guards: a tool without a type, a function without a name, or a schema that is not an
    object accepted."""
    assert refused(chat, tools=tools) == expected


def test_tools_other_kinds_left_out_and_a_function_without_parameters_taken():
    """Guards: a non-function tool kept for the template, or a function without a schema
    refused (parameters are optional on chat)."""
    g = chat(tools=[{"type": "web_search"}, {"type": "function", "function": {"name": "f"}}])
    assert [t["function"]["name"] for t in g.tools] == ["f"]
    assert chat(tools=[{"type": "web_search"}]).tools is None


@pytest.mark.parametrize("fields, choice", [
    (dict(tools=[TOOL]), "auto"), (dict(), "none"), (dict(tools=[{"type": "web_search"}]), "none"),
    (dict(tools=[TOOL], tool_choice="none"), "none"), (dict(tools=[TOOL], tool_choice="required"), "required"),
    (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "read"}}), "read"),
])
def test_tool_choice_defaults_and_names(fields, choice):
    """Guards: the default choice with and without function tools, or a named function not
    taken."""
    body = decode_body(json.dumps({"messages": USER} | fields).encode(), ChatCompletionRequest)
    assert openai_request.tool_choice(body, openai_request.tools(body)) == choice


@pytest.mark.parametrize("fields, expected", [
    (dict(tool_choice="auto"), invalid("tool_choice", "Invalid value for 'tool_choice': 'tool_choice' is only "
                                                      "allowed when 'tools' are specified.")),
    (dict(tools=[TOOL], tool_choice="any"), invalid(
        "tool_choice", 'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": '
                       '{"name": NAME}}')),
    (dict(tools=[TOOL], tool_choice={"type": "tool", "function": {"name": "read"}}), invalid(
        "tool_choice", 'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": '
                       '{"name": NAME}}')),
    (dict(tools=[TOOL], tool_choice={"type": "function", "function": "read"}), invalid(
        "tool_choice", 'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": '
                       '{"name": NAME}}')),
    (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "write"}}), invalid(
        "tool_choice", "tool_choice names the function 'write', which is not among the tools ('read')")),
    (dict(tools=[TOOL, {"type": "function", "function": {"name": "ls"}}],
          tool_choice={"type": "function", "function": {"name": "x"}}), invalid(
        "tool_choice", "tool_choice names the function 'x', which is not among the tools ('read', 'ls')")),
    (dict(tools=[{"type": "web_search"}], tool_choice={"type": "function", "function": {"name": "x"}}), invalid(
        "tool_choice", "tool_choice names the function 'x', which is not among the tools (no function tools)")),
])
def test_bad_tool_choices(fields, expected):
    """Guards: a choice without tools, of an unknown form, or naming a function that is not
    among the tools accepted, or its refusal not listing the tools there are."""
    assert refused(chat, **fields) == expected


# ---- response_format and the grammar --------------------------------------------------------------
@pytest.mark.parametrize("fmt, expected", [
    ({"type": "json_object", "schema": []}, invalid("response_format.schema",
                                                     "response_format.schema must be a JSON schema object")),
    ({"type": "json_schema"}, invalid("response_format.json_schema", "response_format 'json_schema' needs a "
                                      "`json_schema` object: {\"name\": ..., \"schema\": {...}}")),
    ({"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}}, invalid(
        "response_format.json_schema.strict", "response_format.json_schema.strict must be a boolean")),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": True}}, invalid(
        "response_format.json_schema.schema", "response_format.json_schema.schema must be a JSON schema object")),
    ({"type": "xml"}, invalid("response_format", "response_format 'xml': expected 'text', 'json_object' or "
                                                 "'json_schema'")),
])
def test_bad_response_formats(fmt, expected):
    """Guards: a response_format of an unknown type or with a malformed schema accepted."""
    assert refused(chat, response_format=fmt) == expected


# the JSON layout llguidance is held to: the one json.dumps writes (shared/grammar.py)
GUIDANCE = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@pytest.mark.parametrize("fmt, schema", [
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "json_object", "schema": SCHEMA}, SCHEMA),
    ({"type": "json_schema", "json_schema": {"name": "n", "strict": None, "schema": SCHEMA}}, SCHEMA),
    ({"type": "json_schema", "json_schema": {"name": "n"}}, {}),
])
def test_response_format_schemas(fmt, schema):
    """Guards: json_object's default schema (an object) or a json_schema's own schema (none: any
    JSON) not the one enforced, or strict null refused."""
    g = chat(response_format=fmt)
    assert (g.grammar.kind, json.loads(g.grammar.text)) == ("json_schema", schema | GUIDANCE)
    assert chat(response_format={"type": "text"}).grammar is None
    assert chat(response_format=fmt, tools=[TOOL], tool_choice="none").grammar.kind == "json_schema"


def test_constraint_contradictions():
    """Guards: two constraints at once (a grammar and a response_format, a grammar with tools
    that may be called, a response_format with a forced call) accepted."""
    fmt = {"type": "json_object"}
    assert refused(chat, grammar="root ::= \"a\"", response_format=fmt) == invalid(
        "grammar", "grammar and response_format: give one")
    assert refused(chat, json_schema=SCHEMA, response_format=fmt) == invalid(
        "json_schema", "json_schema and response_format: give one")
    assert refused(chat, grammar="root ::= \"a\"", tools=[TOOL]) == invalid(
        "grammar", "grammar with tools: the answer would have to be both a call and the grammar's text (tool_choice "
                   "'none' leaves the tools out)")
    assert chat(grammar="root ::= \"a\"", tools=[TOOL], tool_choice="none").grammar.kind == "gbnf"
    assert refused(chat, response_format=fmt, tools=[TOOL], tool_choice="required") == invalid(
        "response_format", "response_format 'json_object' contradicts a tool_choice that forces a call")
    assert chat(response_format=fmt, tools=[TOOL]).grammar.kind == "lark"


# ---- template settings, reasoning, history --------------------------------------------------------
@pytest.mark.parametrize("fields, kwargs", [
    (dict(), None), (dict(reasoning_effort="none"), {"enable_thinking": False}),
    (dict(reasoning_effort="minimal"), {"enable_thinking": False}),
    (dict(reasoning_effort="low"), {"enable_thinking": True}),
    (dict(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}), {"enable_thinking": True}),
    (dict(chat_template_kwargs={"x": 1}), {"x": 1}), (dict(chat_template_kwargs={}), None),
])
def test_template_kwargs(fields, kwargs):
    """Guards: reasoning_effort's off levels (none, minimal) turning thinking on, an explicit
    enable_thinking overridden by the effort, or the request's own kwargs lost."""
    assert chat(**fields).chat_template_kwargs == kwargs


def test_template_kwargs_may_not_set_the_requests_own_fields():
    """Guards: chat_template_kwargs overriding messages or tools (the request's own fields)."""
    assert refused(chat, chat_template_kwargs={"tools": [], "messages": [], "x": 1}) == invalid(
        "chat_template_kwargs", "chat_template_kwargs may not set messages, tools (the request's own fields)")


def test_reasoning_format_default_and_refusal():
    """Guards: an unknown reasoning_format taken, or the list of known ones misnamed."""
    assert refused(chat, reasoning_format="raw") == invalid(
        "reasoning_format", "reasoning_format 'raw': expected one of deepseek, auto, none, both")


def test_history_calls_reasoning_and_their_refusals():
    """Guards: a call's arguments (JSON text, empty text or an object) not the mapping the
    template renders, reasoning under any of its three names lost (the first given wins), or
    calls on a message that is not the assistant's taken."""
    calls = [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"id": "c2", "function": {"name": "g", "arguments": " "}},
             {"id": "c3", "type": "function", "function": {"name": "h", "arguments": {"b": [2]}}}]
    g = chat(messages=USER + [{"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "r",
                               "thinking": "t"}, {"role": "tool", "tool_call_id": "c1", "content": "x"},
                              {"role": "assistant", "content": "ok", "thinking": "t2"}, {"role": "user", "content": "y"}])
    a = g.messages[1]
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in a.tool_calls] == [
        ("c1", "function", "f", {"a": 1}), ("c2", "function", "g", {}), ("c3", "function", "h", {"b": [2]})]
    assert (a.reasoning_content, g.messages[3].reasoning_content, g.messages[2].tool_call_id) == ("r", "t2", "c1")
    assert g.messages[0].tool_calls is None and g.messages[0].reasoning_content is None
    bad = {"id": "c", "function": {"name": "f", "arguments": "{"}}
    assert refused(chat, messages=USER + [{"role": "assistant", "tool_calls": [calls[0], bad]}]) == invalid(
        "messages[1].tool_calls[1].function.arguments", "messages[1].tool_calls[1].function.arguments is not JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")
    listed = {"id": "c", "function": {"name": "f", "arguments": "[1]"}}
    assert refused(chat, messages=USER + [{"role": "assistant", "tool_calls": [listed]}]) == invalid(
        "messages[1].tool_calls[0].function.arguments", "messages[1].tool_calls[0].function.arguments must be a "
        "JSON object, not list")
    assert refused(chat, messages=[{"role": "user", "content": "x", "tool_calls": [calls[0]]}]) == invalid(
        "messages[0].tool_calls", "messages[0]: only assistant messages have tool_calls")


def test_developer_is_system_and_names_kept():
    """Guards: a developer message sent under its own role (templates refuse it), or a
    message's name or tool_call_id dropped."""
    g = chat(messages=[{"role": "developer", "content": "d"}, {"role": "user", "content": "u", "name": "ann"}])
    assert [(m.role, m.content, m.name) for m in g.messages] == [("system", "d", None), ("user", "u", "ann")]


@pytest.mark.parametrize("fields, expected", [
    (dict(), (True, False)),
    (dict(messages=USER + [{"role": "assistant", "content": "He"}]), (False, True)),
    (dict(messages=USER + [{"role": "assistant", "content": "He"}], add_generation_prompt=True), (True, False)),
    (dict(messages=USER + [{"role": "assistant", "content": "He"}], add_generation_prompt=False), (False, True)),
    (dict(messages=USER + [{"role": "assistant", "content": "He"}], continue_final_message=True), (False, True)),
    (dict(messages=USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]), (True, False)),
    (dict(add_generation_prompt=False), (False, False)),
])
def test_prefill_and_generation_prompt(fields, expected):
    """Guards: a final assistant message not continued by default (llama-server's), continued
    when add_generation_prompt asks for a new turn, a call's closed turn continued, or
    add_generation_prompt false ignored."""
    g = chat(**fields)
    assert (g.add_generation_prompt, g.continue_final_message) == expected


def test_prefill_refusals():
    """Guards: contradictory prefill settings, or a continuation with no assistant message to
    continue, accepted."""
    assert refused(chat, continue_final_message=True, add_generation_prompt=True) == invalid(
        "continue_final_message", "continue_final_message and add_generation_prompt may not both be true: a final "
                                  "message is either continued or followed by a new turn")
    assert refused(chat, continue_final_message=True) == invalid(
        "continue_final_message", "continue_final_message needs a final assistant message, and the last one is "
                                  "'user'")


def test_a_tool_the_call_format_cannot_hold_cannot_be_forced():
    """Guards: a forced call to a function whose name the XML call format cannot write
    accepted, or its refusal not naming the tools and why."""
    tool = {"type": "function", "function": {"name": "a<b", "parameters": SCHEMA}}
    assert refused(chat, tools=[tool], tool_choice="required") == invalid(
        "tools", "the tools cannot be forced: function name 'a<b' cannot be written in the model's tool-call format")
    assert refused(chat, tools=[tool], response_format={"type": "json_object"}) == invalid(
        "tools", "the tools cannot be forced: function name 'a<b' cannot be written in the model's tool-call format")


def test_seed_past_64_bits_and_the_reasoning_budget():
    """Guards: a seed past 2**64 - 1 (msgspec bounds it only below) passed on to fail
    serialising, its refusal's code or words changed, or reasoning_budget not sent."""
    assert refused(chat, seed=2**64) == invalid("seed", "Invalid 'seed': Expected `int` <= 18446744073709551615")
    assert (chat(reasoning_budget=5).reasoning_budget, chat().reasoning_budget) == (5, None)


def test_every_function_tool_is_checked_past_other_kinds():
    """Guards: the check of the tools stopping at the first tool of another kind."""
    assert refused(chat, tools=[{"type": "web_search"}, {"type": "function"}]) == invalid(
        "tools[1].function.name", "tools[1]: a function tool needs function.name")


def test_a_json_object_schema_llguidance_cannot_follow_names_its_field():
    """Guards: json_object's schema refused under json_schema's field name (or the other way)."""
    assert refused(chat, response_format={"type": "json_object", "schema": {"type": "foo"}}) == invalid(
        "response_format.schema", "response_format.schema is not a JSON schema llguidance can follow: Invalid type: foo")
    assert refused(chat, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "foo"}}}) == invalid("response_format.json_schema.schema", "response_format.json_schema.schema is not "
                                     "a JSON schema llguidance can follow: Invalid type: foo")


def test_the_grammar_of_answer_or_calls_and_of_a_named_call():
    """Guards: the answer's schema or parallel_tool_calls left out of the answer-or-calls
    grammar, or a call forced to one function open to every tool."""
    from shared.grammar import json_schema_text, tool_call_lark
    ls = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    fmt = {"type": "json_object", "schema": SCHEMA}
    for parallel in (True, False):
        g = chat(tools=[TOOL, ls], response_format=fmt, parallel_tool_calls=parallel)
        assert g.grammar == P.Constraint(kind="lark", text=f"start: answer | calls\nanswer: %json "
                                                           f"{json_schema_text(SCHEMA)}\n"
                                                           + tool_call_lark([TOOL, ls], parallel, start="calls"))
    g = chat(tools=[TOOL, ls], tool_choice={"type": "function", "function": {"name": "ls"}})
    assert g.grammar == P.Constraint(kind="lark", text=tool_call_lark([ls], True))


def test_a_forced_tools_parameter_schemas_are_checked_with_their_definitions():
    """Guards: a forced tool's non-string parameter whose schema llguidance cannot follow
    accepted (or refused under another tool's index), a $ref into the tool's $defs or
    definitions refused, a string parameter's schema checked (its text is written raw), or a
    boolean property schema crashing the check."""
    bad = {"type": "function", "function": {"name": "n", "parameters": {"type": "object", "properties": {
        "k": {"type": "foo"}}}}}
    assert refused(chat, tools=[TOOL, bad], tool_choice="required") == invalid(
        "tools[1].function.parameters.properties.k", "tools[1].function.parameters.properties.k is not a JSON schema "
                                                     "llguidance can follow: Invalid type: foo")
    for key in ("$defs", "definitions"):
        ref = {"type": "function", "function": {"name": "r", "parameters": {"type": "object", key: {
            "P": {"type": "integer"}}, "properties": {"p": {"$ref": f"#/{key}/P"}, "b": True,
                                                      "s": {"type": "string", "pattern": "(?<=a)b"}}}}}
        assert chat(tools=[ref], tool_choice="required").grammar.kind == "lark"
