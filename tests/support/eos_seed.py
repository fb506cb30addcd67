"""A seed that makes a sampled run stop early on an end-of-generation token: what the
--ignore-eos / ignore_eos tests need, found with the library instead of hard-coded
(any change to the numerics moves which seeds do it)."""
from __future__ import annotations

from fermoe.engines import load_engine
from shared.generate import generate
from shared.model import Model
from shared.sampling import SamplingParams


def seed_with_early_eos(model_path, prompt: str, max_tokens: int, temperature: float, seeds=range(64)) -> int:
    """The first seed whose `fermoe generate --engine cpu` of `prompt` ends with an
    end-of-generation token before max_tokens."""
    model = Model(model_path)
    engine = load_engine("cpu", model, threads=1)
    eos = model.tokenizer.eos_ids
    ids = model.tokenizer.encode(prompt)
    for seed in seeds:
        out = list(generate(engine, ids, max_tokens, SamplingParams(temperature=temperature, seed=seed), stop_ids=eos))
        if out and out[-1] in eos and len(out) < max_tokens:
            return seed
    raise AssertionError(f"no seed in {seeds} samples an end-of-generation token within {max_tokens} tokens")
