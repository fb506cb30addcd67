"""shared/chat.py: a chat request's tools, tool calls, tool results and reasoning through the
model's own chat template (a Qwen3.6-style one, tests/qwen_template.py), as transformers
renders them (the `oracle` test), with OpenAI clients' fields adapted as llama-server adapts them."""
import logging
import re

import pytest

from shared import protocol as P
from shared.chat import opens_reasoning, render_chat
from shared.errors import ChatTemplateError
from modeltools.synth_vocab import synth_tokenizer_metadata
from shared.tokenizer import Tokenizer
from tests.support.qwen_template import qwen_style_metadata, qwen_style_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a <file> & say it",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"},
                                                    "opts": {"type": "object"}}, "required": ["path"]}}}]
EPISODE = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Show me a.py"},
    {"role": "assistant", "content": "", "reasoning_content": "I should read it.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "read_file",
                                  "arguments": '{"path": "a.py", "lines": 3, "opts": {"raw": true}}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"},
]


@pytest.fixture(scope="module")
def tok():
    return qwen_style_tokenizer()


def test_tools_calls_results_and_reasoning_render_in_the_models_format(tok):
    text = render_chat(tok, EPISODE, TOOLS)
    assert text.startswith('<|im_start|>system\n# Tools\n\n<tools>\n{"type": "function", "function": '
                           '{"name": "read_file", "description": "Read a <file> & say it"')
    assert "\n</tools>\n\nCall them as" in text and "\n\nYou are an agent.<|im_end|>\n" in text
    # the arguments string became a mapping: strings raw, the rest JSON; reasoning kept (after the query)
    assert ("<|im_start|>assistant\n<think>\nI should read it.\n</think>\n\n<tool_call>\n<function=read_file>\n"
            "<parameter=path>\na.py\n</parameter>\n<parameter=lines>\n3\n</parameter>\n"
            '<parameter=opts>\n{"raw": true}\n</parameter>\n</function>\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nprint('hi')\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n")


def test_protocol_messages_render_as_their_dicts(tok):
    msgs = [P.ChatMessage(role="user", content="Show me a.py"),
            P.ChatMessage(role="assistant", content=None, reasoning_content="r", tool_calls=[
                P.ToolCall(id="c", function=P.FunctionCall(name="read_file", arguments={"path": "a.py"}))]),
            P.ChatMessage(role="tool", content="x", tool_call_id="c", name="read_file")]
    dicts = [{"role": "user", "content": "Show me a.py"},
             {"role": "assistant", "reasoning_content": "r", "tool_calls": [
                 {"id": "c", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
             {"role": "tool", "content": "x", "tool_call_id": "c", "name": "read_file"}]
    assert render_chat(tok, msgs, TOOLS) == render_chat(tok, dicts, TOOLS)


@pytest.mark.parametrize("name", ["reasoning", "thinking", "reasoning_content"])
def test_reasoning_under_any_name_reaches_the_template(tok, name):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", name: "because"},
            {"role": "user", "content": "q2"}]
    assert "<think>\nbecause\n</think>" not in render_chat(tok, msgs)            # before the last query: stripped
    assert "<think>\nbecause\n</think>\n\na<|im_end|>" in render_chat(tok, msgs, None, {"preserve_thinking": True})


def test_thinking_off_and_the_generation_prompt(tok):
    msgs = [{"role": "user", "content": "q"}]
    assert render_chat(tok, msgs).endswith("<|im_start|>assistant\n<think>\n")
    assert render_chat(tok, msgs, None, {"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert opens_reasoning(tok) and opens_reasoning(tok, {"enable_thinking": True})
    assert not opens_reasoning(tok, {"enable_thinking": False})
    chatml = Tokenizer.from_metadata(synth_tokenizer_metadata(1024))        # the built-in model's ChatML
    assert not opens_reasoning(chatml) and not opens_reasoning(chatml, {"enable_thinking": False})


def test_developer_and_late_system_messages_are_mapped_not_refused(tok):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"},
            {"role": "system", "content": "Now be verbose."}, {"role": "user", "content": "q2"}]
    text = render_chat(tok, msgs)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                           "<|im_start|>user\nNow be verbose.<|im_end|>\n<|im_start|>user\nq2<|im_end|>")
    chatml = Tokenizer.from_metadata(synth_tokenizer_metadata(1024))        # takes a late system message as is
    assert "<|im_start|>system\nNow be verbose.<|im_end|>" in render_chat(chatml, msgs)


def test_tools_that_are_not_functions_are_left_out_with_a_warning(tok, caplog):
    tools = TOOLS + [{"type": "web_search"}, {"type": "namespace", "name": "x"}]
    with caplog.at_level(logging.WARNING, logger="fermoe.chat"):
        text = render_chat(tok, EPISODE[:2], tools)
    assert text == render_chat(tok, EPISODE[:2], TOOLS)
    assert "'web_search', 'namespace'" in caplog.text


@pytest.mark.parametrize("messages, kwargs, word", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}], None, "tool_calls[0].function.arguments is not JSON"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1, 2]"}}]}], None, "not of an object"),
    ([{"role": "tool", "content": "x"}], None, "No user query"),
    ([{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}], None, "Unexpected message role"),
    ([{"role": "user", "content": "q"}], {"messages": []}, "may not set messages"),
])
def test_what_the_template_cannot_take_is_a_chat_template_error(tok, messages, kwargs, word):
    with pytest.raises(ChatTemplateError, match=re.escape(word)):
        render_chat(tok, messages, None, kwargs)


@pytest.mark.oracle
def test_the_rendering_is_transformers(tok):
    from tests.shared.test_tokenizer import hf_tokenizer
    hf = hf_tokenizer(qwen_style_metadata())
    parsed = [dict(m) for m in EPISODE]
    parsed[2] = {**parsed[2], "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "read_file", "arguments": {"path": "a.py", "lines": 3, "opts": {"raw": True}}}}]}
    for kwargs in ({}, {"enable_thinking": False}, {"preserve_thinking": True}):
        expected = hf.apply_chat_template(parsed + [{"role": "user", "content": "thanks"}], tools=TOOLS,
                                          tokenize=False, add_generation_prompt=True, **kwargs)
        assert render_chat(tok, EPISODE + [{"role": "user", "content": "thanks"}], TOOLS, kwargs) == expected
