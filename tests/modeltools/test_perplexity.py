"""Perplexity and compare in llama-perplexity's convention, on engines whose answers
are known in closed form, and `fermoe ppl` / `fermoe compare` on a real file."""
from __future__ import annotations

import math

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from shared.model import Model
from modeltools.perplexity import compare, perplexity
from tests.support.serving_harness import fermoe

VOCAB = 50
TOKENS = [(13 * i * i + 5 * i + 1) % VOCAB for i in range(203)]


class _State:
    position = 0


class FixedEngine:
    """Logits that depend only on the token at each position: a fixed table
    logits[token] (the known distributions), checking each window starts empty."""

    def __init__(self, table):
        self.table, self.calls = np.asarray(table, np.float32), []

    def new_state(self):
        return _State()

    def forward(self, tokens, state, all_logits=True):
        assert state.position == 0             # every window runs from an empty state
        self.calls.append(np.array(tokens))
        state.position += len(tokens)
        return self.table[np.asarray(tokens)]

    def close(self):
        pass


def test_windows_and_scored_positions_follow_llama_perplexity():
    engine = FixedEngine(np.zeros((VOCAB, VOCAB)))        # uniform: every scored NLL is log(VOCAB)
    result = perplexity(engine, TOKENS, ctx=40, progress=False)
    n_windows = len(TOKENS) // 40                          # the 3-token tail is left out
    assert [len(c) for c in engine.calls] == [40] * n_windows
    assert all(np.array_equal(c, TOKENS[i * 40:(i + 1) * 40]) for i, c in enumerate(engine.calls))
    assert result.windows == n_windows and result.tokens == n_windows * (40 // 2 - 1)
    assert result.ppl == pytest.approx(VOCAB, rel=1e-9) and result.stderr == pytest.approx(0, abs=1e-9)


def test_perplexity_scores_the_second_half_against_the_next_token():
    """A table that predicts token t -> (t + 1) % VOCAB with probability p: the NLL of
    each scored position is -log p where the text follows the rule, else -log((1-p)/(V-1)).
    Scoring the first half, or the current token, gives another count."""
    p = 0.9
    table = np.full((VOCAB, VOCAB), math.log((1 - p) / (VOCAB - 1)))
    table[np.arange(VOCAB), (np.arange(VOCAB) + 1) % VOCAB] = math.log(p)
    tokens = [(i * i) % VOCAB if i % 3 == 0 else i % VOCAB for i in range(160)]
    ctx = 32
    want = []
    for w in range(len(tokens) // ctx):
        for j in range(ctx // 2, ctx - 1):
            cur, nxt = tokens[w * ctx + j], tokens[w * ctx + j + 1]
            want.append(-math.log(p) if nxt == (cur + 1) % VOCAB else -math.log((1 - p) / (VOCAB - 1)))
    result = perplexity(FixedEngine(table), tokens, ctx=ctx, progress=False)
    assert result.ppl == pytest.approx(math.exp(np.mean(want)), rel=1e-6)
    assert result.stderr == pytest.approx(math.exp(np.mean(want)) * np.std(want) / math.sqrt(len(want) - 1), rel=1e-6)


def test_compare_kl_is_of_b_from_a_and_top1_counts_agreement():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(VOCAB, VOCAB)), rng.normal(size=(VOCAB, VOCAB))
    b[:10] = a[:10] + 0.01                     # tokens 0..9: both models pick the same next token
    ctx = 40
    result = compare(FixedEngine(a), FixedEngine(b), TOKENS, ctx=ctx, progress=False)
    pa = np.exp(a - a.max(1, keepdims=True)); pa /= pa.sum(1, keepdims=True)
    pb = np.exp(b - b.max(1, keepdims=True)); pb /= pb.sum(1, keepdims=True)
    rows = [TOKENS[w * ctx + j] for w in range(len(TOKENS) // ctx) for j in range(ctx // 2, ctx - 1)]
    kl = [np.sum(pa[t] * np.log(pa[t] / pb[t])) for t in rows]
    assert result.kl_mean == pytest.approx(np.mean(kl), rel=1e-6)
    assert result.top1_agreement == pytest.approx(np.mean([a[t].argmax() == b[t].argmax() for t in rows]))
    assert 0 < result.top1_agreement < 1
    same = compare(FixedEngine(a), FixedEngine(a), TOKENS, ctx=ctx, progress=False)
    assert same.kl_mean == pytest.approx(0, abs=1e-12) and same.top1_agreement == 1
    assert same.a.ppl == same.b.ppl == result.a.ppl


def test_a_text_shorter_than_two_windows_is_refused():
    with pytest.raises(FermoeError, match="needs at least 80"):
        perplexity(FixedEngine(np.zeros((VOCAB, VOCAB))), TOKENS[:79], ctx=40, progress=False)


def test_ppl_and_compare_commands(tiny_path, tmp_path):
    model = Model(tiny_path)
    text = tmp_path / "t.txt"
    text.write_text(model.tokenizer.decode(TOKENS * 2))
    ids = model.tokenizer.encode(text.read_text())
    want = perplexity(ReferenceEngine(model), ids, ctx=64, progress=False)
    run = fermoe("ppl", tiny_path, "--text", text, "--ctx", 64, "--engine", "reference", check=False)
    assert run.returncode == 0, run.stderr
    assert f"PPL = {want.ppl:.4f}" in run.stdout and f"{want.tokens} tokens" in run.stdout
    run = fermoe("compare", tiny_path, tiny_path, "--text", text, "--ctx", 64, "--json", check=False)
    assert run.returncode == 0, run.stderr
    import json
    out = json.loads(run.stdout)
    assert out["kl_mean"] == 0 and out["top1_agreement"] == 1 and out["tokens"] == want.tokens
    run = fermoe("ppl", tiny_path, "--text", text, "--ctx", 4096, check=False)
    assert run.returncode == 1 and "perplexity with --ctx 4096 needs at least 8192" in run.stderr
