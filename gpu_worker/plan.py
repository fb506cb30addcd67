"""How the GPU engine spends its memory budget (`--gpu-mem`): every figure computed
from the config, so the plan can be printed, tested and checked before anything is
allocated.

    budget = resident weights (all but the routed experts, LM head included)
           + the recurrent state of each sequence of a batch (S and conv of every GDN layer)
           + the workspace of one pass of up to `pass_tokens` tokens
           + the attention KV of the positions the batch's prompts reach: every attention
             layer's where it fits; else the first `kv_layers` layers' and one slot that
             the other layers' KV passes through, each in turn, from page-locked host
             memory (a long prompt: 131072 positions are 5 GiB of fp32 KV)
           + a ring of `ring_slots` expert-layer slots (when some layer streams)
           + resident expert layers: as many as the rest holds

When something must give way, resident expert layers go first (they stream instead),
then the passes shrink, and only then does KV leave the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.config import ModelConfig
from shared.errors import FermoeError
from shared.model import Model

from .weights import ExpertLayout, resident_nbytes
from .ops import CHUNK
from .workspace import chunks_of, workspace_nbytes

MARGIN = 64 << 20        # what allocation rounding and the CUDA context's own use may take


def kv_layer_nbytes(cfg: ModelConfig, positions: int) -> int:
    """fp32 K and V of one attention layer for `positions` positions (the cache is kept
    in fp32 on the device, values rounded as the state's dtype rounds them)."""
    return 2 * cfg.n_head_kv * cfg.head_dim * np.dtype(np.float32).itemsize * positions


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    resident_weights: int
    state: int
    workspace: int
    kv_layer_bytes: int         # one attention layer's K and V for every position of the batch
    kv_layers: int              # attention layers whose KV stays on the device
    n_kv_layers: int            # attention layers in all; the others' KV lives in host memory
    layer_bytes: int
    ring_slots: int
    resident_layers: int
    n_layers: int
    pass_tokens: int

    @property
    def streamed_layers(self) -> int:
        return self.n_layers - self.resident_layers

    @property
    def spilled_kv_layers(self) -> int:
        return self.n_kv_layers - self.kv_layers

    @property
    def kv(self) -> int:
        """Device bytes of KV: the layers kept there, and the slot the others pass through."""
        return (self.kv_layers + (self.spilled_kv_layers > 0)) * self.kv_layer_bytes

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
                f"({self.pass_tokens}-token passes), KV {self.kv / mib:.0f} ({self.kv_placement()}), "
                f"state {self.state / mib:.0f}")

    def kv_placement(self) -> str:
        if not self.spilled_kv_layers:
            return f"all {self.n_kv_layers} attention layers on the device"
        return (f"{self.kv_layers} of {self.n_kv_layers} attention layers on the device, {self.spilled_kv_layers} in "
                f"page-locked host memory through a {self.kv_layer_bytes / (1 << 20):.0f} MiB slot")


