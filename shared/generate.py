"""Prompt in, tokens out: the loop shared by `fermoe generate` and later the workers."""
from __future__ import annotations

from typing import Iterator

from .sampling import Sampler, SamplingParams


def generate(engine, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
             stop_ids=frozenset(), state=None) -> Iterator[int]:
    """Yield up to max_tokens sampled tokens; stops after a token in stop_ids."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    state = state or engine.new_state()
    sampler = Sampler(params)
    history = list(prompt_ids)
    logits = engine.forward(prompt_ids, state)[-1]
    for i in range(max_tokens):
        token = sampler.sample(logits, history)
        yield token
        if token in stop_ids or i == max_tokens - 1:
            return
        history.append(token)
        logits = engine.forward([token], state)[-1]
