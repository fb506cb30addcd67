"""Prompt in, tokens out: one decoding loop shared by `fermoe generate` and the
CPU workers, so a served request and a local run sample the very same tokens."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .errors import FermoeError
from .sampling import Sampler, SamplingParams, logprobs_of


class Decoder:
    """Samples one token per `step()` from a state whose last logits are known.

    history is the prompt (the repeat penalty looks back over it). Finished after
    max_tokens tokens (None: no limit), a token in stop_ids, or a token the model's
    context has no room left to run (that token is still returned). With a `mask`
    (shared/token_mask.TokenMask) only the tokens its grammar allows are sampled.

    A reasoning budget (the prompt left <think> open): after `reasoning_budget` tokens of
    reasoning with no `reasoning_end[0]` (</think>) among them, the tokens of `reasoning_end`
    come next instead of sampled ones, so the reasoning ends as the model ends it itself and
    the answer (a grammar's constrained part) follows."""

    def __init__(self, engine, state, logits: np.ndarray, history, params: SamplingParams, max_tokens: int | None,
                 stop_ids=frozenset(), logprobs: int | None = None, mask=None, reasoning_budget: int | None = None,
                 reasoning_end=()):
        """logprobs: None, or how many most likely tokens to report beside each sampled
        one's log-probability (`last_logprobs` after each sample())."""
        self.engine, self.state, self.logits, self.mask = engine, state, logits, mask
        self.thinking = reasoning_budget is not None and bool(reasoning_end)
        self.budget, self.reasoning_end = reasoning_budget, list(reasoning_end)
        self.forced: list[int] = list(reasoning_end) if self.thinking and reasoning_budget <= 0 else []
        self.logprobs, self.last_logprobs = logprobs, None
        self.history = list(history)
        self.sampler = Sampler(params)
        self.remaining = float("inf") if max_tokens is None else max_tokens
        self.stop_ids = stop_ids
        self.finish_reason: str | None = None if self.remaining > 0 else "length"

    def step(self) -> int:
        token = self.sample()
        if self.finish_reason is None:
            self.logits = self.engine.forward([token], self.state, all_logits=False)[-1]
        return token

    def sample(self) -> int:
        """The next token, without running it: unless that finished the sequence, its
        logits must come next (step() runs it alone; a worker runs several in one pass)."""
        if self.forced:                          # the reasoning's budget is spent: its end, not a sample
            token = self.forced.pop(0)
        else:
            logits = self.logits if self.mask is None else self.mask.apply(self.logits)
            token = self.sampler.sample(logits, self.history)
        if self.thinking:
            if token == self.reasoning_end[0]:
                self.thinking = False
            else:
                self.budget -= 1
                if self.budget <= 0:
                    self.forced = list(self.reasoning_end)
        if self.mask is not None:
            self.mask.consume(token)
        if self.logprobs is not None:
            self.last_logprobs = logprobs_of(self.logits, token, self.logprobs)
        self.history.append(token)
        self.remaining -= 1
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.remaining <= 0 or self.state.room <= 0:
            self.finish_reason = "length"
        return token


def generate(engine, prompt_ids: list[int], max_tokens: int | None, params: SamplingParams,
             stop_ids=frozenset(), state=None, prefill=None, media=None) -> Iterator[int]:
    """Yield up to max_tokens sampled tokens (None: until the context is full); stops after a token in stop_ids. The
    prompt runs on `prefill` (another engine: the GPU's) when given, and is closed
    after it; engine decodes on from the state it leaves. media: the prompt's images and
    M-RoPE positions (shared/vision/prompt.TokenMedia)."""
    if not prompt_ids:
        raise FermoeError("the prompt has no tokens")
    state = state or engine.new_state()
    kw = {"media": media} if media is not None else {}
    if prefill is not None:
        logits = prefill.forward(prompt_ids, state, all_logits=False, **kw)[-1]
        prefill.close()
    else:
        logits = engine.forward(prompt_ids, state, all_logits=False, **kw)[-1]
    decoder = Decoder(engine, state, logits, prompt_ids, params, max_tokens, stop_ids)
    while decoder.finish_reason is None:
        yield decoder.step()
