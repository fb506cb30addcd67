"""/v1/responses and /v1/messages through the vendors' own clients against a running daemon:
the built-in model with a Qwen3.6-style template (tests/qwen_template.py), behind an API key.
A tool round trip each (the model's reply, a call and its result sent back, the next turn
rendered through the template with the previous turn's prompt coming from the cache),
streamed and not, Anthropic's stop sequences and count_tokens, and bad input answered 400 in
each API's own error shape with the daemon serving on."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from shared.builtin import BUILTIN
from tests.support.gguf_edit import rewrite_gguf
from tests.support.http_server import HttpDaemon
from tests.support.qwen_template import QWEN_STYLE_TEMPLATE

KEY = "sekrit"
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
USER = "Why is the sky blue?"
GREEDY = {"temperature": 0}         # anthropic's client of this version takes it only so


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model = tmp_path_factory.mktemp("agents") / "builtin-qwen-template.gguf"
    rewrite_gguf(BUILTIN["tiny"], model, meta={"tokenizer.chat_template": QWEN_STYLE_TEMPLATE})
    d = HttpDaemon(model, "--block", "32", "--snapshot-mem", "256MiB", "--api-key", KEY)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def claude(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def codex(daemon):
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_messages_tool_round_trip_streamed_and_not(claude):
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": SCHEMA}]
    first = claude.messages.create(model="claude-x", max_tokens=12, tools=tools, system="Use tools.",
                                   messages=[{"role": "user", "content": USER}], extra_body=GREEDY)
    assert first.stop_reason == "max_tokens" and first.content[0].type == "thinking"
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    history = [{"role": "user", "content": USER},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": first.content[0].thinking,
                                                  "signature": first.content[0].signature},
                                                 {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                                  "input": {"path": "sky.txt"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": "Rayleigh scattering."}]}]
    counted = claude.messages.count_tokens(model="claude-x", tools=tools, system="Use tools.", messages=history)
    with claude.messages.stream(model="claude-x", max_tokens=8, tools=tools, system="Use tools.",
                                messages=history, extra_body=GREEDY) as stream:
        events = list(stream)
        second = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # message_start already carries the prompt's size (Claude Code reads its context use there)
    opening = events[0].message.usage
    assert (opening.input_tokens, opening.cache_read_input_tokens) == (second.usage.input_tokens,
                                                                      second.usage.cache_read_input_tokens)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted.input_tokens > prompt
    assert second.usage.cache_read_input_tokens >= prompt - 32        # the first turn's prompt, to a block
    assert second.stop_reason == "max_tokens" and second.usage.output_tokens == 8


def test_messages_stop_sequences(claude):
    kwargs = dict(model="m", max_tokens=24, messages=[{"role": "user", "content": USER}], extra_body=GREEDY,
                  thinking={"type": "disabled"})
    text = claude.messages.create(**kwargs).content[0].text
    word = text.split()[2]
    cut = claude.messages.create(**kwargs, stop_sequences=[word])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    assert cut.content[0].text.rstrip() == text[:text.index(word)].rstrip()


def test_responses_tool_round_trip_streamed_and_not(codex):
    tools = [{"type": "function", "name": "read_file", "description": "Read a file", "parameters": SCHEMA},
             {"type": "web_search"}]
    first = codex.responses.create(model="gpt-x", instructions="Use tools.", input=USER, tools=tools,
                                   max_output_tokens=12, temperature=0, store=False)
    assert first.status == "incomplete" and first.output[0].type == "reasoning"
    history = [{"role": "user", "content": USER},
               {"type": "reasoning", "id": first.output[0].id, "summary": [],
                "content": [{"type": "reasoning_text", "text": first.output[0].content[0].text}]},
               {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "sky"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "Rayleigh scattering."}]
    with codex.responses.stream(model="gpt-x", instructions="Use tools.", input=history, tools=tools,
                                max_output_tokens=8, temperature=0, store=False) as stream:
        kinds = [e.type for e in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    second = codex.responses.create(model="gpt-x", instructions="Use tools.", input=history, tools=tools,
                                    max_output_tokens=8, temperature=0, store=False)
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 32
    done = codex.responses.create(model="gpt-x", input=USER, max_output_tokens=200, reasoning={"effort": "none"})
    assert done.status in ("completed", "incomplete") and done.output_text


def test_a_forced_tool_is_called_with_arguments_of_its_schema(claude, codex):
    """Anthropic's `any` and Responses' named function force one call (constrained decoding;
    thinking off: the built-in model would not close a <think> block within the budget)."""
    schema = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}
    tool = {"name": "read_file", "description": "Read a file.", "input_schema": schema}
    r = claude.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": USER}],
                               tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               thinking={"type": "disabled"},
                               extra_body=GREEDY)
    calls = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and calls and calls[0].name == "read_file"
    jsonschema.validate(calls[0].input, schema)
    out = codex.responses.create(model="m", input=USER, max_output_tokens=64, tools=[{
        "type": "function", "name": "read_file", "parameters": schema}],
        tool_choice={"type": "function", "name": "read_file"}, reasoning={"effort": "none"},
        parallel_tool_calls=False)
    items = [i for i in out.output if i.type == "function_call"]
    assert items and items[0].name == "read_file"
    jsonschema.validate(json.loads(items[0].arguments), schema)


def test_bad_input_is_400_in_each_apis_shape_and_the_daemon_serves_on(daemon, claude, codex):
    bad = [dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "video"}]}]),
           dict(max_tokens=8, messages=[{"role": "user", "content": "x"}], tools=[{"name": "f"}]),
           dict(max_tokens=8, messages=[{"role": "user", "content": "x"}], tool_choice={"type": "tool", "name": "g"},
                tools=[{"name": "f", "input_schema": SCHEMA}])]
    for fields in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="m", **fields)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{daemon.url}/v1/messages", headers={"x-api-key": KEY},
                         json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    for fields in (dict(input=[{"type": "computer_call"}]), dict(input="x", previous_response_id="resp_1"),
                   dict(input="x", tools=[{"type": "function", "name": "f"}])):
        with pytest.raises(openai.BadRequestError) as e:
            codex.responses.create(model="m", **fields)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"]
    unauthorized = httpx.post(f"{daemon.url}/v1/messages", json={})
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"
    assert daemon.proc.poll() is None
    r = claude.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert r.usage.output_tokens == 3


def test_claude_codes_mid_conversation_system_message_and_codexs_request_are_served(daemon, claude, codex):
    """What the CLIs send (issue 38): Claude Code's `?beta=true` request with a system message
    inside `messages`; Codex's two developer messages, a namespace tool and a reasoning item."""
    with claude.messages.stream(model="qwen3.6", max_tokens=4, system=[{"type": "text", "text": "Be terse.",
                                                                       "cache_control": {"type": "ephemeral"}}],
                                messages=[{"role": "user", "content": USER},
                                          {"role": "system", "content": "Available agent types for the Agent tool."},
                                          {"role": "user", "content": "Go."}],
                                extra_query={"beta": "true"}, extra_body={"thinking": {"type": "adaptive"}, **GREEDY},
                                extra_headers={"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and final.stop_reason == "max_tokens"
    spawn = {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}
    tools = [{"type": "function", "name": "exec_command", "parameters": SCHEMA}, {"type": "web_search"},
             {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
              "tools": [{"type": "function", "name": "spawn_agent", "parameters": spawn}]}]
    history = [{"role": "developer", "content": [{"type": "input_text", "text": "Base instructions. " * 200}]},
               {"role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
               {"role": "user", "content": [{"type": "input_text", "text": USER}]},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                              "text": "Ask one."}]},
               {"type": "function_call", "call_id": "call_1", "name": "spawn_agent", "namespace": "multi_agent_v1",
                "arguments": '{"task": "sky"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "Rayleigh scattering."}]
    with codex.responses.stream(model="qwen3.6", input=history, tools=tools, store=False, temperature=0,
                                max_output_tokens=4, reasoning={"effort": "medium", "summary": "auto"},
                                include=["reasoning.encrypted_content"], prompt_cache_key="k") as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert events[-1].response.usage.input_tokens > 400
