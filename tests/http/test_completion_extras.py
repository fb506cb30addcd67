"""llama-server's /completion as its clients read it: `n_probs` (each token's probability and
the most likely ones', as `completion_probabilities`), token ids in every streamed chunk, and
`timings` numbers that are never null."""
from __future__ import annotations

import json

import httpx
import pytest

from shared.builtin import BUILTIN
from tests.support.http_server import HttpDaemon

PROMPT = {"prompt": "The json module", "temperature": 0, "n_predict": 5}


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(BUILTIN["tiny"])
    yield d
    assert d.stop() == 0


def test_n_probs_lists_each_tokens_probabilities(daemon):
    """Guards: n_probs refused or ignored, or probabilities not the model's (compared with the
    OpenAI route's logprobs of the same greedy tokens)."""
    body = httpx.post(f"{daemon.url}/completion", json={**PROMPT, "n_probs": 3, "return_tokens": True},
                      timeout=60).json()
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == body["tokens"] and len(probs) == 5
    assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)   # greedy
    assert "".join(p["token"] for p in probs) == body["content"]
    openai = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": PROMPT["prompt"], "temperature": 0,
                                                              "max_tokens": 5, "logprobs": 3}, timeout=60).json()
    assert [p["logprob"] for p in probs] == openai["choices"][0]["logprobs"]["token_logprobs"]
    # streamed: each chunk its own tokens' ids and probabilities, which add up to the whole answer's
    with httpx.stream("POST", f"{daemon.url}/completion", json={**PROMPT, "n_probs": 3, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [t for c in chunks for t in c["tokens"]] == body["tokens"]
    assert [p["id"] for c in chunks for p in c["completion_probabilities"]] == body["tokens"]


@pytest.mark.parametrize("extra, param", [({"n_probs": 21}, "n_probs"), ({"n_probs": "3"}, "n_probs"),
                                          ({"n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs")])
def test_n_probs_out_of_range_is_refused(daemon, extra, param):
    r = httpx.post(f"{daemon.url}/completion", json={**PROMPT, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_timings_are_numbers_even_for_one_token(daemon):
    """Guards: null rates (a client dividing or formatting them fails) for a one-token answer."""
    timings = httpx.post(f"{daemon.url}/completion", json={**PROMPT, "n_predict": 1}, timeout=60).json()["timings"]
    assert all(isinstance(v, (int, float)) for v in timings.values()), timings
    assert timings["predicted_n"] == 1


def test_response_fields_keep_only_those_listed(daemon):
    """Guards: the whole answer sent anyway, or a nested field left nested (llama-server brings it
    up, keyed by its path)."""
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "no_such_field"]
    whole = httpx.post(f"{daemon.url}/completion", json=PROMPT, timeout=60).json()
    body = httpx.post(f"{daemon.url}/completion", json={**PROMPT, "response_fields": fields}, timeout=60).json()
    assert body == {"content": whole["content"], "generation_settings/n_predict": 5, "timings/predicted_n": 5}
    with httpx.stream("POST", f"{daemon.url}/completion", json={**PROMPT, "response_fields": fields, "stream": True},
                      timeout=60) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert last == {"content": "", "generation_settings/n_predict": 5, "timings/predicted_n": 5}


def _progress(daemon, prompt: str) -> list[dict]:
    with httpx.stream("POST", f"{daemon.url}/completion", json={"prompt": prompt, "temperature": 0, "n_predict": 2,
                                                                 "stream": True, "return_progress": True},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1]["stop"] is True
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c], chunks[-1]["timings"]


def test_return_progress_reports_each_pass_over_the_prompt(daemon):
    """Guards: no progress from the worker's passes (only the first report, or only the last),
    processed not growing to the prompt's size, or cache not what the prefix cache gave (a
    repeated prompt resumes from its snapshot: its first report is the cached part, processed)."""
    prompt = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n" * 12
    reports, timings = _progress(daemon, prompt)
    total = timings["prompt_n"] + timings["cache_n"]
    assert reports[0]["processed"] == reports[0]["cache"] == timings["cache_n"]
    assert len(reports) >= 3 and reports[-1]["processed"] == total      # passes stop at each block's snapshot
    assert all(r["total"] == total and r["cache"] == reports[0]["cache"] for r in reports)
    assert all(a["processed"] < b["processed"] and a["time_ms"] <= b["time_ms"] for a, b in zip(reports, reports[1:]))
    again, timings = _progress(daemon, prompt + "def main():")
    assert again[0]["cache"] == again[0]["processed"] == timings["cache_n"] > 0
    assert again[-1]["processed"] == again[0]["total"] == timings["prompt_n"] + timings["cache_n"]


def test_several_prompts_each_answered_as_alone(daemon):
    """Guards: the prompts of one request mixed up (a prompt answered with another's text) or
    decoded differently side by side than alone: greedy, each equals its single-prompt answer."""
    prompts = ["The json module", "def parse(", [1785, 11]]
    alone = [httpx.post(f"{daemon.url}/completion", json={**PROMPT, "prompt": p}, timeout=60).json()["content"]
             for p in prompts]
    together = httpx.post(f"{daemon.url}/completion", json={**PROMPT, "prompt": prompts}, timeout=60).json()
    assert [(a["index"], a["content"]) for a in together] == list(enumerate(alone))
    assert len(set(alone)) == 3
    with httpx.stream("POST", f"{daemon.url}/completion", json={**PROMPT, "prompt": prompts, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert ["".join(c["content"] for c in chunks if c["index"] == i) for i in range(3)] == alone
    assert sorted(c["index"] for c in chunks if c["stop"]) == [0, 1, 2]
