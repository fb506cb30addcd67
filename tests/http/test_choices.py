"""`n` > 1 on chat and text completions: each choice is what a request of one choice with the
seed S + i answers, the prompt's snapshot is shared (the later choices find it cached), and the
answer is one: choices with their index, the prompt counted once in usage, one stream under
one id with one usage chunk and one [DONE]."""
from __future__ import annotations

import json

import httpx
import pytest

from shared.builtin import BUILTIN
from tests.support.http_server import HttpDaemon, sse_events

PROMPT = ("The json module can serialize Python objects to a string and parse them back; its dumps "
          "function takes an object and returns")
CHAT = [{"role": "user", "content": "What does json.dumps do?"}]


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(BUILTIN["tiny"], "--max-sequences", "4")
    yield d
    assert d.stop() == 0


def post(daemon, path, **body):
    r = httpx.post(f"{daemon.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def metric(daemon, name: str) -> float:
    for line in httpx.get(f"{daemon.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_text_choices_are_single_requests_with_seeds_s_plus_i(daemon):
    """Guards: every choice drawn with the same seed (identical choices), choices not indexed,
    the prompt counted n times, or the prompt prefilled again for each choice."""
    singles = [post(daemon, "/v1/completions", prompt=PROMPT, max_tokens=8, seed=5 + i) for i in range(3)]
    hits = metric(daemon, "fermoe:prefix_cache_hits_total")
    many = post(daemon, "/v1/completions", prompt=PROMPT, max_tokens=8, seed=5, n=3)
    hit = metric(daemon, "fermoe:prefix_cache_hits_total") - hits
    assert [(c["index"], c["text"]) for c in many["choices"]] == [(i, s["choices"][0]["text"])
                                                                  for i, s in enumerate(singles)]
    prompt = singles[0]["usage"]["prompt_tokens"]
    assert many["usage"]["prompt_tokens"] == prompt
    assert many["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert many["usage"]["total_tokens"] == prompt + many["usage"]["completion_tokens"]
    # every choice resumed from the prompt's snapshot (the singles stored it; the choices after
    # the first find the first's too): the whole prompt, less a block at most, each
    assert hit >= 3 * (prompt - 8)


def test_chat_choices_streamed_as_one_stream(daemon):
    """Guards: a [DONE] or usage chunk per choice, chunks under several ids, or a choice's
    deltas under another's index."""
    whole = post(daemon, "/v1/chat/completions", messages=CHAT, max_tokens=12, seed=3, n=2,
                 chat_template_kwargs={"enable_thinking": False})
    with httpx.stream("POST", f"{daemon.url}/v1/chat/completions", timeout=120,
                      json={"messages": CHAT, "max_tokens": 12, "seed": 3, "n": 2, "stream": True,
                            "stream_options": {"include_usage": True},
                            "chat_template_kwargs": {"enable_thinking": False}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    usage = [c for c in chunks if c["choices"] == []]
    assert len(usage) == 1
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage[0]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    assert usage[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == whole["usage"]["prompt_tokens"]  # again
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert [c["finish_reason"] for c in whole["choices"]] == ["length", "length"]


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused(daemon, n):
    r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": "x", "n": n}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert r.json()["error"]["message"] == f"n must be in [1, 16], got {n}"


def test_the_later_choices_resume_from_the_firsts_prompt(daemon):
    """Guards: the choices submitted together, each prefilling the whole prompt itself."""
    fresh = PROMPT.replace("json", "pickle")
    hits = metric(daemon, "fermoe:prefix_cache_hits_total")
    many = post(daemon, "/v1/completions", prompt=fresh, max_tokens=4, seed=1, n=3)
    prompt = many["usage"]["prompt_tokens"]
    assert many["usage"]["prompt_tokens_details"]["cached_tokens"] == 0          # the first choice's: cold
    assert metric(daemon, "fermoe:prefix_cache_hits_total") - hits >= 2 * (prompt - 8)
