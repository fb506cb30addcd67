"""llama-server's own API against a running daemon on the tiny model: /completion in its three
prompt forms, streamed and not, with its stop_type, timings and field names; /props, /slots,
/apply-template; grammar (GBNF) and json_schema through the same constrained path as chat's."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.support.http_server import LocalEngine, sse_events

CHAT = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def local(tiny_q4_path):
    return LocalEngine(tiny_q4_path)


def post(daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{daemon.url}{path}", json=body, timeout=120)


def test_completion_in_each_prompt_form_is_the_local_generation(daemon, local):
    prompt = "The old GPU said"
    ids = local.tok.encode(prompt)
    mixed = [prompt[:7], *local.tok.encode(prompt[7:])]           # a string's tokens, then token ids
    for form, form_ids in ((prompt, ids), (ids, ids), (mixed, local.tok.encode(prompt[:7]) + mixed[1:])):
        text, n = local.text(form_ids, 8, seed=3, temperature=0.8)
        r = post(daemon, "/completion", {"prompt": form, "n_predict": 8, "seed": 3, "cache_prompt": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["content"], body["tokens_predicted"], body["tokens_evaluated"]) == (text, n, len(form_ids))
        assert body["stop"] is True and body["stop_type"] == ("limit" if n == 8 else "eos")
        assert body["prompt"] == local.tok.decode(form_ids) and body["generation_settings"]["n_predict"] == 8
        assert body["timings"]["predicted_n"] == n and body["tokens_cached"] == len(form_ids) + n


def test_completion_stream_and_stop_words(daemon, local):
    prompt = "The old GPU said"
    text, _ = local.text(local.tok.encode(prompt), 10, seed=4, temperature=0.8)
    with httpx.stream("POST", f"{daemon.url}/completion", timeout=60, json={
            "prompt": prompt, "n_predict": 10, "seed": 4, "stream": True, "return_tokens": True}) as r:
        events = [json.loads(e) for e in sse_events(r)]
    assert "".join(e["content"] for e in events) == text and [e["stop"] for e in events][-1] is True
    assert not any(e["stop"] for e in events[:-1]) and all(e["tokens"] for e in events[:-1])
    assert events[-1]["stop_type"] in ("limit", "eos") and events[-1]["timings"]["predicted_n"] >= 1
    word = text.strip().split()[1]
    cut = post(daemon, "/completion", {"prompt": prompt, "n_predict": 10, "seed": 4, "stop": [word]}).json()
    assert (cut["stop_type"], cut["stopping_word"]) == ("word", word) and cut["content"] == text[:text.index(word)]


def test_props_slots_and_apply_template(daemon, local, tiny_q4_path):
    props = httpx.get(f"{daemon.url}/props").json()
    assert props["total_slots"] == 2 and props["model_path"] == str(tiny_q4_path)
    assert props["default_generation_settings"]["n_ctx"] == 262144 and props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}
    slots = httpx.get(f"{daemon.url}/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
    rendered = post(daemon, "/apply-template", {"messages": CHAT}).json()["prompt"]
    assert rendered == local.tok.apply_chat_template(CHAT)


def test_grammar_and_json_schema_constrain_the_completion(daemon):
    """llama-server's GBNF `grammar` and `json_schema` go through the coordinator's
    llguidance path: the text matches."""
    r = post(daemon, "/completion", {"prompt": "Answer:", "n_predict": 8, "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200 and r.json()["content"] in ("yes", "no"), r.text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = post(daemon, "/completion", {"prompt": "JSON:", "n_predict": 24, "json_schema": schema})
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    if r.json()["stop_type"] == "eos":                  # finished: the whole object
        assert isinstance(json.loads(content)["n"], int)
    else:                                               # cut by n_predict: a prefix of one
        assert content.lstrip().startswith('{"n": ')


@pytest.mark.parametrize("body, status, word", [
    ({"prompt": "x", "grammar": "root ::= ("}, 400, "GBNF"),
    ({"prompt": "x", "json_schema": [1]}, 400, "json_schema must be a JSON schema object"),
    ({"prompt": "x", "json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}, 400, "not both"),
    ({"prompt": ["a"] * 65}, 400, "at most 64"),
    ({"prompt": ["a", 1.5]}, 400, "token ids"),
    ({"n_predict": 3}, 400, "prompt"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
])
def test_bad_completions_are_400s(daemon, body, status, word):
    r = post(daemon, "/completion", body)
    assert r.status_code == status and word in r.json()["error"]["message"], r.text
    assert httpx.get(f"{daemon.url}/health").status_code == 200
