"""The interface every engine behind `--engine` implements, and the reference one.

Each advances a SequenceState by tokens and returns logits: `reference` is the
numpy spec (here); `cpu` the native W4A8 engine (cpu_worker); `gpu` the GPU
prefill engine (gpu_worker). They share the state's layout, so a state prefilled
by one is decoded on by another. The registry that picks one by name is
fermoe/engines.py (this package imports no worker package)."""
from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import numpy as np

from .errors import FermoeError
from .model import Model
from .state import DEFAULT_KV_DTYPE, SequenceState, kv_dtype


def check_tokens(tokens, n_vocab: int) -> np.ndarray:
    """Token ids as a contiguous int32 array, refused when empty or outside [0, n_vocab)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    if len(tokens) == 0:
        raise FermoeError("no tokens to run")
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise FermoeError(f"token ids must be in [0, {n_vocab})")
    return tokens


@runtime_checkable
class Engine(Protocol):
    """What the workers and the commands call on an engine."""
    name: str
    kv_cache_dtype: str           # the KV dtype of the states new_state() makes
    threads: int                  # the CPU threads it computes with (a GPU engine's: its host thread)
    max_batch: int                # the most tokens one forward_batch segment may hold

    def new_state(self) -> SequenceState:
        """An empty sequence of this engine's model."""

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, media=None) -> np.ndarray:
        """Run `tokens` after the state's position: logits [T, vocab] of every new
        position (or [1, vocab], the last one's); the state moves on by T. media: the
        tokens' images and M-RoPE positions (shared/vision/prompt.TokenMedia), or None
        for text."""

    def forward_batch(self, segments: list[tuple[list[int], SequenceState]]) -> np.ndarray:
        """Several distinct sequences together, each with tokens of its own: the logits of
        each one's last token [n, vocab]; each state moves on by its tokens."""

    def close(self) -> None:
        """Release what the engine holds (threads, device memory)."""


class ReferenceEngine:
    name = "reference"
    threads = 1

    def __init__(self, model: Model, activations_q8: bool = False, kv_cache_dtype: str = DEFAULT_KV_DTYPE):
        self.model = model
        self.max_batch = model.config.n_ctx_train       # numpy takes any length at once
        self.activations_q8 = activations_q8        # round activations like the W4A8 kernels
        kv_dtype(kv_cache_dtype)                    # refuse an unknown name now
        self.kv_cache_dtype = kv_cache_dtype

    def new_state(self) -> SequenceState:
        return SequenceState(self.model.config, self.model.fingerprint, kv_dtype=self.kv_cache_dtype)

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, media=None) -> np.ndarray:
        """Logits [T, vocab] of every new position (or [1, vocab] of the last one);
        the state moves on by len(tokens)."""
        from .reference import ACTIVATIONS_Q8, forward
        token = ACTIVATIONS_Q8.set(self.activations_q8)
        try:
            logits = forward(self.model, tokens, state, media)
            return logits if all_logits else logits[-1:]
        finally:
            ACTIVATIONS_Q8.reset(token)

    def forward_batch(self, segments) -> np.ndarray:
        """Several (tokens, state) or (tokens, state, media) segments: the logits of each
        one's last token [n, vocab]."""
        if not segments or len({id(s[1]) for s in segments}) != len(segments):
            raise FermoeError("forward_batch needs one or more distinct sequences")
        return np.concatenate([self.forward(s[0], s[1], all_logits=False, media=s[2] if len(s) > 2 else None)
                               for s in segments])

    def decode_batch(self, tokens, states) -> np.ndarray:
        """One new token for each of several sequences: their logits [n, vocab]."""
        return self.forward_batch([([t], s) for t, s in zip(tokens, states)])

    def close(self) -> None:
        pass


RATE_WEIGHT = 0.3           # of the newest measurement in a running rate


def update_rate(old: float, new: float) -> float:
    """A running average of a rate or a time: the newest measurement weighs RATE_WEIGHT (0: none yet)."""
    return new if old <= 0 else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * new


def measure_prefill_rate(engine: Engine, cfg, sizes, budget_s: float = float("inf")) -> tuple[float, float, int]:
    """(prefill tokens/s, fixed seconds a prompt costs whatever its length, the largest
    size timed): each size in turn, timed after one untimed run (the first compiles,
    uploads or faults in what later ones reuse), the next only while its time,
    extrapolated, stays under budget_s and it fits the engine's memory; with two sizes
    or more, a line through the times. What a worker announces in its Hello, for the
    coordinator to place prompts by; a GPU engine's runs also leave its memory planned,
    and its host copies packed, for prompts up to the last size."""
    points = []                                     # (tokens, seconds)
    for n in sizes:
        n = min(n, cfg.n_ctx_train)
        if n <= 0 or (points and points[-1][1] * n / points[-1][0] > budget_s):
            break
        tokens = [t % cfg.n_vocab for t in range(1, n + 1)]
        try:
            engine.forward(tokens, engine.new_state(), all_logits=False)
        except FermoeError:
            if not points:
                raise
            break                                   # larger than its memory holds: what the smaller ones gave
        t0 = time.perf_counter()
        engine.forward(tokens, engine.new_state(), all_logits=False)
        points.append((n, time.perf_counter() - t0))
    if not points:
        return 0.0, 0.0, 0
    if len(points) == 1:
        return points[0][0] / points[0][1], 0.0, points[0][0]
    per_token, fixed = np.polyfit([n for n, _ in points], [t for _, t in points], 1)
    if per_token <= 0:                              # noise: no slope to speak of
        n, t = points[-1]
        return n / t, 0.0, n
    return float(1.0 / per_token), max(0.0, float(fixed)), points[-1][0]