def make_plan(model: Model, budget: int, pass_tokens: int, ring_slots: int = 2,
              max_resident: int | None = None, kv_positions: int | None = None,
              n_chunks: int | None = None, resident_bytes: int | None = None,
              layer_bytes: int | None = None, sequences: int = 1, kv_spill: bool = False,
              max_kv_layers: int | None = None) -> MemoryPlan:
    """The plan for `budget` bytes with passes of up to `pass_tokens` tokens in up to
    `n_chunks` GDN chunks and room for the attention KV of `kv_positions` positions
    (default: one pass), or a FermoeError saying what does not fit. `kv_spill`: where
    the whole KV does not fit (or more than `max_kv_layers` layers of it would be kept),
    keep as many layers' KV on the device as fit beside a slot for the others'.
    `resident_bytes` (resident_nbytes) and `layer_bytes` (an expert layer's) are
    computed from the model unless given: the engine, which plans every prefill,
    computes them once."""
    cfg = model.config
    if ring_slots < 1:
        raise FermoeError(f"ring of {ring_slots} slots: needs 1 at least")
    if layer_bytes is None:
        layer_bytes = cfg.n_expert * ExpertLayout.of(model.layers[0]).expert_bytes
    if resident_bytes is None:
        resident_bytes = resident_nbytes(model)
    positions = kv_positions or pass_tokens
    n_kv, per_kv = len(cfg.attention_layers), kv_layer_nbytes(cfg, positions)
    fixed = dict(resident_weights=resident_bytes, state=sequences * cfg.recurrent_state_bytes,
                 workspace=workspace_nbytes(cfg, pass_tokens, n_chunks))
    kv_layers = n_kv if max_kv_layers is None else max(0, min(max_kv_layers, n_kv))
    if kv_spill:          # the most layers that fit beside the slot, no expert layer resident
        room = budget - sum(fixed.values()) - 2 * MARGIN - ring_slots * layer_bytes
        if n_kv * per_kv > room:
            kv_layers = min(kv_layers, max(0, room // per_kv - 1))
    elif kv_layers < n_kv:
        raise FermoeError(f"{kv_layers} of {n_kv} attention layers' KV on the device asks for kv_spill")
    base = sum(fixed.values()) + (kv_layers + (kv_layers < n_kv)) * per_kv + MARGIN
    n = cfg.n_layer
    limit = n if max_resident is None else min(max_resident, n)
    if base + n * layer_bytes <= budget and limit == n:
        resident = n                                  # everything fits: no ring
    else:
        resident = max(0, min(limit, (budget - base - ring_slots * layer_bytes) // layer_bytes))
    plan = MemoryPlan(budget=budget, layer_bytes=layer_bytes, ring_slots=ring_slots, resident_layers=resident,
                      n_layers=n, pass_tokens=pass_tokens, kv_layer_bytes=per_kv, kv_layers=kv_layers,
                      n_kv_layers=n_kv, **fixed)
    if plan.total + MARGIN > budget:
        mib = 1 << 20
        kv = "the KV" if not kv_spill else "a slot for one attention layer's KV"
        raise FermoeError(f"--gpu-mem {budget / mib:.0f} MiB is too small: the resident weights, a ring of "
                          f"{ring_slots} expert layers, {pass_tokens}-token passes and {kv} of "
                          f"{positions} positions need {(plan.total + MARGIN) / mib:.0f} MiB")
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
               layer_bytes: int | None = None, max_kv_layers: int | None = None) -> Fit:
    """A batch of T tokens whose prompts reach `positions` positions: the fewest passes
    whose activations fit beside the resident weights and each prompt's state and KV (a
    single pass when it fits, so each expert crosses PCIe once); the expert layers kept
    resident are what the budget leaves, fewer for a long prompt and more again after.
    Where no pass size fits the whole KV (or `max_kv_layers` is below the attention
    layers), the fewest passes that fit with KV layers moved to host memory.
    `boundaries`: rows of the batch where GDN chunks are cut. The first error if none fits."""
    error = None
    cap = min(T, max_pass_tokens or T)
    sizes = sorted({-(-T // c) for c in range(-(-T // cap), T + 1)}, reverse=True)
    cfg = model.config
    spill = max_kv_layers is not None and max_kv_layers < len(cfg.attention_layers)
    if layer_bytes is None:
        layer_bytes = cfg.n_expert * ExpertLayout.of(model.layers[0]).expert_bytes
    if resident_bytes is None:
        resident_bytes = resident_nbytes(model)
    # what the whole KV needs beside the weights, whatever the passes: beyond the budget, only spilling fits
    whole_kv = (resident_bytes + len(positions) * cfg.recurrent_state_bytes + MARGIN + ring_slots * layer_bytes
                + kv_layer_nbytes(cfg, sum(positions)) * len(cfg.attention_layers))
    spill = spill or whole_kv > budget
    for kv_spill, n in [(s, n) for s in ((True,) if spill else (False, True)) for n in sizes]:
        ws_tokens = -(-n // CHUNK) * CHUNK          # buffers in steps of a chunk: less churn
        n_chunks = max(len(chunks_of(min(n, T - a), [b - a for b in boundaries if a < b < a + n])[0])
                       for a in range(0, T, n))
        n_chunks = max(n_chunks, ws_tokens // CHUNK)
        try:
            plan = make_plan(model, budget, ws_tokens, ring_slots, max_resident, kv_positions=sum(positions),
                             n_chunks=n_chunks, resident_bytes=resident_bytes, layer_bytes=layer_bytes,
                             sequences=len(positions), kv_spill=kv_spill, max_kv_layers=max_kv_layers)
        except FermoeError as e:
            error = error or e
            continue
        return Fit(n, ws_tokens, n_chunks, plan)
    raise error
