"""Every layer's routed experts in one shared-memory segment: the one copy of them in
host RAM that a daemon's workers share.

Without it a daemon with a GPU worker holds the experts twice: the CPU workers read
them from the mapped GGUF (its page cache) and the GPU worker streams them from a
page-locked copy of its own. With it the coordinator packs them once into this
segment, the GPU worker registers the segment page-locked and streams from it, and
the CPU workers map it read-only and point their expert matrices into it; the GGUF's
expert pages are then read only while packing.

The layout is the GPU engine's: per layer, one record per expert, [gate | up | down]
as stored in the file (a layer is one slot of a SnapshotArena, so it starts 64-byte
aligned). A CPU worker reads expert e's gate at layer + e * record, its up at
+ gate_bytes, its down at + gate_bytes + up_bytes: the same matrices, one record apart
instead of one matrix apart (fm_tensor.mat_stride).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from .errors import FermoeError
from .ggml_types import GGMLType, tensor_nbytes
from .shm_arena import SnapshotArena

log = logging.getLogger("fermoe.experts")

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# the types both engines compute with as stored: the CPU's W4A8/W8A8/F32 kernels and the
# GPU's tiles read these bytes unchanged (others are converted, so a worker's copy differs)
SHARED_TYPES = {GGMLType.F32, GGMLType.Q4_0, GGMLType.Q8_0}


@dataclass(frozen=True)
class RecordLayout:
    """Where an expert's matrices sit in its [gate | up | down] record."""
    gate_bytes: int
    up_bytes: int
    down_bytes: int

    @property
    def record_bytes(self) -> int:
        return self.gate_bytes + self.up_bytes + self.down_bytes

    def offset(self, name: str) -> int:
        """Of the matrix `name` (one of EXPERT_TENSORS) in a record."""
        return {"ffn_gate_exps": 0, "ffn_up_exps": self.gate_bytes,
                "ffn_down_exps": self.gate_bytes + self.up_bytes}[name]

    @classmethod
    def of(cls, layer) -> "RecordLayout":
        return cls(*(tensor_nbytes(w.qtype, w.shape[1:]) for w in (getattr(layer, n) for n in EXPERT_TENSORS)))


def pack_layer(layer, out: np.ndarray) -> None:
    """Write a layer's experts into `out` as consecutive [gate | up | down] records."""
    lay = RecordLayout.of(layer)
    mats = [getattr(layer, name) for name in EXPERT_TENSORS]
    for e in range(mats[0].shape[0]):
        at = e * lay.record_bytes
        for w in mats:
            per = len(w.raw) // w.shape[0]
            out[at:at + per] = w.raw[e * per:(e + 1) * per]
            at += per


def unshareable(model) -> str | None:
    """Why the model's experts cannot go into one segment both engines read, or None."""
    layers = model.layers
    if not layers or not all(hasattr(layer, "ffn_gate_exps") for layer in layers):
        return "not every layer has routed experts"
    types = {getattr(layer, n).qtype for layer in layers for n in EXPERT_TENSORS}
    if not types <= SHARED_TYPES:
        return (f"experts in {'/'.join(sorted(t.name for t in types))}: only "
                f"{'/'.join(sorted(t.name for t in SHARED_TYPES))} are read as stored by both engines")
    if len({RecordLayout.of(layer) for layer in layers}) != 1:
        return "the layers' experts differ in shape or type"
    return None


class ExpertSegment:
    """The packed experts of a model: `create` packs them (the coordinator), `attach`
    maps them (a worker, given the name)."""

    def __init__(self, arena: SnapshotArena, layout: RecordLayout, n_expert: int):
        self.arena, self.layout, self.n_expert = arena, layout, n_expert
        self.name = arena.name

    @staticmethod
    def geometry(model) -> tuple[RecordLayout, int, int]:
        reason = unshareable(model)
        if reason is not None:
            raise FermoeError(f"the experts cannot be shared between workers: {reason}")
        layout = RecordLayout.of(model.layers[0])
        return layout, model.config.n_expert * layout.record_bytes, len(model.layers)

    @classmethod
    def create(cls, model) -> "ExpertSegment":
        """Pack every layer's experts into a new segment. The GGUF's expert pages are
        dropped from the page cache afterwards (they are clean: dropping them only frees
        RAM), so the experts are in RAM once."""
        layout, layer_bytes, n_layers = cls.geometry(model)
        t0 = time.perf_counter()
        arena = SnapshotArena.create(layer_bytes, n_layers, reserve=True)
        try:
            for L, layer in enumerate(model.layers):
                pack_layer(layer, np.frombuffer(arena.slot(L), np.uint8))
        except BaseException:
            arena.close()
            arena.unlink()
            raise
        _drop_from_page_cache(model)
        log.info("experts packed into shared memory %s: %.2f GiB in %.1f s", arena.name,
                 n_layers * layer_bytes / 2**30, time.perf_counter() - t0)
        return cls(arena, layout, model.config.n_expert)

    @classmethod
    def attach(cls, name: str, model) -> "ExpertSegment":
        layout, layer_bytes, n_layers = cls.geometry(model)
        return cls(SnapshotArena.attach(name, layer_bytes, n_layers), layout, model.config.n_expert)

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def memory(self) -> np.ndarray:
        """The whole mapping (page-aligned at its start), for registering it page-locked."""
        return np.frombuffer(self.arena.memory(), np.uint8)

    def layer(self, L: int) -> np.ndarray:
        """Layer L's records, [n_expert * record_bytes] bytes."""
        return np.frombuffer(self.arena.slot(L), np.uint8)

    def matrix(self, L: int, name: str) -> tuple[np.ndarray, int]:
        """(the bytes from layer L's first `name` matrix on, the stride from one expert's
        to the next): what a CPU engine points its 3-D expert tensor at."""
        return self.layer(L)[self.layout.offset(name):], self.layout.record_bytes

    def close(self) -> None:
        self.arena.close()

    def unlink(self) -> None:
        self.arena.unlink()


def expert_nbytes(model) -> int:
    """Bytes of the routed experts in the file (what a worker's own page-locked copy takes)."""
    return sum(len(getattr(layer, n).raw) for layer in model.layers for n in EXPERT_TENSORS
               if hasattr(layer, n))


def expert_tensor_names(model) -> tuple[str, ...]:
    return tuple(getattr(layer, n).name for layer in model.layers for n in EXPERT_TENSORS)


def _drop_from_page_cache(model) -> None:
    try:
        model.file.forget(expert_tensor_names(model))
    except (OSError, ValueError):
        pass                                # only RAM is at stake: the segment is complete
