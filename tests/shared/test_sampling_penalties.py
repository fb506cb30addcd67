"""OpenAI's frequency and presence penalties, applied as llama.cpp's penalties sampler
applies penalty_freq and penalty_present: for every token among the last repeat_last_n,
logit -= count * frequency_penalty + presence_penalty, after the repeat penalty."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from shared import protocol as P
from shared.errors import FermoeError, ProtocolError
from shared.sampling import InvalidSampling, Sampler, SamplingParams

# token 0 leads token 1 by 0.1; token 0 occurs twice in the history, token 1 never
LOGITS = np.array([3.0, 2.9, 1.0, -1.0], dtype=np.float32)
HISTORY = [0, 0, 3]


def greedy(**penalties) -> int:
    return Sampler(SamplingParams(temperature=0.0, **penalties)).sample(LOGITS, HISTORY)


@pytest.mark.parametrize("penalty, winner", [
    (dict(), 0),
    (dict(frequency_penalty=0.04), 0),       # 3.0 - 2 * 0.04 = 2.92 > 2.9
    (dict(frequency_penalty=0.06), 1),       # 3.0 - 2 * 0.06 = 2.88 < 2.9
    (dict(presence_penalty=0.08), 0),        # 3.0 - 0.08 = 2.92: once, whatever the count
    (dict(presence_penalty=0.12), 1),        # 2.88
    (dict(frequency_penalty=0.03, presence_penalty=0.03), 0),   # 3.0 - 0.06 - 0.03 = 2.91
    (dict(frequency_penalty=0.03, presence_penalty=0.05), 1),   # 2.89: both add up
])
def test_penalties_move_the_greedy_pick_where_the_formula_says(penalty, winner):
    expected = LOGITS.astype(np.float64).copy()
    counts = np.bincount(HISTORY, minlength=len(LOGITS))
    present = counts > 0
    expected[present] -= counts[present] * penalty.get("frequency_penalty", 0.0) + penalty.get("presence_penalty", 0.0)
    assert int(np.argmax(expected)) == winner       # the case is what its comment says
    assert greedy(**penalty) == winner


@pytest.mark.parametrize("window", [64, 5])
def test_penalties_look_back_repeat_last_n_tokens_only(window):
    params = dict(temperature=0.0, presence_penalty=1.0, repeat_last_n=window)
    far = [0] + [3] * window                              # token 0 just out of the window
    assert Sampler(SamplingParams(**params)).sample(LOGITS, far) == 0
    assert Sampler(SamplingParams(**params)).sample(LOGITS, far[1:] + [0]) == 1
    assert Sampler(SamplingParams(**{**params, "repeat_last_n": 0})).sample(LOGITS, [0]) == 0    # 0: no penalty


def test_one_bad_sampling_value_is_refused_where_the_parameters_are_made():
    with pytest.raises(InvalidSampling, match="repeat_last_n must be >= 0") as e:
        SamplingParams(repeat_last_n=-1)
    assert e.value.field == "repeat_last_n"
    raw = msgspec.msgpack.encode({"type": "generate", "request_id": "r7", "prompt": "x",
                                  "sampling": {"top_p": 0.0}})
    with pytest.raises(ProtocolError, match=r"top_p must be in \(0, 1\], got 0.0"):
        P.decode(raw, P.CLIENT_MESSAGES)
    assert P.request_id_of(raw) == "r7" and P.request_id_of(b"\xc1") is None
    named, rest = SamplingParams.split({"temperature": 0.0, "max_tokens": 3})
    assert named == SamplingParams(temperature=0.0) and rest == {"max_tokens": 3}


def test_negative_penalties_favour_repeats():
    logits = np.array([2.9, 3.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0, presence_penalty=-0.2)).sample(logits, [0]) == 0


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty"])
def test_non_finite_penalties_are_refused(field):
    with pytest.raises(FermoeError, match=field):
        SamplingParams(**{field: float("inf")})
