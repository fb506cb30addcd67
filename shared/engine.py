"""Engines behind `--engine`: each advances a SequenceState by tokens and returns
logits. The reference is the numpy spec; the native CPU and GPU engines plug in
here under the same interface."""
from __future__ import annotations

import numpy as np

from .errors import FermoeError
from .model import Model
from .state import SequenceState

ENGINES = ("reference",)


class ReferenceEngine:
    name = "reference"

    def __init__(self, model: Model):
        self.model = model

    def new_state(self) -> SequenceState:
        return SequenceState(self.model.config, self.model.fingerprint)

    def forward(self, tokens, state: SequenceState) -> np.ndarray:
        """Logits [T, vocab] of every new position; the state moves on by len(tokens)."""
        from .reference import forward
        return forward(self.model, tokens, state)


def load_engine(name: str, model: Model):
    if name == "reference":
        return ReferenceEngine(model)
    raise FermoeError(f"--engine {name!r}: not available; choose one of {', '.join(ENGINES)}")
