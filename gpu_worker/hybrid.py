"""GPU-assisted decode (the hybrid): each decode step's dense part on the GPU, its routed
experts on the CPU.

A decode token reads about two thirds of its weight bytes in the dense part (attention,
the Gated DeltaNet, the shared expert, the router, the LM head) and one third in the 8
routed experts a layer picks. The GPU worker holds the dense weights for prefill anyway
and reads them from its own memory in far less time than a CPU can, so here a step runs
the GPU engine's own pass (engine.py) over one token a sequence with its MoE blocks
split: at each layer the GPU computes the block's normalised input, the router's choice
and the shared expert; the input rows and the chosen experts go down to the host, the
CPU's W4A8 kernels compute the experts' weighted sum (`routed`: in this process, or a CPU
worker across shared/exchange.py's mailbox), and the sum comes back up to be added.

A sequence's recurrent state and KV live on the device while it decodes here (a Lane of
its own, outside the prefill's), so a step moves only the per-layer rows: 2 x T x n_embd
floats and T x k choices. The host SequenceState's position and logits follow each step;
its recurrent part and KV are brought level by sync() or release().

    hybrid = HybridEngine(gpu_engine, routed)      # routed(layer, x, ids, weights) -> [T, D]
    logits = hybrid.forward([token], state)        # admits the state (one upload), then steps
    hybrid.release(state)                          # the state back on the host, whole
"""
from __future__ import annotations

import logging
import time
import types

import numpy as np

from shared.errors import FermoeError
from shared.state import SequenceState

from .batch import Lane, PrefillJob, logit_rows, segment_of
from .buffers import DeviceArray

log = logging.getLogger("fermoe.hybrid")
KV_ROUND = 256          # a resident sequence's KV rows grow in steps of this (and double)
MAX_ROWS = 64           # tokens of one step, all sequences together
HOT_WINDOW = 256        # tokens between choices of the hot experts


class HotExperts:
    """The experts a streamed layer routes to most, kept in VRAM and run on the GPU.

    Each layer's routing is counted over the steps (halved at every refresh, so the counts
    follow the last few windows); every `window` tokens the `per_layer` most counted experts
    of each layer the prefill streams are copied into a VRAM buffer of that layer's own. A
    step's choices of them run on the GPU (the engine's grouped expert kernels, over a map
    that sends every other expert to slot 0 with weight 0); the rest go to the CPU."""

    def __init__(self, gpu, per_layer: int, window: int):
        cfg = gpu.cfg
        self.gpu, self.per_layer, self.window = gpu, per_layer, window
        self.counts = np.zeros((cfg.n_layer, cfg.n_expert))
        self.mask: dict[int, np.ndarray] = {}                 # layer -> its hot experts, [E] bool
        self.slots: dict[int, tuple[DeviceArray, DeviceArray]] = {}    # layer -> (experts, map)
        self.tokens = 0
        self.refreshes = 0

    def observe(self, layer: int, ids: np.ndarray) -> None:
        np.add.at(self.counts[layer], ids.ravel(), 1)

    def step_done(self, tokens: int) -> None:
        self.tokens += tokens
        if self.tokens >= self.window:
            self.refresh()

    def refresh(self) -> None:
        """The most counted experts of every streamed layer into VRAM (a layer whose set is
        unchanged is not copied again)."""
        store, E = self.gpu.experts, self.gpu.cfg.n_expert
        for L in range(self.gpu.cfg.n_layer):
            host = store.host.get(L)
            if L in store.resident or host is None or not self.counts[L].any():
                self._drop(L)
                continue
            ranked = np.argsort(-self.counts[L], kind="stable")[:self.per_layer]
            hot = np.sort(ranked[self.counts[L][ranked] > 0])
            mask = np.zeros(E, bool)
            mask[hot] = True
            if L in self.mask and np.array_equal(mask, self.mask[L]):
                continue
            self._drop(L)
            size = store.layouts[L].expert_bytes
            buf = DeviceArray(self.gpu.device, (max(len(hot), 1) * size,), np.uint8)
            for i, e in enumerate(hot):
                self.gpu.device.memcpy_htod(int(buf) + i * size, host[e * size:(e + 1) * size])
            slot_map = np.zeros(E, np.int32)
            slot_map[hot] = np.arange(len(hot), dtype=np.int32)
            self.slots[L] = (buf, DeviceArray.of(self.gpu.device, slot_map))
            self.mask[L] = mask
            self.gpu.outside_plan += buf.nbytes
        self.counts *= 0.5
        self.tokens = 0
        self.refreshes += 1

    def _drop(self, L: int) -> None:
        if L in self.slots:
            buf, slot_map = self.slots.pop(L)
            self.gpu.outside_plan -= buf.nbytes
            buf.free()
            slot_map.free()
        self.mask.pop(L, None)

    def free(self) -> None:
        for L in list(self.slots):
            self._drop(L)


