"""Where each layer's routed experts come from during a pass.

Resident layers stay in VRAM across requests. The others live in host memory,
page-locked once (interleaved over the NUMA nodes where there are several), one
contiguous [E x (gate | up | down)] record a layer, and stream through a ring of
slots on their own copy stream:

    copy stream:     wait free[s]  -> copy layer L+1 into slot s -> record loaded[s]
    compute stream:  ... router L+1 ... wait loaded[s] -> experts of L+1 -> record free[s]

so layer L+1 crosses PCIe while layer L computes, and the host never waits inside
the layer loop. With few tokens (`used_only`), a layer's routing is read back first
and only the experts it uses are copied, one copy each.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np

from shared.errors import FermoeError
from shared.model import Model

from .buffers import DeviceArray
from .weights import ExpertLayout, pack_experts

log = logging.getLogger("fermoe.gpu")


def resident_order(n_layers: int) -> list[int]:
    """Layers in the order they are kept resident: the van der Corput sequence over the
    layers (0, 1/2, 1/4, 3/4, ... of the way down), so every prefix is spread evenly
    and a budget one layer smaller drops one layer, not a new set."""
    order, i = [], 0
    while len(order) < n_layers:
        v, f, k = 0.0, 0.5, i
        while k:
            v, k, f = v + f * (k & 1), k >> 1, f / 2
        layer = int(v * n_layers)
        if layer not in order:
            order.append(layer)
        i += 1
    return order


def spread_resident(n_layers: int, n_resident: int) -> list[int]:
    """Which layers stay resident when n_resident of them can: spread between the
    streamed ones, so a streamed layer's copy has resident layers' compute to hide under."""
    return sorted(resident_order(n_layers)[:max(0, n_resident)])


@contextlib.contextmanager
def _interleaved_memory():
    """Allocate (and first-touch) memory interleaved over every NUMA node, if there are several."""
    try:
        from numa import info, memory
        nodes = list(range(info.get_max_node() + 1))
    except (ImportError, OSError, AttributeError):
        nodes = [0]
    if len(nodes) < 2:
        yield
        return
    memory.set_interleave_nodes(*nodes)
    try:
        yield
    finally:
        memory.set_local_alloc()


class ExpertStore:
    def __init__(self, device, model: Model, ring_slots: int, pinned: bool = True, segment=None):
        """segment: an ExpertSegment holding every layer packed (a daemon's one copy, shared
        with its CPU workers): registered page-locked, streamed from as it is."""
        cfg = model.config
        self.device, self.model, self.pinned, self.ring_slots = device, model, pinned, ring_slots
        self.layouts = [ExpertLayout.of(layer) for layer in model.layers]
        self.layer_bytes = cfg.n_expert * self.layouts[0].expert_bytes
        if any(lay.expert_bytes != self.layouts[0].expert_bytes for lay in self.layouts):
            raise FermoeError("the GPU engine needs every layer's experts in one layout (types and sizes)")
        self.n_layers = cfg.n_layer
        self.identity = DeviceArray.of(device, np.arange(cfg.n_expert, dtype=np.int32))
        self.resident: dict[int, DeviceArray] = {}
        self.host: dict[int, np.ndarray] = {}        # streamed layers' experts in host memory
        self.ring: list[DeviceArray] = []
        self.loaded, self.free = [], []
        self.compact_map = DeviceArray(device, (cfg.n_expert,), np.int32)
        self.staging = device.pagelocked_empty((cfg.n_expert,), np.int32)
        self.copied_bytes = 0                  # host-to-device expert bytes since creation
        self.segment, self._registration = segment, None
        if segment is not None:
            self._registration = self._register(segment) if pinned else None

    def _register(self, segment):
        """Page-lock the shared segment for the copy stream; where the driver refuses, it is
        streamed from as pageable memory (slower copies, still one copy in RAM)."""
        try:
            return self.device.register_host_memory(segment.memory())
        except FermoeError as e:
            log.warning("the shared experts stay pageable (%s): their copies to the GPU are slower", e)
            return None

    def close(self) -> None:
        if self._registration is not None:
            self._registration.unregister()
            self._registration = None

    def set_resident(self, layers: list[int]) -> None:
        """Keep exactly `layers` in VRAM; every other layer streams from host memory
        (packed there the first time it streams). VRAM is freed before it is taken."""
        keep = set(layers)
        for L in [L for L in self.resident if L not in keep]:
            self.resident.pop(L).free()
        streamed = [L for L in range(self.n_layers) if L not in keep]
        if not streamed and self.ring:
            for slot in self.ring:
                slot.free()
            self.ring, self.loaded, self.free = [], [], []
        for L in streamed:
            if L not in self.host:
                self.host[L] = self._host_layer(L)
        if streamed and not self.ring:
            self.ring = [DeviceArray(self.device, (self.layer_bytes,), np.uint8) for _ in range(self.ring_slots)]
            self.loaded = [self.device.event() for _ in self.ring]
            self.free = [self.device.event() for _ in self.ring]
        for L in sorted(keep - set(self.resident)):
            self.resident[L] = self._upload_layer(L)

    def _upload_layer(self, L: int) -> DeviceArray:
        if self.segment is not None:
            return DeviceArray.of(self.device, self.segment.layer(L))
        if L in self.host:
            return DeviceArray.of(self.device, self.host[L])
        buf = np.empty(self.layer_bytes, np.uint8)
        pack_experts(self.model.layers[L], buf)
        return DeviceArray.of(self.device, buf)

    def _host_layer(self, L: int) -> np.ndarray:
        if self.segment is not None:
            return self.segment.layer(L)
        with _interleaved_memory():
            buf = self.device.pagelocked_empty((self.layer_bytes,), np.uint8) if self.pinned else \
                np.empty(self.layer_bytes, np.uint8)
            pack_experts(self.model.layers[L], buf)
        return buf

    @property
    def host_bytes(self) -> int:
        """Host memory this store holds experts in (page-locked unless pinned=False); none
        of its own with a shared segment."""
        return 0 if self.segment is not None else len(self.host) * self.layer_bytes

    # ---- one pass ------------------------------------------------------------------
    def begin_pass(self, copy_stream, compute_stream, used_only: bool) -> None:
        """Start streaming a pass: the first ring's worth of streamed layers (whole-layer mode)."""
        self.copy, self.compute, self.used_only = copy_stream, compute_stream, used_only
        self.order = [L for L in range(self.n_layers) if L not in self.resident]
        self.next_copy = 0
        if not used_only:
            while self.next_copy < min(len(self.ring), len(self.order)):
                self._copy_next()

    def _slot_of(self, L: int) -> int:
        return self.order.index(L) % len(self.ring)

    def _copy_next(self) -> None:
        L = self.order[self.next_copy]
        s = self._slot_of(L)
        self.copy.wait_for_event(self.free[s])
        self.device.memcpy_htod_async(int(self.ring[s]), self.host[L], self.copy)
        self.loaded[s].record(self.copy)
        self.next_copy += 1
        self.copied_bytes += self.layer_bytes

    def experts_for(self, L: int, counts=None) -> tuple[DeviceArray, DeviceArray]:
        """The buffer holding layer L's experts and the map expert -> slot in it, ready
        for the compute stream once this returns (it waits for the copy on the device).
        In used-only mode `counts` is the layer's routing (a device array): it is read
        back and only the experts with tokens are copied."""
        if L in self.resident:
            return self.resident[L], self.identity
        s = self._slot_of(L)
        if self.used_only:
            return self._copy_used(L, s, counts)
        self.compute.wait_for_event(self.loaded[s])
        return self.ring[s], self.identity

    def _copy_used(self, L: int, s: int, counts: DeviceArray) -> tuple[DeviceArray, DeviceArray]:
        used = np.flatnonzero(counts.download())      # waits for this layer's routing
        lay = self.layouts[L]
        self.staging[:] = 0
        self.staging[used] = np.arange(len(used), dtype=np.int32)
        self.copy.wait_for_event(self.free[s])
        self.device.memcpy_htod_async(int(self.compact_map), self.staging, self.copy)
        host, dst = self.host[L], int(self.ring[s])
        for i, e in enumerate(used):         # one copy an expert, packed at the slot's start
            src = host[e * lay.expert_bytes:(e + 1) * lay.expert_bytes]
            self.device.memcpy_htod_async(dst + i * lay.expert_bytes, src, self.copy)
        self.copied_bytes += len(used) * lay.expert_bytes
        self.loaded[s].record(self.copy)
        self.compute.wait_for_event(self.loaded[s])
        return self.ring[s], self.compact_map

    def release(self, L: int) -> None:
        """Layer L's experts are consumed (once the compute stream gets here): its slot
        may take the next streamed layer."""
        if L in self.resident:
            return
        self.free[self._slot_of(L)].record(self.compute)
        if not self.used_only and self.next_copy < len(self.order):
            self._copy_next()
