"""Where a prefill's results land on the host: page-locked memory, so the GPU copies
them while later layers still compute (each GDN layer's S and conv state after its last
pass, each attention layer's new K and V after every pass), and the host only moves
them into the state at the end. The engine's layers hand each result over as it is made
(kv(), conv(), ssm()); where it goes is decided here.

A state made by the engine's new_state() has a page-locked recurrent buffer: the copies
land in it. Another state's (the CPU engine's) land in a staging state first. K and V
land in page-locked staging rows of the state's KV dtype (fp16 for an f16 cache: its
pages then take them as they are).

Snapshots' recurrent parts written into state slots (a worker's snapshot arena) land
in the slot itself when the arena was registered page-locked (register()), else in
page-locked buffers kept from one prefill to the next and copied into the slot at the
end; their blocks' K and V go to KV slots of their own (the worker copies them from the
prompt's state)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from shared.config import ModelConfig
from shared.state import HeaderLayout, SequenceState, kv_dtype, recurrent_nbytes

from .batch import Segment
from .buffers import DeviceArray

PAGE = 4096                 # host pages: what cuMemHostRegister locks


@dataclass
class Site:
    """Where one sequence's prefill lands: `out` receives its recurrent state, `kv[a]` the
    new K and V rows of attention layer a, the first of them position `start`'s."""
    out: SequenceState
    kv: list[tuple[np.ndarray, np.ndarray]]
    start: int