class HybridRouting:
    """One step's MoE hand-over, layer by layer: send() takes the normalised rows and the
    chosen experts down to page-locked host buffers and starts the CPU on them; receive()
    waits for the experts' weighted sum and queues its copy up. Between the two the GPU
    runs the shared expert.

    routed: a callable (layer, x [T, D], ids [T, k] int32, weights [T, k]) -> [T, D]
    float32, or an object with submit(same) and collect() -> [T, D] (a CPU worker across
    a mailbox: it computes while the GPU goes on). gpu_experts: the layers whose experts
    the prefill keeps resident in VRAM run them there, with no hand-over."""

    def __init__(self, device, stream, routed, rows: int, d: int, k: int, gpu_experts: bool = True,
                 hot: HotExperts | None = None):
        self.device, self.stream, self.routed, self.gpu_experts, self.hot = device, stream, routed, gpu_experts, hot
        self._submit = getattr(routed, "submit", None)      # a peer that computes while the GPU goes on
        self.x = device.pagelocked_empty((rows, d), np.float32)
        self.ids = device.pagelocked_empty((rows, k), np.int32)
        self.weights = device.pagelocked_empty((rows, k), np.float32)
        self.gpu_weights = device.pagelocked_empty((rows, k), np.float32)    # the hot experts' share
        self.out = device.pagelocked_empty((rows, d), np.float32)
        # the combine's view of a sum: one "expert" a token, weight 1, its own row
        self.sum_groups = types.SimpleNamespace(topk_w=DeviceArray.of(device, np.ones(rows, np.float32)),
                                                pair_pos=DeviceArray.of(device, np.arange(rows, dtype=np.int32)))
        self._n, self._result = 0, None
        self.seconds = {"down": 0.0, "experts": 0.0, "up": 0.0}     # host-side waits, summed
        self.hops = self.on_gpu_choices = 0     # hand-overs; choices of hot experts run on the GPU

    def send(self, layer: int, x: DeviceArray, ids: DeviceArray, weights: DeviceArray):
        """Returns the layer's hot experts on the device (their buffer and map) when some of
        the choices are theirs: `weights` then holds those choices' weights alone (the
        others 0), for the GPU's share; the CPU gets the rest."""
        n = self._n = x.shape[0]
        t0 = time.perf_counter()
        for host, dev in ((self.x, x), (self.ids, ids), (self.weights, weights)):
            self.device.memcpy_dtoh_async(host[:n], int(dev), self.stream)
        self.stream.synchronize()
        t1 = time.perf_counter()
        on_gpu = None
        if self.hot is not None:
            self.hot.observe(layer, self.ids[:n])
            mask = self.hot.mask.get(layer)
            if mask is not None and mask[self.ids[:n]].any():
                chosen = mask[self.ids[:n]]
                self.gpu_weights[:n] = np.where(chosen, self.weights[:n], 0.0)
                self.weights[:n] = np.where(chosen, 0.0, self.weights[:n])
                weights.upload(self.gpu_weights[:n], self.stream)
                on_gpu = self.hot.slots[layer]
                self.on_gpu_choices += int(chosen.sum())
        args = (layer, self.x[:n], self.ids[:n], self.weights[:n])
        if self._submit is not None:
            self._submit(*args)
            self._result = None
        else:
            self._result = self.routed(*args)
        self.seconds["down"] += t1 - t0
        self.seconds["experts"] += time.perf_counter() - t1
        self.hops += 1
        return on_gpu

    def receive(self, dst: DeviceArray) -> DeviceArray:
        n = self._n
        t0 = time.perf_counter()
        result = self._result if self._result is not None else self.routed.collect()
        t1 = time.perf_counter()
        if result.shape != (n, self.x.shape[1]):
            raise FermoeError(f"the routed experts returned {result.shape} for {n} rows of {self.x.shape[1]}")
        self.out[:n] = result
        dst.upload(self.out[:n], self.stream)       # from page-locked memory: asynchronous
        self.seconds["experts"] += t1 - t0
        self.seconds["up"] += time.perf_counter() - t1
        return dst

    def free(self) -> None:
        for buf in vars(self.sum_groups).values():
            buf.free()
        if self.hot is not None:
            self.hot.free()


