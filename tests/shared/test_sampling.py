"""The sampler against its definition: greedy, top-k, top-p, min-p, the repeat
penalty, seeding, and the frequencies of plain temperature sampling."""
from __future__ import annotations

import numpy as np
import pytest

from shared.errors import FermoeError
from shared.sampling import SAMPLE_STRIDE, Sampler, SamplingParams, logprobs_of, top_k_order

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


def _top_k_by_definition(x, k):
    return np.lexsort((np.arange(len(x)), -x))[:k]


@pytest.mark.parametrize("case", ["normal", "ties", "tops_off_the_stride", "tops_on_the_stride", "tiny",
                                  "masked_few_left", "masked_many_left"])
@pytest.mark.parametrize("k", [1, 40, 300])
def test_top_k_order_is_the_k_largest_with_ties_by_index(case, k):
    """The sampled threshold only narrows the candidates: whatever the logits, the
    result is the k largest, largest first, equal ones by index."""
    rng = np.random.default_rng(k)
    n = 7 if case == "tiny" else 248_320
    x = rng.standard_normal(n).astype(np.float32)
    if case == "ties":
        x = rng.integers(0, 5, n).astype(np.float32)
    on_stride = np.arange(0, n, SAMPLE_STRIDE)
    if case == "tops_off_the_stride":              # the sample misses every large logit
        x[np.setdiff1d(np.arange(n), on_stride)[:500]] += 50
    if case == "tops_on_the_stride":               # the sample is all large: fewer than k reach its threshold
        x[on_stride] += 50
    if case.startswith("masked"):                  # a grammar's mask: -inf but for a few (or many) tokens
        x[rng.permutation(n)[:n - (20 if case == "masked_few_left" else 5000)]] = -np.inf
    k = min(k, n - 1)
    np.testing.assert_array_equal(top_k_order(x, k), _top_k_by_definition(x, k))


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


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(5000) * 3).astype(np.float32)
    want = logits.astype(np.float64) - np.log(np.sum(np.exp(logits.astype(np.float64))))
    lp, top = logprobs_of(logits, 123, 5)
    assert lp == pytest.approx(want[123], abs=1e-5)
    order = np.argsort(-want)[:5]
    assert [t for t, _ in top] == order.tolist()
    assert [v for _, v in top] == pytest.approx(want[order].tolist(), abs=1e-5)
    assert logprobs_of(logits, 0, 0)[1] == []
