"""Constrained output on every route, as llama-server takes it: `grammar` (GBNF) and
`json_schema` on chat and text completions as on /completion, and `response_format:
{"type": "json_object", "schema": {...}}` constrained to its schema (an invalid one refused)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from shared.builtin import BUILTIN
from tests.support.http_server import HttpDaemon

ASK = [{"role": "user", "content": "Is the sky blue?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 24, "temperature": 1.0, "seed": 3}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "word": {"enum": ["yes", "no"]}},
          "required": ["n", "word"], "additionalProperties": False}


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(BUILTIN["tiny"])
    yield d
    assert d.stop() == 0


def chat(daemon, **body):
    return httpx.post(f"{daemon.url}/v1/chat/completions", json={"messages": ASK, **NO_THINKING, **body}, timeout=60)


def test_a_gbnf_grammar_on_chat_and_completions(daemon):
    """Guards: the grammar refused or ignored on the OpenAI routes (the model's free text)."""
    grammar = 'root ::= ("yes" | "no") " because " [a-z]{2,8}'
    for seed in range(3):
        text = chat(daemon, grammar=grammar, seed=seed).json()["choices"][0]["message"]["content"]
        assert text.split(" because ")[0] in ("yes", "no") and text.split(" because ")[1].isalpha(), text
        done = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": "The sky", "grammar": grammar, "seed": seed,
                                                                "max_tokens": 24}, timeout=60).json()
        assert done["choices"][0]["text"].split(" because ")[0] in ("yes", "no"), done


def test_a_json_schema_on_chat_and_response_format_json_object_with_a_schema(daemon):
    for body in ({"json_schema": SCHEMA}, {"response_format": {"type": "json_object", "schema": SCHEMA}}):
        r = chat(daemon, **body, max_tokens=40)
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("body, param, problem", [
    ({"response_format": {"type": "json_object", "schema": {"type": "object", "properties": 3}}},
     "response_format.schema", "is not a JSON schema llguidance can follow"),
    ({"response_format": {"type": "json_object", "schema": [1]}}, "response_format.schema", "must be a JSON schema"),
    ({"grammar": "root ::= x", "json_schema": SCHEMA}, "grammar", "give json_schema or grammar, not both"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar",
     "grammar and response_format: give one"),
    ({"grammar": 'root ::= "a"', "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "grammar", "grammar with tools"),
    ({"grammar": 7}, "grammar", "grammar must be a string (GBNF)")])
def test_contradictory_or_invalid_constraints_are_refused(daemon, body, param, problem):
    r = chat(daemon, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and problem in r.json()["error"]["message"]


def test_a_grammar_that_does_not_compile_is_refused_by_name(daemon):
    r = chat(daemon, grammar="root ::= (")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar"
