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
    """Guards: the whole answer sent anyway, or a nested field left nested (llama-server brings it up)."""
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "no_such_field"]
    whole = httpx.post(f"{daemon.url}/completion", json=PROMPT, timeout=60).json()
    body = httpx.post(f"{daemon.url}/completion", json={**PROMPT, "response_fields": fields}, timeout=60).json()
    assert body == {"content": whole["content"], "n_predict": 5, "predicted_n": 5}
    with httpx.stream("POST", f"{daemon.url}/completion", json={**PROMPT, "response_fields": fields, "stream": True},
                      timeout=60) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert last == {"content": "", "n_predict": 5, "predicted_n": 5}
