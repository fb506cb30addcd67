"""`tool_choice: "auto"` on a model that really calls tools: the built-in model, trained on
agent episodes (tools/stdlib_chat.py), behind a running daemon, driven by the official `openai`
client. Nothing forces these calls: no grammar runs under "auto", so each call is the model's
own output, read back by the server's parser. Greedy throughout.

The held-out names below are never in the training data (neither their episodes nor their
docstrings); they are ones the model gets right (`fermoe bench tools` gives the share over
all 288 held-out names, docs/models.md).  JSON_DUMPS is a training name: the full loop on it
ends with the docstring's first sentence."""
from __future__ import annotations

import json

import jsonschema
import pytest

from shared.builtin import BUILTIN
from shared.chat_template import QWEN_STYLE_TEMPLATE
from shared.gguf_file import GGUFFile
from shared.pydoc_tool import TOOL, first_sentence, lookup, question
from tests.support.http_server import HttpDaemon

HELD_OUT = [("function", "copy.deepcopy"), ("method", "asyncio.subprocess.Process.wait"),
            ("module", "encodings.bz2_codec")]
SCHEMA = TOOL["function"]["parameters"]


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(BUILTIN["tiny"], "--snapshot-mem", "64MiB")
    yield d
    assert d.stop() == 0


def ask(kind: str, name: str) -> list[dict]:
    return [{"role": "user", "content": question(kind, name)}]


def test_the_builtin_model_carries_the_template_it_was_trained_with():
    with GGUFFile(BUILTIN["tiny"]) as f:
        assert f.metadata["tokenizer.chat_template"] == QWEN_STYLE_TEMPLATE


@pytest.mark.parametrize("kind, name", HELD_OUT)
def test_auto_calls_pydoc_with_the_name_asked(client, kind, name):
    r = client.chat.completions.create(model="tiny", messages=ask(kind, name), tools=[TOOL], tool_choice="auto",
                                       max_tokens=128, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMA)
    assert (call.function.name, args) == ("pydoc", {"name": name})
    assert choice.message.reasoning_content and not choice.message.content    # the <think> block, split out


def test_auto_streams_the_call_as_openai_streams_it(client):
    kind, name = HELD_OUT[0]
    stream = client.chat.completions.create(model="tiny", messages=ask(kind, name), tools=[TOOL],
                                            tool_choice="auto", max_tokens=128, temperature=0, stream=True)
    names, args, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                names += [tc.function.name] if tc.function.name else []
                args += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (names, json.loads(args), finish) == (["pydoc"], {"name": name}, "tool_calls")


def test_a_tool_loop_ends_with_the_docstrings_first_sentence(client):
    """The call, the tool run here with Python's pydoc, its result sent back (with the
    reasoning, as agents send it): the next reply answers, without a call."""
    messages = ask("function", "json.dumps")
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], max_tokens=128,
                                           temperature=0).choices[0].message
    (call,) = first.tool_calls
    result = lookup(json.loads(call.function.arguments)["name"])
    messages += [{"role": "assistant", "content": first.content, "reasoning_content": first.reasoning_content,
                  "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], max_tokens=128, temperature=0)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == first_sentence(result)
    assert r.usage.prompt_tokens_details.cached_tokens > 0      # the first turn's prompt, from the cache


def test_thinking_off_and_tool_choice_none(client):
    kind, name = HELD_OUT[0]
    off = client.chat.completions.create(model="tiny", messages=ask(kind, name), tools=[TOOL], max_tokens=128,
                                         temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = off.choices[0].message
    assert off.choices[0].finish_reason == "tool_calls" and not getattr(message, "reasoning_content", None)
    assert json.loads(message.tool_calls[0].function.arguments) == {"name": name}
    none = client.chat.completions.create(model="tiny", messages=ask(kind, name), tools=[TOOL], tool_choice="none",
                                          max_tokens=128, temperature=0).choices[0]
    assert none.finish_reason == "stop" and not none.message.tool_calls    # what it wrote stays text


ISSUE_QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_call_the_model_would_not_make_is_still_a_valid_one(client, daemon, choice):
    """Issue's reproducer, the fault guarded: forced to get_weather on a pydoc question, the
    model writes an empty city as `<parameter=city>\\n</parameter>` and wants to close the
    call. The grammar ended a string value only at `\\n</parameter>\\n` after its own
    newline, so the city ran on over the next parameters, and the reply was `{"city": ""}`
    with `days` missing and the rest of the call in the content. Grammar and parser now end
    a value by one rule, the short empty form included: the call validates."""
    r = client.chat.completions.create(model="m", messages=ISSUE_QUESTION, temperature=0,
                                       max_tokens=200, tools=[TOOL, WEATHER_TOOL], tool_choice=choice)
    choice_ = r.choices[0]
    assert choice_.finish_reason == "tool_calls" and not choice_.message.content, choice_
    call = choice_.message.tool_calls[0].function
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (TOOL, WEATHER_TOOL)}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    if not isinstance(choice, str):
        assert call.name == "get_weather"
    responses = daemon_responses(daemon, choice)
    assert responses["status"] == "completed", responses
    call = next(item for item in responses["output"] if item["type"] == "function_call")
    jsonschema.validate(json.loads(call["arguments"]), schema if call["name"] != "pydoc" else TOOL["function"]["parameters"])


def daemon_responses(daemon, choice) -> dict:
    """The same request on /v1/responses."""
    import httpx
    tool_choice = {"type": "function", "name": "get_weather"} if not isinstance(choice, str) else choice
    tools = [{"type": "function", **t["function"]} for t in (TOOL, WEATHER_TOOL)]
    r = httpx.post(f"{daemon.url}/v1/responses", timeout=120, json={
        "model": "m", "input": ISSUE_QUESTION[0]["content"], "tools": tools, "tool_choice": tool_choice,
        "temperature": 0, "max_output_tokens": 200})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_the_turn_after_a_forced_call_resumes_after_it(client, choice):
    """The tokens a forced call is made of are the ones the template renders for it, so the
    next turn (the call and its result appended) finds the previous prompt and the whole
    answer cached, as it does after a call the model made by itself (less a few tokens
    where a re-encoding may split its text otherwise)."""
    first = client.chat.completions.create(model="m", messages=ISSUE_QUESTION, temperature=0, max_tokens=200,
                                           tools=[TOOL], tool_choice=choice,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = first.choices[0].message
    assert message.tool_calls, message
    call = message.tool_calls[0]
    turn = ISSUE_QUESTION + [
        {"role": "assistant", "content": message.content or "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": lookup(json.loads(call.function.arguments)["name"])}]
    second = client.chat.completions.create(model="m", messages=turn, temperature=0, max_tokens=8, tools=[TOOL],
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 4, (first.usage, second.usage)
