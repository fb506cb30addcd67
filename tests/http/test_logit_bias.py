"""logit_bias, held to a reference: greedy decoding of the engine's own logits with the bias
added by hand here (numpy, not the sampler), on OpenAI's object form and llama-server's list
forms (token ids, text, false to ban), and two requests of different biases decoded in one
batch."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from shared.builtin import BUILTIN
from fermoe.engines import load_engine
from shared.model import Model
from tests.support.http_server import HttpDaemon

PROMPT, N = "The json module", 6


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(BUILTIN["tiny"], "--max-sequences", "4")
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def model():
    return Model(BUILTIN["tiny"])


def reference(model, bias: dict[int, float], n: int = N) -> list[int]:
    """Greedy tokens of the engine's logits plus `bias`, one step at a time."""
    engine = load_engine("cpu", model, threads=1)
    try:
        state = engine.new_state()
        logits = engine.forward(model.tokenizer.encode(PROMPT), state, all_logits=False)[-1]
        out = []
        for _ in range(n):
            biased = np.asarray(logits, dtype=np.float64).copy()
            for token, b in bias.items():
                biased[token] += b
            out.append(int(np.argmax(biased)))
            logits = engine.forward([out[-1]], state, all_logits=False)[-1]
        return out
    finally:
        engine.close()


def completion(daemon, **body) -> dict:
    r = httpx.post(f"{daemon.url}/completion", json={"prompt": PROMPT, "temperature": 0, "n_predict": N,
                                                     "return_tokens": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_bias_moves_greedy_decoding_as_the_reference_does(daemon, model):
    """Guards: the bias ignored, applied after the greedy pick, or to the wrong token."""
    plain = completion(daemon)["tokens"]
    assert plain == reference(model, {})
    first = plain[0]
    # OpenAI's form on /v1/completions: the first pick pushed down, another takes its place
    r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": PROMPT, "temperature": 0, "max_tokens": N,
                                                         "logit_bias": {str(first): -100}, "logprobs": 0}, timeout=60)
    want = reference(model, {first: -100})
    assert want[0] != first
    got = [model.tokenizer.decode([t]) for t in want]
    assert r.json()["choices"][0]["logprobs"]["tokens"] == got
    # llama-server's forms: a ban (false) and a token id pair; the settings show the ban as false
    banned = completion(daemon, logit_bias=[[first, False], [plain[1], 5.5]])
    assert banned["tokens"] == reference(model, {first: -math.inf, plain[1]: 5.5})
    assert banned["generation_settings"]["logit_bias"] == sorted([[first, False], [plain[1], 5.5]])


def test_a_text_biases_each_of_its_tokens(daemon, model):
    text = " dumps"
    ids = model.tokenizer.encode(text)
    got = completion(daemon, logit_bias=[[text, 8.0]])
    assert got["tokens"] == reference(model, {i: 8.0 for i in ids})


def test_two_biases_decoded_in_one_batch_each_keep_their_own(daemon, model):
    """Guards: one sequence's bias applied to every sequence of a batch."""
    first = reference(model, {})[0]
    biases = [{}, {first: -100.0}, {first: 12.0}]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda b: completion(daemon, n_predict=24, logit_bias=[[t, v] for t, v in b.items()]),
                             biases))
    for bias, out in zip(biases, outs):
        assert out["tokens"] == reference(model, bias, 24)


@pytest.mark.parametrize("route, bias, problem", [
    ("/v1/completions", {"x": 1}, "logit_bias keys are token ids"),
    ("/v1/completions", {"5": 101}, "a bias in [-100, 100]"),
    ("/v1/completions", {"999999": 1}, "logit_bias: token ids must be in [0,"),
    ("/completion", [[5, "a lot"]], "must be a number or false"),
    ("/completion", [5, 1], "expected [[token id"),
])
def test_bad_biases_are_refused_naming_the_field(daemon, route, bias, problem):
    r = httpx.post(f"{daemon.url}{route}", json={"prompt": PROMPT, "logit_bias": bias}, timeout=60)
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text
