"""The calibration pass of `fermoe prune`: per layer and expert, how often the router
chose it and its REAP saliency (Router-weighted Expert Activation Pruning, arXiv
2510.13999):

    S_j = mean over the tokens x whose top-k includes j of  g_j(x) * ||f_j(x)||_2

g_j(x) is j's router weight after the top-k renormalisation, f_j(x) the expert's output
vector (before that weight is applied).

What runs: the numpy reference forward (shared/reference.py), because it is the engine
that computes each expert's output as a vector of its own; the native C engine fuses
the routed sum and never exposes one. reference.moe() hands every expert's outputs to
an observer (reference.MOE_OBSERVER), which keeps two numbers per expert: the pass is
the reference's own MoE, not a second implementation of it. The text is cut into
windows of `ctx` tokens, each run from an empty state and without the LM head; after
each layer of a window its dequantised weights are dropped (Layer.release), so the
pass holds one layer's float32 weights (experts one at a time where a layer's
experts are large) and one window's activations in that layer, whatever the model's
size, at the price of dequantising every layer again for every window.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import FermoeError
from shared.model import Model
from shared.reference import MOE_OBSERVER, block
from shared.state import SequenceState


@dataclass
class ExpertStats:
    """Sums over the calibration tokens, per [layer, expert]."""
    weighted_norm: np.ndarray        # float64: sum of g_j(x) * ||f_j(x)||_2 over x routed to j
    count: np.ndarray                # int64: tokens whose top-k included j (the frequency)
    tokens: int

    @classmethod
    def empty(cls, n_layer: int, n_expert: int) -> "ExpertStats":
        return cls(np.zeros((n_layer, n_expert)), np.zeros((n_layer, n_expert), np.int64), 0)

    def observe(self, layer: int, expert: int, weights: np.ndarray, out: np.ndarray) -> None:
        """reference.moe's observer: the tokens routed to `expert` in `layer`."""
        norms = np.sqrt(np.einsum("td,td->t", out, out, dtype=np.float64))
        self.weighted_norm[layer, expert] += float(np.dot(weights.astype(np.float64), norms))
        self.count[layer, expert] += len(weights)

    @property
    def saliency(self) -> np.ndarray:
        """REAP's S_j; NaN for an expert no token was routed to."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.weighted_norm / np.maximum(self.count, 1), np.nan)

    def unseen(self) -> dict[int, list[int]]:
        """{layer: experts never routed a token}, layers with none left out."""
        return {int(layer): np.flatnonzero(row == 0).tolist() for layer, row in enumerate(self.count)
                if (row == 0).any()}


def calibration_windows(tokens, ctx: int) -> list[np.ndarray]:
    """Consecutive windows of ctx tokens; the last may be shorter. Every token counts."""
    tokens = np.asarray(tokens, np.int64)
    if ctx < 1:
        raise FermoeError(f"--ctx {ctx}: must be at least 1")
    if len(tokens) == 0:
        raise FermoeError("the calibration text has no tokens")
    return [tokens[i:i + ctx] for i in range(0, len(tokens), ctx)]


def expert_stats(model: Model, tokens, ctx: int = 512, progress: bool = True) -> ExpertStats:
    """Run the calibration tokens through every layer, window by window, observing the MoE."""
    from tqdm import tqdm

    cfg = model.config
    stats = ExpertStats.empty(cfg.n_layer, cfg.n_expert)
    ws = calibration_windows(tokens, ctx)
    token = MOE_OBSERVER.set(stats.observe)
    try:
        with tqdm(total=len(ws) * cfg.n_layer, desc="calibrating", unit="layer", disable=not progress) as bar:
            for w in ws:
                state = SequenceState(cfg, model.fingerprint, kv_dtype="f32")
                state.check_room(len(w))
                h = model.token_embd.take(w)
                for layer in model.layers:
                    h = block(layer, h, cfg, state)
                    layer.release()
                    bar.update()
                stats.tokens += len(w)
    finally:
        MOE_OBSERVER.reset(token)
    return stats