class Resident:
    """A sequence decoding on the device: its lane, and how many of its KV rows the host
    state holds (those before it came, and those sync() brought down)."""

    def __init__(self, state: SequenceState, lane: Lane, host_rows: int):
        self.state, self.lane, self.host_rows = state, lane, host_rows
        self.since_sync: list[int] = []     # the tokens stepped since the host copy was level


class HybridEngine:
    """The Engine interface (shared/engine.py) over a GPUEngine whose MoE blocks' routed
    experts run on the CPU. States given to forward() stay resident on the device until
    release(); close() releases every one."""
    name = "hybrid"
    threads = 1

    def __init__(self, gpu, routed, max_batch: int = MAX_ROWS, gpu_experts: bool = True, hot_experts: int = 0,
                 hot_window: int = HOT_WINDOW):
        """gpu_experts: the expert layers resident in VRAM (as many as the prefill's memory
        plan keeps there) run on the GPU; False sends every layer's to `routed` (the ablation).
        hot_experts: keep that many of each streamed layer's most routed experts (counted over
        windows of hot_window tokens) in VRAM too, and run their choices on the GPU."""
        cfg = gpu.cfg
        self.gpu, self.cfg, self.max_batch = gpu, cfg, max_batch
        self.kv_cache_dtype = gpu.kv_cache_dtype
        hot = HotExperts(gpu, hot_experts, hot_window) if hot_experts > 0 else None
        self.routing = HybridRouting(gpu.device, gpu.ops.stream, routed, max_batch, cfg.n_embd, cfg.n_expert_used,
                                     gpu_experts, hot)
        self._resident: dict[int, Resident] = {}

    def new_state(self) -> SequenceState:
        return self.gpu.new_state()

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, media=None) -> np.ndarray:
        """A step; or, for more tokens than a step takes (or images), a prefill on the GPU
        engine with its experts streamed, after which the state steps here again."""
        if len(tokens) > self.max_batch or media is not None:
            self.release(state)
            return self.gpu.forward(tokens, state, all_logits=all_logits, media=media)
        return self._step([(tokens, state)], all_logits)

    def forward_batch(self, segments) -> np.ndarray:
        if not segments or len({id(s[1]) for s in segments}) != len(segments):
            raise FermoeError("forward_batch needs one or more distinct sequences")
        if any(len(s) > 2 and s[2] is not None for s in segments):
            raise FermoeError("the hybrid decode takes text: images are prefilled")
        return self._step([(s[0], s[1]) for s in segments], all_logits=False)

    def decode_batch(self, tokens, states: list[SequenceState]) -> np.ndarray:
        if len(tokens) != len(states):
            raise FermoeError("decode_batch needs one token for each of distinct sequences")
        return self.forward_batch([(tokens[i:i + 1], s) for i, s in enumerate(states)])

    # ---- residency ---------------------------------------------------------------------
    @property
    def gpu_expert_layers(self) -> list[int]:
        """The MoE layers a step runs wholly on the GPU (their experts resident in VRAM)."""
        return sorted(self.gpu.experts.resident) if self.routing.gpu_experts else []

    def resident(self, state: SequenceState) -> bool:
        return id(state) in self._resident

    def sync(self, state: SequenceState) -> None:
        """Bring the host state level with its device copy: recurrent state, conv, KV rows."""
        res = self._resident.get(id(state))
        if res is None:
            return
        cfg, lane = self.cfg, res.lane
        self.gpu.device.synchronize()
        for g, L in enumerate(cfg.gdn_layers):
            state.ssm[g][...] = lane.S[L].download()
            state.conv[g][...] = lane.conv[L].download()
        for a in range(len(cfg.attention_layers)):
            keys = lane.Kc[a].rows(res.host_rows, state.position).download()
            values = lane.Vc[a].rows(res.host_rows, state.position).download()
            state.kv.append(a, keys, values)
        res.host_rows, res.since_sync = state.position, []

    def release(self, state: SequenceState) -> None:
        """The state back on the host, whole; its device memory freed."""
        if id(state) not in self._resident:
            return
        self.sync(state)
        res = self._resident.pop(id(state))
        self._account(res.lane, -1)
        res.lane.free()

    def abandon(self, state: SequenceState) -> list[int]:
        """Give a sequence up after a failed step (its CPU peer or the device lost): the host
        state goes back to where it was last level with the device, and the tokens stepped
        since are returned, for another engine to run again from there. The device copy,
        which a failed step may have left half a layer stack ahead, is dropped."""
        res = self._resident.pop(id(state), None)
        if res is None:
            return []
        state.position = res.host_rows
        try:
            self._account(res.lane, -1)
            res.lane.free()
        except Exception as e:          # a lost device: its memory went with it
            log.warning("freeing an abandoned sequence's device memory: %s", e)
        return res.since_sync

    def close(self) -> None:
        for res in list(self._resident.values()):
            self.release(res.state)
        self.routing.free()

    def _admit(self, state: SequenceState, T: int) -> Resident:
        res = self._resident.get(id(state))
        if res is None:
            if state.kv.dtype_name != self.kv_cache_dtype:
                raise FermoeError(f"the state keeps its KV in {state.kv.dtype_name}; the hybrid decode runs "
                                  f"--kv-cache-dtype {self.kv_cache_dtype}")
            lane = Lane(self.gpu.device, self.cfg)
            lane.alloc_kv(self._rows_for(state.position + T), len(self.cfg.attention_layers))
            self._account(lane, +1)
            self.gpu._upload_state(state, lane)
            res = self._resident[id(state)] = Resident(state, lane, state.position)
        elif state.position + T > res.lane.positions:
            self._grow(res, state.position + T)
        return res

    def _rows_for(self, positions: int) -> int:
        return min(self.cfg.n_ctx_train, -(-positions // KV_ROUND) * KV_ROUND)

    def _grow(self, res: Resident, positions: int) -> None:
        """More KV rows on the device: the filled ones copied over."""
        old, cfg = res.lane, self.cfg
        new = Lane(self.gpu.device, cfg)
        new.S, new.conv = old.S, old.conv
        new.alloc_kv(self._rows_for(max(positions, 2 * old.positions)), len(cfg.attention_layers))
        filled = res.state.position
        for src, dst in zip(old.Kc + old.Vc, new.Kc + new.Vc):
            self.gpu.device.memcpy_dtod_async(int(dst), int(src), src.rows(0, filled).nbytes, self.gpu.ops.stream)
        self.gpu.device.synchronize()
        self._account(old, -1)
        old.free_kv()
        self._account(new, +1)
        res.lane = new

    def _account(self, lane: Lane, sign: int) -> None:
        """The prefill's memory plan leaves room for the resident lanes."""
        nbytes = sum(buf.nbytes for buf in [*lane.S.values(), *lane.conv.values(), *lane.Kc, *lane.Vc]
                     if buf is not None)
        self.gpu.outside_plan += sign * nbytes

    # ---- a step ------------------------------------------------------------------------
    def _step(self, segments, all_logits: bool) -> np.ndarray:
        gpu = self.gpu
        total = sum(len(tokens) for tokens, _ in segments)
        if total > self.max_batch:
            raise FermoeError(f"a hybrid step of {total} tokens: at most {self.max_batch}")
        prompts, offset = [], 0
        for tokens, state in segments:
            p = gpu._admit(PrefillJob(tokens, state), offset)
            p.lane = self._admit(state, len(p.tokens)).lane
            prompts.append(p)
            offset += len(p.tokens)
        if gpu.ws is None or gpu.ws.T < total or gpu.ws.n_chunks < len(prompts):
            # each sequence's rows are a GDN chunk of their own; the prefill lanes' KV stays small
            gpu._fit(total, [total], [p.offset for p in prompts[1:]])
        segs = [segment_of(p, 0, total) for p in prompts]
        rows = logit_rows(segs, all_logits)
        logits = gpu._pass(np.concatenate([p.tokens for p in prompts]), segs, list(rows), routed=self.routing)
        for p in prompts:
            p.state.position = p.start + len(p.tokens)
            self._resident[id(p.state)].since_sync.extend(int(t) for t in p.tokens)
        if self.routing.hot is not None:
            self.routing.hot.step_done(total)
        out = []
        for r, (p, position) in zip(logits, rows.values()):
            if position == p.start + len(p.tokens):
                p.state.set_logits(r)
            out.append(r)
        return np.stack(out)


class HybridWithFallback:
    """The hybrid engine with a CPU engine behind it: when a step fails (its CPU peer or the
    device lost), the sequence goes back to its last level point and runs again on `cpu`,
    and every later step of every sequence runs there."""
    name = "hybrid"

    def __init__(self, hybrid: HybridEngine, cpu):
        self.hybrid, self.cpu = hybrid, cpu
        self.threads, self.max_batch = cpu.threads, hybrid.max_batch
        self.kv_cache_dtype = hybrid.kv_cache_dtype
        self.failure: str | None = None         # why the hybrid was given up, once it was

    def new_state(self) -> SequenceState:
        return self.hybrid.new_state()

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, media=None) -> np.ndarray:
        if self.failure is None:
            try:
                return self.hybrid.forward(tokens, state, all_logits=all_logits, media=media)
            except Exception as e:       # a CUDA error is pycuda's own type, not a FermoeError
                self.failure = f"{type(e).__name__}: {e}"
                log.warning("the hybrid decode failed (%s): decoding on the CPU from here", self.failure)
        replay = self.hybrid.abandon(state)
        kw = {"media": media} if media is not None else {}
        out = self.cpu.forward(replay + [int(t) for t in tokens], state, all_logits=all_logits, **kw)
        return out[len(replay):] if all_logits else out

    def forward_batch(self, segments) -> np.ndarray:
        if self.failure is None:
            try:
                return self.hybrid.forward_batch(segments)
            except Exception as e:
                self.failure = f"{type(e).__name__}: {e}"
                log.warning("the hybrid decode failed (%s): decoding on the CPU from here", self.failure)
        return self.cpu.forward_batch([(self.hybrid.abandon(s[1]) + [int(t) for t in s[0]], *s[1:])
                                       for s in segments])

    def decode_batch(self, tokens, states: list[SequenceState]) -> np.ndarray:
        if len(tokens) != len(states):
            raise FermoeError("decode_batch needs one token for each of distinct sequences")
        return self.forward_batch([(tokens[i:i + 1], s) for i, s in enumerate(states)])

    def close(self) -> None:
        try:
            self.hybrid.close()
        finally:
            self.cpu.close()
