"""The sampler against its definition: greedy, top-k, top-p, min-p, the repeat
penalty, seeding, and the frequencies of plain temperature sampling."""
from __future__ import annotations

import numpy as np
import pytest

from shared.errors import FermoeError
from shared.sampling import Sampler, SamplingParams

OPEN = dict(top_k=0, top_p=1.0, min_p=0.0)          # every filter off


def _logits(n=50, seed=0):
    return (np.random.default_rng(seed).standard_normal(n) * 2).astype(np.float32)


def _draws(params, logits, n=2000, history=()):
    s = Sampler(params)
    return np.array([s.sample(logits, history) for _ in range(n)])


def _probs(logits, temperature=1.0):
    z = np.exp((logits.astype(np.float64) - logits.max()) / temperature)
    return z / z.sum()


def test_greedy_and_top_k_one_take_the_largest_logit():
    x = _logits()
    assert Sampler(SamplingParams(temperature=0.0)).sample(x) == int(np.argmax(x))
    assert set(_draws(SamplingParams(temperature=5.0, top_k=1, seed=1), x, 200)) == {int(np.argmax(x))}


def test_top_k_top_p_and_min_p_keep_only_their_tokens():
    x = _logits()
    order = np.argsort(-x)
    assert set(_draws(SamplingParams(temperature=2.0, seed=2, **{**OPEN, "top_k": 5}), x)) <= set(order[:5])
    p = _probs(x, 2.0)[order]
    nucleus = int(np.searchsorted(np.cumsum(p), 0.6) + 1)
    assert set(_draws(SamplingParams(temperature=2.0, seed=3, **{**OPEN, "top_p": 0.6}), x)) == set(order[:nucleus])
    above = int(np.sum(p >= 0.2 * p[0]))
    assert set(_draws(SamplingParams(temperature=2.0, seed=4, **{**OPEN, "min_p": 0.2}), x)) == set(order[:above])


def test_plain_sampling_follows_the_softmax():
    x = _logits(8, seed=5)
    counts = np.bincount(_draws(SamplingParams(temperature=1.0, seed=6, **OPEN), x, 40_000), minlength=8)
    expected = _probs(x) * counts.sum()
    assert ((counts - expected) ** 2 / expected).sum() < 30          # chi-square, 7 dof: p ~ 1e-4


def test_repeat_penalty_as_llama_cpp_applies_it():
    x = np.array([2.0, 2.0, -1.0, -1.0], np.float32)                   # tokens 0 and 2 were just used
    s = SamplingParams(temperature=1.0, seed=7, repeat_penalty=2.0, **OPEN)
    freq = np.bincount(_draws(s, x, 20_000, history=[0, 2]), minlength=4) / 20_000
    want = _probs(np.array([1.0, 2.0, -2.0, -1.0]))                    # positive / 2, negative * 2
    np.testing.assert_allclose(freq, want, atol=0.015)


def test_seeded_runs_repeat_and_the_logits_dtype_does_not_matter():
    x = _logits(248_320, seed=8)
    params = SamplingParams(temperature=0.8, seed=9)
    a = [Sampler(params).sample(x) for _ in range(3)]
    s32, s64 = Sampler(params), Sampler(params)
    assert [s32.sample(x) for _ in range(20)] == [s64.sample(x.astype(np.float64)) for _ in range(20)]
    assert len(set(a)) == 1


def test_bad_parameters_are_refused():
    with pytest.raises(FermoeError, match="top_p"):
        Sampler(SamplingParams(top_p=0.0))
    with pytest.raises(FermoeError, match="repeat_penalty"):
        Sampler(SamplingParams(repeat_penalty=0.0))
