"""The built-in `tiny` model, the trained one (shared/data/tiny-q8_0.gguf): it has
learned the text it was trained on, and REAP pruning to half its experts changes its
outputs less than random pruning does, with frequency pruning measured beside them."""
from __future__ import annotations

import os

import numpy as np
import pytest

from shared.builtin import BUILTIN, DATA_DIR, resolve_model
from modeltools.expert_saliency import expert_stats
from shared.gguf_file import GGUFFile
from shared.model import Model
from modeltools.perplexity import compare, perplexity
from modeltools.prune import kept_at_random, kept_by_score, reap_scores, write_pruned

HELDOUT = DATA_DIR / "stdlib" / "heldout.txt"
CALIB = DATA_DIR / "stdlib" / "calib.txt"
CTX = 512
EVAL_TOKENS = 4 * CTX                # four llama-perplexity windows of the held-out text
CALIB_TOKENS = 8192
# An expert no calibration token reaches scores 0 and goes first.
# A model that learned nothing predicts about uniformly: perplexity ~ the vocabulary
# size (4096). The trained one is at ~1/50 of that (docs/models.md); 1/20 leaves room for
# any retraining while still failing for an untrained or broken model.
LEARNED_FRACTION = 1 / 20
THREADS = min(4, len(os.sched_getaffinity(0)))   # the engines run one at a time: every core
RANDOM_SEEDS = tuple(range(8))


@pytest.fixture(scope="module")
def tiny():
    return Model(resolve_model("tiny"))


@pytest.fixture(scope="module")
def native_engine():
    """cpu_worker.native_engine where the extension it runs is built (it imports without)."""
    pytest.importorskip("native", reason="the native extension is not built", exc_type=ImportError)
    from cpu_worker import native_engine
    return native_engine


@pytest.fixture(scope="module")
def heldout_tokens(tiny):
    return tiny.tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))[:EVAL_TOKENS]


def test_tiny_resolves_to_the_packaged_file_and_reads_its_text(tiny):
    assert tiny.path == str(BUILTIN["tiny"]) and BUILTIN["tiny"].parent == DATA_DIR
    text = HELDOUT.read_text(encoding="utf-8")
    assert tiny.tokenizer.decode(tiny.tokenizer.encode(text)) == text       # byte-level BPE: lossless


def test_tiny_has_learned_the_text(tiny, heldout_tokens, native_engine):
    engine = native_engine.NativeEngine(tiny, threads=1)
    result = perplexity(engine, heldout_tokens, CTX, progress=False)
    engine.close()
    assert result.ppl < LEARNED_FRACTION * tiny.config.n_vocab, result.line()


def test_reap_at_half_the_experts_changes_outputs_less_than_random(tiny, heldout_tokens, tmp_path,
                                                                   record_property, native_engine):
    keep = tiny.config.n_expert // 2
    calib = tiny.tokenizer.encode(CALIB.read_text(encoding="utf-8"))[:CALIB_TOKENS]
    stats = expert_stats(tiny, calib, CTX, progress=False)
    choices = {"reap": kept_by_score(reap_scores(stats), keep), "frequency": kept_by_score(stats.count, keep)}
    for seed in RANDOM_SEEDS:
        choices[f"random{seed}"] = kept_at_random(tiny.config.n_layer, tiny.config.n_expert, keep, seed)
    base = native_engine.NativeEngine(tiny, threads=THREADS)
    kl = {}
    with GGUFFile(tiny.path) as src:
        for name, kept in choices.items():
            path = tmp_path / f"{name}.gguf"
            write_pruned(src, path, dict(enumerate(kept)), progress=False)
            pruned = native_engine.NativeEngine(Model(path), threads=THREADS)
            kl[name] = compare(base, pruned, heldout_tokens, CTX, progress=False).kl_mean
            pruned.close()
    base.close()
    random_kl = float(np.mean([kl[f"random{s}"] for s in RANDOM_SEEDS]))
    record_property("kl", {"reap": kl["reap"], "frequency": kl["frequency"], "random_mean": random_kl})
    print(f"KL(full || pruned to {keep}): reap {kl['reap']:.4f}, frequency {kl['frequency']:.4f}, "
          f"random {random_kl:.4f} (mean of seeds {RANDOM_SEEDS})")
    assert kl["reap"] < random_kl, kl
