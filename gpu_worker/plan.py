"""How the GPU engine spends its memory budget (`--gpu-mem`): every figure computed
from the config, so the plan can be printed, tested and checked before anything is
allocated.

    budget = resident weights (all but the routed experts, LM head included)
           + the recurrent state of each sequence of a batch (S and conv of every GDN layer)
           + the workspace of one pass of up to `pass_tokens` tokens
           + the attention KV of the positions the batch's prompts reach
           + a ring of `ring_slots` expert-layer slots (when some layer streams)
           + resident expert layers: as many as the rest holds
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import ModelConfig
from shared.errors import FermoeError
from shared.model import Model
from shared.state import kv_bytes_per_position

from .weights import ExpertLayout, resident_nbytes
from .ops import CHUNK
from .workspace import chunks_of, workspace_nbytes

MARGIN = 64 << 20        # what allocation rounding and the CUDA context's own use may take


def kv_nbytes(cfg: ModelConfig, positions: int) -> int:
    """fp32 K and V of every attention layer for `positions` positions (the cache is
    kept in fp32 on the device, values rounded as the state's dtype rounds them)."""
    return kv_bytes_per_position(cfg, "f32") * positions


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    resident_weights: int
    state: int
    workspace: int
    kv: int
    layer_bytes: int
    ring_slots: int
    resident_layers: int
    n_layers: int
    pass_tokens: int

    @property
    def streamed_layers(self) -> int:
        return self.n_layers - self.resident_layers

    @property
    def ring(self) -> int:
        return self.ring_slots * self.layer_bytes if self.streamed_layers else 0

    @property
    def total(self) -> int:
        return (self.resident_weights + self.state + self.workspace + self.kv + self.ring
                + self.resident_layers * self.layer_bytes)

    def describe(self) -> str:
        mib = 1 << 20
        return (f"GPU memory {self.total / mib:.0f} of {self.budget / mib:.0f} MiB: weights {self.resident_weights / mib:.0f}, "
                f"{self.resident_layers}/{self.n_layers} expert layers resident ({self.layer_bytes / mib:.1f} MiB each), "
                f"ring {self.ring_slots if self.streamed_layers else 0} slots, workspace {self.workspace / mib:.0f} "
                f"({self.pass_tokens}-token passes), KV {self.kv / mib:.0f}, state {self.state / mib:.0f}")


def make_plan(model: Model, budget: int, pass_tokens: int, ring_slots: int = 2,
              max_resident: int | None = None, kv_positions: int | None = None,
              n_chunks: int | None = None, resident_bytes: int | None = None,
              layer_bytes: int | None = None, sequences: int = 1) -> MemoryPlan:
    """The plan for `budget` bytes with passes of up to `pass_tokens` tokens in up to
    `n_chunks` GDN chunks and room for the attention KV of `kv_positions` positions
    (default: one pass), or a FermoeError saying what does not fit. `resident_bytes`
    (resident_nbytes) and `layer_bytes` (an expert layer's) are computed from the
    model unless given: the engine, which plans every prefill, computes them once."""
    cfg = model.config
    if ring_slots < 1:
        raise FermoeError(f"ring of {ring_slots} slots: needs 1 at least")
    if layer_bytes is None:
        layer_bytes = cfg.n_expert * ExpertLayout.of(model.layers[0]).expert_bytes
    if resident_bytes is None:
        resident_bytes = resident_nbytes(model)
    fixed = dict(resident_weights=resident_bytes, state=sequences * cfg.recurrent_state_bytes,
                 workspace=workspace_nbytes(cfg, pass_tokens, n_chunks), kv=kv_nbytes(cfg, kv_positions or pass_tokens))
    base = sum(fixed.values()) + MARGIN
    n = cfg.n_layer
    limit = n if max_resident is None else min(max_resident, n)
    if base + n * layer_bytes <= budget and limit == n:
        resident = n                                  # everything fits: no ring
    else:
        resident = max(0, min(limit, (budget - base - ring_slots * layer_bytes) // layer_bytes))
    plan = MemoryPlan(budget=budget, layer_bytes=layer_bytes, ring_slots=ring_slots, resident_layers=resident,
                      n_layers=n, pass_tokens=pass_tokens, **fixed)
    if plan.total + MARGIN > budget:
        mib = 1 << 20
        raise FermoeError(f"--gpu-mem {budget / mib:.0f} MiB is too small: the resident weights, a ring of "
                          f"{ring_slots} expert layers, {pass_tokens}-token passes and the KV of "
                          f"{kv_positions or pass_tokens} positions need {(plan.total + MARGIN) / mib:.0f} MiB")
    return plan


@dataclass(frozen=True)
class Fit:
    """How a batch runs: passes of `pass_tokens` tokens, in a workspace of `ws_tokens`
    rows cut into up to `n_chunks` GDN chunks, under `plan`."""
    pass_tokens: int
    ws_tokens: int
    n_chunks: int
    plan: MemoryPlan


def fit_passes(model: Model, budget: int, T: int, positions: list[int], boundaries=(), max_pass_tokens=None,
               ring_slots: int = 2, max_resident: int | None = None, resident_bytes: int | None = None,
               layer_bytes: int | None = None) -> Fit:
    """A batch of T tokens whose prompts reach `positions` positions: the fewest passes
    whose activations fit beside the resident weights and each prompt's state and KV (a
    single pass when it fits, so each expert crosses PCIe once); the expert layers kept
    resident are what the budget leaves, fewer for a long prompt and more again after.
    `boundaries`: rows of the batch where GDN chunks are cut. The first error if none fits."""
    error = None
    cap = min(T, max_pass_tokens or T)
    for n in sorted({-(-T // c) for c in range(-(-T // cap), T + 1)}, reverse=True):
        ws_tokens = -(-n // CHUNK) * CHUNK          # buffers in steps of a chunk: less churn
        n_chunks = max(len(chunks_of(min(n, T - a), [b - a for b in boundaries if a < b < a + n])[0])
                       for a in range(0, T, n))
        n_chunks = max(n_chunks, ws_tokens // CHUNK)
        try:
            plan = make_plan(model, budget, ws_tokens, ring_slots, max_resident, kv_positions=sum(positions),
                             n_chunks=n_chunks, resident_bytes=resident_bytes, layer_bytes=layer_bytes,
                             sequences=len(positions))
        except FermoeError as e:
            error = error or e
            continue
        return Fit(n, ws_tokens, n_chunks, plan)
    raise error
