"""Engines behind `--engine`: each advances a SequenceState by tokens and returns
logits. `reference` is the numpy spec; `cpu` the native W4A8 engine; the GPU
engine plugs in here under the same interface."""
from __future__ import annotations

import numpy as np

from .errors import FermoeError
from .model import Model
from .state import DEFAULT_KV_DTYPE, SequenceState, kv_dtype

ENGINES = ("reference", "cpu")


class ReferenceEngine:
    name = "reference"

    def __init__(self, model: Model, activations_q8: bool = False, kv_cache_dtype: str = DEFAULT_KV_DTYPE):
        self.model = model
        self.activations_q8 = activations_q8        # round activations like the W4A8 kernels
        kv_dtype(kv_cache_dtype)                    # refuse an unknown name now
        self.kv_cache_dtype = kv_cache_dtype

    def new_state(self) -> SequenceState:
        return SequenceState(self.model.config, self.model.fingerprint, kv_dtype=self.kv_cache_dtype)

    def forward(self, tokens, state: SequenceState, all_logits: bool = True) -> np.ndarray:
        """Logits [T, vocab] of every new position (or [1, vocab] of the last one);
        the state moves on by len(tokens)."""
        from .reference import ACTIVATIONS_Q8, forward
        token = ACTIVATIONS_Q8.set(self.activations_q8)
        try:
            logits = forward(self.model, tokens, state)
            return logits if all_logits else logits[-1:]
        finally:
            ACTIVATIONS_Q8.reset(token)

    def forward_batch(self, segments) -> np.ndarray:
        """Several (tokens, state) segments: the logits of each one's last token [n, vocab]."""
        return np.concatenate([self.forward(tokens, state, all_logits=False) for tokens, state in segments])

    def decode_batch(self, tokens, states) -> np.ndarray:
        """One new token for each of several sequences: their logits [n, vocab]."""
        return self.forward_batch([([t], s) for t, s in zip(tokens, states)])


def load_engine(name: str, model: Model, threads: int | None = None, cpus: list[int] | None = None,
                kv_cache_dtype: str = DEFAULT_KV_DTYPE):
    """An engine whose new states keep their KV cache in `kv_cache_dtype` (f16, f32)."""
    if name == "reference":
        return ReferenceEngine(model, kv_cache_dtype=kv_cache_dtype)
    if name == "cpu":
        from cpu_worker.native_engine import NativeEngine
        return NativeEngine(model, threads=threads, cpus=cpus, kv_cache_dtype=kv_cache_dtype)
    raise FermoeError(f"--engine {name!r}: not available; choose one of {', '.join(ENGINES)}")
