"""Forced tool calls and JSON answers through the whole daemon, driven by the official `openai`
client: the synthetic tiny model (random weights) never calls a tool by itself, so every call
here is the grammar's doing (test_http_builtin_tools.py has the built-in model calling under
"auto").
Each result is checked against its schema with `jsonschema`; bad schemas and unknown tools are
clear 400s and the daemon serves on."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.shared.test_grammar import ANSWER, TOOLS, WEATHER

USER = [{"role": "user", "content": "What is the weather in Lisbon this week?"}]


def _streamed(stream):
    """(name, arguments text, finish_reason) of the first call of a streamed answer."""
    name, args, finish = None, "", None
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                name = name or tc.function.name
                args += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return name, args, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_has_arguments_that_validate(client, choice, stream):
    kw = dict(model="m", messages=USER, tools=TOOLS[:1] if choice == "required" else TOOLS, tool_choice=choice,
              parallel_tool_calls=False, max_tokens=300, seed=7, stream=stream)
    if stream:
        name, args, finish = _streamed(client.chat.completions.create(**kw))
    else:
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        name, args, finish = call.function.name, call.function.arguments, r.choices[0].finish_reason
        assert call.id.startswith("call_")
    assert (name, finish) == ("get_weather", "tool_calls")
    jsonschema.validate(json.loads(args), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_validates(client, stream):
    kw = dict(model="m", messages=[{"role": "user", "content": "n, ok and tag please"}], max_tokens=200, seed=3,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER,
                                                                      "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), ANSWER)


def test_json_object_is_an_object(client):
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=400, seed=1, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":        # an object the limit did not cut
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("kw, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}),
     "response_format.json_schema.schema", "objekt"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm_rf"}}), "tool_choice", "'rm_rf'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": "one"}}}}}], tool_choice="required"),
     "tools[0].function.parameters.properties.n", "minimum"),
])
def test_bad_constraints_are_clear_400s_and_the_daemon_serves_on(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, max_tokens=8, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and words in err["message"], err
    r = client.chat.completions.create(model="m", messages=USER, max_tokens=4, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length")
