"""Reasoning as each API defines it, on the built-in model (its template leaves `<think>\\n`
open; it reasons before it answers): Anthropic's `thinking` (a budget ends the reasoning with
the model's own `</think>`), chat's `reasoning_effort` and fermoe's `reasoning_budget`, the
server's --reasoning and --reasoning-budget, and the reasoning tokens in usage."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from shared.builtin import resolve_model
from shared.model import Model
from tests.shared.test_grammar import TOOLS, WEATHER
from tests.support.http_server import HttpDaemon

USER = [{"role": "user", "content": "What does os.path.join do?"}]
BUDGET = 8


@pytest.fixture(scope="module")
def tok():
    return Model(resolve_model("tiny")).tokenizer


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon("tiny", "--max-sequences", "2")
    yield d
    assert d.stop() == 0


def post(d, path, body):
    r = httpx.post(d.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(d, **kw):
    return post(d, "/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 120, "seed": 1} | kw)


def messages(d, **kw):
    return post(d, "/v1/messages", {"model": "m", "messages": USER, "max_tokens": 120} | kw)


def test_by_default_the_model_reasons_and_usage_counts_it(daemon):
    r = chat(daemon)
    reasoning = r["choices"][0]["message"].get("reasoning_content") or ""
    assert reasoning.strip()
    n = r["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert BUDGET + 1 < n <= r["usage"]["completion_tokens"]          # longer than the budgets below
    m = messages(daemon)
    assert m["content"][0]["type"] == "thinking"
    assert set(m["usage"]) >= {"input_tokens", "output_tokens"}      # Anthropic's usage has no reasoning field


def test_a_thinking_budget_ends_the_reasoning_and_the_answer_follows(daemon, tok):
    m = messages(daemon, thinking={"type": "enabled", "budget_tokens": BUDGET})
    kinds = [b["type"] for b in m["content"]]
    assert kinds[0] == "thinking" and "text" in kinds, m
    assert len(tok.encode(m["content"][0]["thinking"].strip())) <= BUDGET
    assert m["content"][kinds.index("text")]["text"].strip()
    r = chat(daemon, reasoning_budget=BUDGET)
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] <= BUDGET + 1      # and its </think>
    assert r["choices"][0]["message"]["content"].strip()


@pytest.mark.parametrize("how", [{"thinking": {"type": "disabled"}}, {"reasoning_effort": "none"},
                                 {"reasoning_effort": "minimal"}])
def test_reasoning_turned_off_by_the_request(daemon, how):
    if "thinking" in how:
        m = messages(daemon, **how)
        assert [b["type"] for b in m["content"]][0] != "thinking"
    else:
        r = chat(daemon, **how)
        assert not r["choices"][0]["message"].get("reasoning_content")
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_the_responses_api_reports_reasoning_tokens(daemon):
    r = post(daemon, "/v1/responses", {"model": "m", "input": USER[0]["content"], "max_output_tokens": 120})
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    r = post(daemon, "/v1/responses", {"model": "m", "input": USER[0]["content"], "max_output_tokens": 120,
                                       "reasoning": {"effort": "none"}})
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_the_servers_budget_and_a_forced_call_after_it():
    d = HttpDaemon("tiny", "--max-sequences", "2", "--reasoning-budget", str(BUDGET))
    try:
        r = chat(d)
        assert 0 < r["usage"]["completion_tokens_details"]["reasoning_tokens"] <= BUDGET + 1
        assert r["choices"][0]["message"]["content"].strip()
        r = chat(d, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False, max_tokens=300)
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] <= BUDGET + 1
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and r["choices"][0]["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        r = chat(d, reasoning_budget=-1)                                 # the request's own: no limit
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] > BUDGET + 1
    finally:
        assert d.stop() == 0


def test_reasoning_off_on_the_server():
    d = HttpDaemon("tiny", "--max-sequences", "2", "--reasoning", "off")
    try:
        r = chat(d)
        assert not r["choices"][0]["message"].get("reasoning_content")
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
        m = messages(d)
        assert [b["type"] for b in m["content"]][0] != "thinking"
        m = messages(d, thinking={"type": "adaptive"})                # the request's own word wins
        assert m["content"][0]["type"] == "thinking"
    finally:
        assert d.stop() == 0
