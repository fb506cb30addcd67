"""Where a prefill's results land on the host: page-locked memory, so the GPU copies
them while later layers still compute (each GDN layer's S and conv state after its last
pass, each attention layer's new K and V after every pass), and the host only moves
them into the state at the end.

A state made by the engine's new_state() has a page-locked recurrent buffer: the copies
land in it. Another state's (a snapshot slot, the CPU engine's) land in a staging state
first. K and V land in page-locked staging rows of the state's KV dtype (fp16 for an
f16 cache: its pages then take them as they are)."""
from __future__ import annotations

import weakref

import numpy as np

from shared.config import ModelConfig
from shared.state import SequenceState, kv_dtype, recurrent_nbytes


class Landing:
    def __init__(self, device, cfg: ModelConfig, fingerprint: str, kv_cache_dtype: str):
        self.device, self.cfg, self.fingerprint = device, cfg, fingerprint
        self.kv_dtype = kv_dtype(kv_cache_dtype)
        self._pinned = weakref.WeakValueDictionary()   # id -> page-locked recurrent buffer made here
        self._staging: SequenceState | None = None
        self._kv: list[tuple[np.ndarray, np.ndarray]] = []

    def pinned_state(self, state: SequenceState) -> SequenceState:
        """A copy of `state`'s recurrent part in page-locked memory (its KV cache empty);
        the layout's bytes only, should the state live in a larger slot."""
        nbytes = recurrent_nbytes(self.cfg)
        buf = self.device.pagelocked_empty((nbytes,), np.uint8)
        buf[:] = np.frombuffer(state.buffer, np.uint8, count=nbytes)
        self._pinned[id(buf)] = buf
        return SequenceState(self.cfg, self.fingerprint, buffer=buf, kv_block=state.kv.block,
                             kv_dtype=state.kv.dtype_name)

    def begin(self, state: SequenceState, start: int, T: int) -> None:
        """Land a prefill of T tokens from position `start` for `state`: `out` receives the
        recurrent state, `kv[a]` the prompt's K and V rows of attention layer a."""
        if self._pinned.get(id(state.buffer)) is state.buffer:
            self.out = state
        else:
            if self._staging is None:
                self._staging = self.pinned_state(SequenceState(self.cfg, self.fingerprint))
            self.out = self._staging
        if not self._kv or len(self._kv[0][0]) < T:      # grown as needed, doubling
            rows = max(T, 2 * len(self._kv[0][0]) if self._kv else T)
            shape = (rows, self.cfg.n_head_kv, self.cfg.head_dim)
            self._kv = [(self.device.pagelocked_empty(shape, self.kv_dtype),
                         self.device.pagelocked_empty(shape, self.kv_dtype)) for _ in self.cfg.attention_layers]
        self.kv, self.start = self._kv, start

    def finish(self, state: SequenceState, T: int) -> None:
        """The copies have landed (the caller synchronised): into the state."""
        if self.out is not state:
            state.ssm[:] = self.out.ssm
            state.conv[:] = self.out.conv
        for a, (keys, values) in enumerate(self.kv):
            state.kv.append(a, keys[:T], values[:T])
        state.position = self.start + T

    def finish_snapshots(self, snaps: dict[int, SequenceState], state: SequenceState,
                         logits: dict[int, np.ndarray]) -> None:
        """Each snapshot's KV is the state's first `position` rows (a layer's pages joined
        once for all of them); its recurrent part has landed."""
        for a in range(len(self.cfg.attention_layers) if snaps else 0):
            keys, values = state.kv.view(a)
            for position, snap in snaps.items():
                snap.kv.append(a, keys[:position], values[:position])
        for position, snap in snaps.items():
            snap.position = position
            snap.set_logits(logits[position])
