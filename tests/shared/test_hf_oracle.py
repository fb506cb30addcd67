"""The reference forward against Hugging Face transformers, through our converter.

HF checkpoint -> `fermoe convert` -> GGUF -> shared.reference.forward must give
HF's logits at every position (within LOGIT_RTOL of the logit scale) and the same
greedy continuation, for Qwen3.5-MoE and Qwen3-Next shapes, in F32, Q8_0 and Q4_0
files (the quantised ones against HF run on the dequantised weights)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.hf_oracle import SHAPES, build_hf_model, hf_greedy, hf_logits, round_trip_weights, save_checkpoint

from modeltools.convert import convert
from shared.engine import ReferenceEngine
from shared.generate import generate
from shared.ggml_types import GGMLType
from shared.model import Model
from shared.sampling import SamplingParams

pytestmark = pytest.mark.oracle

LOGIT_RTOL = 1e-4          # of max |logit|, as the issue asks (an f32 KV cache: HF's own)
KV_F16_RTOL = 1e-3         # an f16 KV cache (the default) against the same HF logits
PROMPT_LEN = 80            # > 64 so HF's chunked GDN path runs for the prompt
N_GREEDY = 8
QTYPES = {"f32": None, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 400, PROMPT_LEN).tolist()


def _check_logits(ours: np.ndarray, theirs: np.ndarray, rtol: float = LOGIT_RTOL) -> None:
    scale = np.abs(theirs).max()
    err = np.abs(ours - theirs).max()
    assert scale > 1.0, "activations collapsed: the oracle would test nothing"
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol} x {scale:.3g}"


@pytest.mark.parametrize("out_type", list(QTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_matches_hf(shape, out_type, tmp_path):
    hf = build_hf_model(shape, seed=len(shape))
    if QTYPES[out_type] is not None:
        round_trip_weights(hf, QTYPES[out_type])
    gguf = tmp_path / "model.gguf"
    convert(save_checkpoint(hf, tmp_path / "hf"), gguf, out_type, progress=False)

    model = Model(gguf)
    engine = ReferenceEngine(model, kv_cache_dtype="f32")
    ids = _prompt(seed=len(shape))
    theirs = hf_logits(hf, ids)
    _check_logits(engine.forward(ids, engine.new_state()), theirs)
    greedy = SamplingParams(temperature=0.0)
    assert list(generate(engine, ids, N_GREEDY, greedy)) == hf_greedy(hf, ids, N_GREEDY)

    f16 = ReferenceEngine(model, kv_cache_dtype="f16")
    _check_logits(f16.forward(ids, f16.new_state()), theirs, KV_F16_RTOL)