class Landing:
    def __init__(self, device, cfg: ModelConfig, fingerprint: str, kv_cache_dtype: str, stream):
        """stream: the compute stream, which every copy of a layer's results goes on."""
        self.device, self.cfg, self.fingerprint, self.stream = device, cfg, fingerprint, stream
        self.kv_dtype = kv_dtype(kv_cache_dtype)
        self._pinned = weakref.WeakValueDictionary()   # id -> page-locked recurrent buffer made here
        self._staging: list[SequenceState] = []        # a page-locked recurrent state per lane
        self._kv: list[tuple[np.ndarray, np.ndarray]] = []    # page-locked K, V rows of a batch, by layer
        self._registered: list[tuple] = []      # (start, end, the device's registration)
        self._pool: list[np.ndarray] = []                             # page-locked buffers for staged snapshots
        self._pool_used = 0                                           # of them, by the batch landing now

    def register(self, memory) -> None:
        """Page-lock host memory (its whole pages), so slot_state() lands snapshots in it."""
        arr = np.frombuffer(memory, np.uint8)
        start = -(-arr.ctypes.data // PAGE) * PAGE
        end = (arr.ctypes.data + arr.nbytes) // PAGE * PAGE
        if end <= start:
            return
        pages = arr[start - arr.ctypes.data:end - arr.ctypes.data]
        self._registered.append((start, end, self.device.register_host_memory(pages)))

    def unregister(self) -> None:
        for _, _, registration in self._registered:
            registration.unregister()
        self._registered = []

    def _pagelocked(self, buf: np.ndarray) -> bool:
        a, b = buf.ctypes.data, buf.ctypes.data + buf.nbytes
        return any(start <= a and b <= end for start, end, _ in self._registered)

    def slot_states(self, state: SequenceState, slots: dict[int, object]) -> dict[int, SequenceState]:
        """For each snapshot position, the state its recurrent part lands in: the slot's own
        bytes if page-locked, else a pooled page-locked buffer (its header `state`'s), one
        the batch begun last has not handed out yet."""
        nbytes = recurrent_nbytes(self.cfg)
        staged = [p for p, slot in slots.items() if not self._pagelocked(np.frombuffer(slot, np.uint8, nbytes))]
        used = self._pool_used                  # the batch's earlier prompts hold those
        while len(self._pool) < used + len(staged):
            self._pool.append(self.device.pagelocked_empty((nbytes,), np.uint8))
        pool = dict(zip(staged, self._pool[used:]))
        self._pool_used += len(staged)
        out = {}
        for p, slot in slots.items():
            buf = pool.get(p)
            if buf is None:
                buf = np.frombuffer(slot, np.uint8, nbytes)
            buf[:HeaderLayout.NBYTES] = np.frombuffer(state.buffer, np.uint8, HeaderLayout.NBYTES)
            out[p] = SequenceState(self.cfg, self.fingerprint, buffer=buf, kv_block=state.kv.block,
                                   kv_dtype=state.kv.dtype_name)
        return out

    def pinned_state(self, state: SequenceState) -> SequenceState:
        """A copy of `state`'s recurrent part in page-locked memory (its KV cache empty);
        the layout's bytes only, should the state live in a larger slot."""
        nbytes = recurrent_nbytes(self.cfg)
        buf = self.device.pagelocked_empty((nbytes,), np.uint8)
        buf[:] = np.frombuffer(state.buffer, np.uint8, count=nbytes)
        self._pinned[id(buf)] = buf
        return SequenceState(self.cfg, self.fingerprint, buffer=buf, kv_block=state.kv.block,
                             kv_dtype=state.kv.dtype_name)

    def begin(self, prompts: list[tuple[SequenceState, int, int]]) -> list[Site]:
        """Land a batch's prefills, each (state, start position, T tokens): a site for each.
        Their K and V rows share one page-locked buffer (grown as needed, doubling); a
        state not made by pinned_state() lands in a page-locked staging state of its lane."""
        total, self._pool_used = sum(T for _, _, T in prompts), 0
        if not self._kv or len(self._kv[0][0]) < total:
            rows = max(total, 2 * len(self._kv[0][0]) if self._kv else total)
            shape = (rows, self.cfg.n_head_kv, self.cfg.head_dim)
            self._kv = [(self.device.pagelocked_empty(shape, self.kv_dtype),
                         self.device.pagelocked_empty(shape, self.kv_dtype)) for _ in self.cfg.attention_layers]
        sites, row = [], 0
        for lane, (state, start, T) in enumerate(prompts):
            if self._pinned.get(id(state.buffer)) is state.buffer:
                out = state
            else:
                while len(self._staging) <= lane:
                    self._staging.append(self.pinned_state(SequenceState(self.cfg, self.fingerprint)))
                out = self._staging[lane]
            sites.append(Site(out, [(k[row:row + T], v[row:row + T]) for k, v in self._kv], start))
            row += T
        return sites

    # ---- what each layer produced ------------------------------------------------------
    # The engine's layers hand over each result as its kernel makes it, and these copy it
    # into its place (the snapshot, the final state, the K and V rows), on the compute
    # stream, in order: the device buffers read (the conv snapshot scratch, the recurrent
    # state between cuts, the fp16 rows) are reused by the next kernel or layer.
    def kv(self, g: Segment, a: int, keys: DeviceArray, values: DeviceArray) -> None:
        """Attention layer a's new K and V rows of segment g (in the state's KV dtype)."""
        site = g.prompt.site
        rows = slice(g.position - site.start, g.position - site.start + g.length)
        to_keys, to_values = site.kv[a]
        self._to_host(to_keys[rows], keys)
        self._to_host(to_values[rows], values)

    def conv(self, g: Segment, layer: int, src: DeviceArray, at: int | None = None) -> None:
        """The conv state of GDN layer `layer` (its index among them) after `at` rows of
        segment g, a cut: its snapshot's; None: after all of them, the prompt's last. A
        hybrid decode's sequence (no site) keeps its state on the device: nothing lands."""
        if g.prompt.site is not None:
            self._to_host(self._recurrent(g, at).conv[layer], src)

    def ssm(self, g: Segment, layer: int, src: DeviceArray, at: int | None = None) -> None:
        """The recurrent state S of GDN layer `layer`, as conv()."""
        if g.prompt.site is not None:
            self._to_host(self._recurrent(g, at).ssm[layer], src)

    @staticmethod
    def _recurrent(g: Segment, at: int | None) -> SequenceState:
        return g.result if at is None else g.snapshot(at)

    def _to_host(self, dst: np.ndarray, src: DeviceArray) -> None:
        """An asynchronous copy into page-locked host memory, in order on the compute stream."""
        assert dst.nbytes == src.nbytes, (dst.shape, src.shape)
        self.device.memcpy_dtoh_async(dst, int(src), self.stream)

    def finish(self, site: Site, state: SequenceState, T: int) -> None:
        """The copies have landed (the caller synchronised): into the state."""
        if site.out is not state:
            state.ssm[:] = site.out.ssm
            state.conv[:] = site.out.conv
        for a, (keys, values) in enumerate(site.kv):
            state.kv.append(a, keys[:T], values[:T])
        state.position = site.start + T

    def finish_slots(self, snaps: dict[int, SequenceState], slots: dict[int, object],
                     logits: dict[int, np.ndarray]) -> None:
        """The copies have landed: each state slot gets its position, logits and recurrent
        part (copied in if it was staged)."""
        nbytes = recurrent_nbytes(self.cfg)
        for p, snap in snaps.items():
            snap.position = p
            snap.set_logits(logits[p])
            dst = np.frombuffer(slots[p], np.uint8, nbytes)
            if snap.buffer.ctypes.data != dst.ctypes.data:
                dst[:] = snap.buffer

    def finish_snapshots(self, snaps: dict[int, SequenceState], state: SequenceState,
                         logits: dict[int, np.ndarray]) -> None:
        """Each snapshot's KV is the state's first `position` rows, copied a page at a time;
        its recurrent part has landed."""
        for position, snap in snaps.items():
            snap.kv.take_prefix(state.kv, position)
            snap.position = position
            snap.set_logits(logits[position])
