"""The reference forward run two ways that must agree (whole prompt at once, and
in pieces / token by token with carried state); the synthetic model a useful workload.
The state it carries is tested in test_state.py."""
from __future__ import annotations

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.model import Model
from shared import reference as R
from shared.reference import route

# Pieces and whole differ only by float summation order.
SPLIT_RTOL = 1e-5
PROMPT = [3, 17, 250, 9, 77, 100, 4, 5, 300, 31, 42, 8, 16, 23, 99, 101, 102, 7, 0, 64]


@pytest.fixture(scope="module")
def engine(tiny_path):
    return ReferenceEngine(Model(tiny_path))


def _close(a, b):
    scale = np.abs(b).max()
    assert np.abs(a - b).max() <= SPLIT_RTOL * scale


def test_whole_prompt_equals_pieces_and_single_tokens(engine):
    whole = engine.forward(PROMPT, engine.new_state())
    state = engine.new_state()
    parts = [engine.forward(PROMPT[:7], state), engine.forward(PROMPT[7:12], state)]
    parts += [engine.forward([t], state) for t in PROMPT[12:]]
    _close(np.concatenate(parts), whole)
    assert state.position == len(PROMPT)
    _close(state.logits, whole[-1])
    assert state.logits_valid


def test_activations_and_routing_are_sane(tiny_q4_path):
    """The synthetic model is a useful workload: O(1) logits, routers that spread."""
    model = Model(tiny_q4_path)
    engine = ReferenceEngine(model)
    logits = engine.forward(list(range(40)), engine.new_state())
    assert np.isfinite(logits).all() and 0.1 < logits.std() < 100
    x = np.random.default_rng(0).standard_normal((64, model.config.n_embd)).astype(np.float32)
    top, weights = route(model.layers[0], x, model.config)
    assert len(np.unique(top)) == model.config.n_expert
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-6)




@pytest.mark.parametrize("chunk, cuts", [(64, ()), (4, ()), (5, (3, 11)), (64, (1, 2, 30))])
def test_the_chunked_delta_rule_is_the_token_by_token_one(chunk, cuts):
    """The WY form the GPU computes (reference.delta_rule_chunked) equals the rule token by
    token, whatever the chunk length and cuts (snapshot positions)."""
    rng = np.random.default_rng(7)
    T, H, dk, dv = 37, 3, 8, 6
    q, k = (R.l2_normalize(rng.standard_normal((T, H, dk))) for _ in range(2))
    v = rng.standard_normal((T, H, dv))
    g = -np.abs(rng.standard_normal((T, H))) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((T, H))))
    S0 = rng.standard_normal((H, dk, dv))
    S_tok, S_chunk = S0.copy(), S0.copy()
    want = R.delta_rule(q, k, v, g, beta, S_tok)
    got = R.delta_rule_chunked(q, k, v, g, beta, S_chunk, chunk, cuts)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(S_chunk, S_tok, rtol=1e-10, atol=1e-10)
