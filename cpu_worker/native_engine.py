"""The native CPU engine (`--engine cpu`): binds a loaded Model to the C forward.

The C structs get pointers into the memory-mapped GGUF (no weight is copied,
except small vectors and F16/BF16 matrices, which become F32) and into the
SequenceState's own buffers, so a state moves between the reference and this
engine, or between processes, as it is.
"""
from __future__ import annotations

import os

import numpy as np

from shared.engine import check_tokens
from shared.errors import FermoeError
from shared.expert_segment import EXPERT_TENSORS, expert_tensor_names
from shared.ggml_types import GGMLType, row_nbytes
from shared.model import Model, Weight
from shared.reference import mrope_streams, text_positions
from shared.state import DEFAULT_KV_DTYPE, SequenceState, kv_dtype

from shared.topology import default_cpus
from shared.vision.prompt import media_for

COMPUTE_TYPES = {GGMLType.F32, GGMLType.Q4_0, GGMLType.Q8_0}
MAX_BATCH = 256         # tokens per native call: scratch grows with it (~60 MB at 256 for the
                        # full-size model); longer passes read each weight once for more tokens
_KV_TYPES = {"f16": GGMLType.F16, "f32": GGMLType.F32}   # fm_seq.kv_type


def _native():
    try:
        from native import ffi, lib
    except ImportError as e:
        raise FermoeError(f"the native extension is not built ({e}); run: python3 -m pip install -e .") from None
    return ffi, lib


class NativeEngine:
    name = "cpu"

    def __init__(self, model: Model, threads: int | None = None, cpus: list[int] | None = None,
                 max_batch: int = MAX_BATCH, kv_cache_dtype: str = DEFAULT_KV_DTYPE, experts=None):
        """experts: an ExpertSegment holding the routed experts (a daemon's one copy, shared
        with its GPU worker); the file's own are then never read."""
        self.ffi, self.lib = _native()
        self.model, self.experts = model, experts
        self.max_batch = max_batch
        kv_dtype(kv_cache_dtype)                # refuse an unknown name now
        self.kv_cache_dtype = kv_cache_dtype    # of new states; any state's own is honoured
        cpus = list(cpus) if cpus is not None else default_cpus()
        threads = threads or len(cpus)
        if threads < 1:
            raise FermoeError(f"--threads {threads}: must be at least 1")
        if threads > os.cpu_count():    # pinned spinning threads sharing CPUs would crawl, not run
            raise FermoeError(f"--threads {threads}: more than the {os.cpu_count()} CPUs of this machine")
        cpus = (cpus * threads)[:threads]
        self._keep = []                      # arrays the C structs point into
        # no page faults in the first tokens' steps
        model.file.populate(skip=expert_tensor_names(model) if experts is not None else ())
        self._model = self._bind_model()
        self._pool = self.lib.fm_pool_create(threads, self.ffi.new("int[]", cpus))
        self._ctx = self.lib.fm_ctx_create(self._model, self._pool, max_batch)
        if self._pool == self.ffi.NULL or self._ctx == self.ffi.NULL:
            raise FermoeError("could not create the native thread pool or scratch memory")
        self.threads, self.cpus = threads, cpus
        self._moe_layers = frozenset(i for i, layer in enumerate(model.layers)
                                     if getattr(layer, "ffn_gate_exps", None) is not None)

    @property
    def isa(self) -> str:
        """The kernel set in use (FERMOE_ISA or the best this CPU runs)."""
        return self.ffi.string(self.lib.fm_isa_name(self.lib.fm_get_isa())).decode()

    PHASES = ("gdn", "attention", "moe", "lm_head", "other")

    def phase_seconds(self, reset: bool = False) -> dict[str, float]:
        """Seconds the C forward spent per phase since creation or the last reset."""
        out = self.ffi.new("double[]", len(self.PHASES))
        self.lib.fm_ctx_times(self._ctx, out, int(reset))
        return dict(zip(self.PHASES, out))

    def region_stats(self, enable: bool | None = None, reset: bool = False) -> dict[str, float]:
        """The thread pool's parallel regions since the last reset (counted only while
        enabled): how many, their seconds (also by phase of the forward, as
        phase_seconds names them), and the share of the threads' time in them spent
        inside tasks (the rest waits at a region's start or end)."""
        if enable is not None:
            self.lib.fm_pool_stats_enable(self._pool, int(enable))
        regions, seconds, busy = self.ffi.new("int64_t *"), self.ffi.new("double *"), self.ffi.new("double *")
        self.lib.fm_pool_stats(self._pool, regions, seconds, busy, int(reset))
        by_phase = self.ffi.new("double[]", len(self.PHASES))
        self.lib.fm_ctx_region_times(self._ctx, by_phase, int(reset))
        return {"regions": regions[0], "seconds": seconds[0],
                "busy_fraction": busy[0] / (self.threads * seconds[0]) if seconds[0] else 0.0,
                "seconds_by_phase": dict(zip(self.PHASES, by_phase))}

    def read_bandwidth(self, megabytes: int = 1024, reps: int = 5, weights: bool = False) -> float:
        """Bytes/s this engine's pinned threads read from a fresh buffer far larger than
        the caches, or with `weights` from the first `megabytes` of the mapped weights
        themselves: a file's 4 KB pages can read slower than an anonymous buffer's huge
        ones."""
        buf = self.model.file.data(megabytes << 20) if weights else np.ones(megabytes << 20, np.uint8)
        gbps = self.lib.fm_pool_read_gbps(self._pool, self.ffi.from_buffer(buf), buf.nbytes, reps)
        return gbps * 1e9

    def region_overhead(self, reps: int = 2000) -> float:
        """Seconds a parallel region of empty tasks takes on this engine's pool (the
        mean of `reps`): what each of a token's regions costs before any work."""
        return self.lib.fm_pool_region_overhead_seconds(self._pool, reps)

    def experts_per_moe_block(self, reset: bool = False) -> float:
        """Mean distinct experts each MoE block ran since creation or the last reset."""
        calls, experts = self.ffi.new("int64_t *"), self.ffi.new("int64_t *")
        self.lib.fm_ctx_moe_stats(self._ctx, calls, experts, int(reset))
        return experts[0] / calls[0] if calls[0] else 0.0

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self.lib.fm_ctx_destroy(self._ctx)
            self.lib.fm_pool_destroy(self._pool)
            self._ctx = self._pool = None

    __del__ = close

    # ---- binding ---------------------------------------------------------
    def _bind_model(self):
        cfg, m = self.model.config, self.model
        if cfg.ssm_conv_kernel > self.lib.FM_MAX_CONV_KERNEL:
            raise FermoeError(f"ssm.conv_kernel {cfg.ssm_conv_kernel}: the native engine supports up to "
                              f"{self.lib.FM_MAX_CONV_KERNEL}")
        fm = self.ffi.new("fm_model *")
        for field in ("n_layer", "n_embd", "n_vocab", "n_head", "n_head_kv", "head_dim", "rope_dim",
                      "ssm_conv_kernel", "ssm_k_heads", "ssm_v_heads", "ssm_head_k_dim", "ssm_head_v_dim",
                      "n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp"):
            setattr(fm, field, getattr(cfg, field))
        fm.rms_eps, fm.rope_theta, fm.v_heads_tiled = cfg.rms_eps, cfg.rope_theta, cfg.v_heads_tiled
        self._tensor(fm.token_embd, m.token_embd)
        self._tensor(fm.output_norm, m.output_norm)
        self._tensor(fm.output, m.output)
        layers = self.ffi.new("fm_layer[]", cfg.n_layer)
        self._keep.append(layers)
        fm.layers = layers
        gdn, attn = {l: i for i, l in enumerate(cfg.gdn_layers)}, {l: i for i, l in enumerate(cfg.attention_layers)}
        for i, layer in enumerate(m.layers):
            dst = layers[i]
            dst.is_attention = layer.kind == "attention"
            dst.gdn_slot, dst.attn_slot = gdn.get(i, -1), attn.get(i, -1)
            for name, value in vars(layer).items():
                if isinstance(value, Weight) and self.experts is not None and name in EXPERT_TENSORS:
                    self._tensor(getattr(dst, name), value, self.experts.matrix(i, name))
                elif isinstance(value, Weight):
                    self._tensor(getattr(dst, name), value)
        self._keep.append(fm)
        return fm

    def _tensor(self, dst, w: Weight, packed: tuple[np.ndarray, int] | None = None) -> None:
        """Point an fm_tensor at a weight, in a type the kernels compute with; `packed`:
        (its bytes, the stride between its experts) elsewhere than the file."""
        raw, qtype = w.raw, w.qtype
        if len(w.shape) == 1 or qtype not in COMPUTE_TYPES:
            raw, qtype = np.ascontiguousarray(w.f32()).view(np.uint8).reshape(-1), GGMLType.F32
        shape = w.shape if len(w.shape) > 1 else (1, w.shape[0])
        stride = row_nbytes(qtype, shape[-1]) * shape[-2]
        if packed is not None:
            raw, stride = packed
        self._keep.append(raw)
        dst.data = self.ffi.cast("void *", self.ffi.from_buffer(raw))
        dst.type = int(qtype)
        dst.rows, dst.cols = shape[-2], shape[-1]
        dst.mat_stride = stride

    # ---- running ---------------------------------------------------------
    def new_state(self) -> SequenceState:
        return SequenceState(self.model.config, self.model.fingerprint, kv_dtype=self.kv_cache_dtype)

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, media=None) -> np.ndarray:
        """Logits of every new position [T, vocab] (or of the last one, [1, vocab]); media:
        the tokens' images and M-RoPE positions (shared/vision/prompt.TokenMedia)."""
        tokens = check_tokens(tokens, self.model.config.n_vocab)
        state.check_room(len(tokens))
        if media is not None:
            media.check(len(tokens), self.model.config.n_embd)
        out = []
        for start in range(0, len(tokens), self.max_batch):
            chunk = tokens[start:start + self.max_batch]
            part = media.slice(start, start + len(chunk)) if media is not None else None
            last = start + self.max_batch >= len(tokens)
            out.append(self._run([(chunk, state, part)], all_logits, want=all_logits or last))
        logits = out[0] if len(out) == 1 else np.concatenate([o for o in out if o is not None])
        state.set_logits(logits[-1])
        return logits

    def forward_batch(self, segments) -> np.ndarray:
        """Several sequences in one pass, each with tokens of its own (a prompt chunk, or
        the one token it decodes): the logits of each one's last token [n, vocab], bitwise
        what forward(tokens, state, all_logits=False) gives each alone. Each weight is
        read once per pass of at most max_batch tokens for all the sequences in it.
        segments: (tokens, state) or (tokens, state, media) each."""
        if not segments or len({id(s[1]) for s in segments}) != len(segments):
            raise FermoeError("forward_batch needs one or more distinct sequences")
        checked = [(check_tokens(s[0], self.model.config.n_vocab), s[1], s[2] if len(s) > 2 else None)
                   for s in segments]
        for tokens, state, media in checked:
            state.check_room(len(tokens))
            if media is not None:
                media.check(len(tokens), self.model.config.n_embd)
        if max(len(t) for t, _, _ in checked) > self.max_batch:
            raise FermoeError(f"a segment of forward_batch holds more than {self.max_batch} tokens")
        out, group, size = [], [], 0
        for seg in checked + [None]:
            if seg is None or size + len(seg[0]) > self.max_batch:
                out.append(self._run(group, all_logits=False, want=True))
                group, size = [], 0
            if seg is not None:
                group.append(seg)
                size += len(seg[0])
        logits = out[0] if len(out) == 1 else np.concatenate(out)
        for (_, state, _), row in zip(checked, logits):
            state.set_logits(row)
        return logits

    def decode_batch(self, tokens, states: list[SequenceState]) -> np.ndarray:
        """One new token for each of several sequences: forward_batch of one-token segments."""
        if len(tokens) != len(states):
            raise FermoeError("decode_batch needs one token for each of distinct sequences")
        return self.forward_batch([(tokens[i:i + 1], s) for i, s in enumerate(states)])

    def routed_experts(self, layer: int, x, ids, weights, out: np.ndarray | None = None) -> np.ndarray:
        """The routed experts of MoE layer `layer` for T tokens [T, n_embd]: each token's
        sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), computed as the forward's MoE block
        computes it (no router, no shared expert). x: [T, n_embd] the block's normalised
        input; ids, weights: [T, n_expert_used]; T at most max_batch. out: where to write
        (a contiguous float32 [T, n_embd]), else a new array. A hybrid decode step calls
        this once a layer, so the checks are the cheap ones; the C side checks the ids."""
        x, T = self._moe_input(layer, x)
        shape = (T, self.model.config.n_expert_used)
        ids, weights = np.ascontiguousarray(ids), np.ascontiguousarray(weights, np.float32)
        if ids.shape != shape or weights.shape != shape or ids.dtype.kind not in "iu":
            raise FermoeError(f"routed experts: ids {list(ids.shape)} ({ids.dtype}) and weights "
                              f"{list(weights.shape)}: each must be {list(shape)}, the ids integers")
        if ids.dtype != np.int32:           # a wider id may not fit int32: checked here, not in C
            self._check_ids(ids)
            ids = ids.astype(np.int32)
        out = self._moe_output(out, T)
        ffi = self.ffi
        rc = self.lib.fm_routed_experts(self._ctx, layer, T, ffi.from_buffer("float[]", x),
                                        ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", weights),
                                        ffi.from_buffer("float[]", out))
        if rc != 0:
            self._check_ids(ids)
            raise FermoeError(f"native routed experts refused layer {layer}, {T} tokens")
        return out

    def _check_ids(self, ids: np.ndarray) -> None:
        n = self.model.config.n_expert
        bad = ids[(ids < 0) | (ids >= n)]
        if bad.size:
            raise FermoeError(f"routed experts: expert id {int(bad[0])}: the model has experts 0..{n - 1}")

    def moe_block(self, layer: int, x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The whole MoE block of `layer` (router, routed and shared experts) for T tokens of
        normalised input x [T, n_embd], as the forward adds it to the residual: (its output
        [T, n_embd], the experts it chose [T, k], their weights [T, k])."""
        x, T = self._moe_input(layer, x)
        k, ffi = self.model.config.n_expert_used, self.ffi
        out, ids, weights = self._moe_output(None, T), np.empty((T, k), np.int32), np.empty((T, k), np.float32)
        rc = self.lib.fm_moe_rows(self._ctx, layer, T, ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", out),
                                  ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", weights))
        if rc != 0:
            raise FermoeError(f"native MoE block refused layer {layer}, {T} tokens")
        return out, ids, weights

    def _moe_input(self, layer, x) -> tuple[np.ndarray, int]:
        """x as the C side reads it, and T; a FermoeError for a layer without experts or a
        shape the context has no room for."""
        if layer not in self._moe_layers or not isinstance(layer, (int, np.integer)):
            n = self.model.config.n_layer
            raise FermoeError(f"layer {layer!r} has no routed experts" if isinstance(layer, (int, np.integer))
                              and 0 <= layer < n else f"layer {layer!r}: the model has layers 0..{n - 1}")
        x = np.ascontiguousarray(x, np.float32)
        D = self.model.config.n_embd
        if x.ndim != 2 or x.shape[1] != D or not 1 <= x.shape[0] <= self.max_batch:
            raise FermoeError(f"MoE input of shape {list(x.shape)}: must be [T, {D}], T in "
                              f"1..{self.max_batch} (the engine's max_batch)")
        return x, x.shape[0]

    def _moe_output(self, out, T: int) -> np.ndarray:
        D = self.model.config.n_embd
        if out is None:
            return np.empty((T, D), np.float32)
        if out.shape != (T, D) or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
            raise FermoeError(f"routed experts: out must be a writable contiguous float32 [{T}, {D}]")
        return out

    def _run(self, segments, all_logits: bool, want: bool):
        """One native pass over segments (tokens, state, media or None), at most max_batch
        tokens in all; logits [T, vocab] (all_logits) or [segments, vocab]. `want` False
        skips the LM head (a prompt chunk before the last)."""
        ffi = self.ffi
        seqs = ffi.new("fm_seq[]", len(segments))
        keep = []
        media = [media_for(state, len(tokens), m) for tokens, state, m in segments]
        for seq, (tokens, state, _) in zip(seqs, segments):
            end = state.position + len(tokens)
            state.kv.reserve(end)
            k_table, v_table = state.kv.page_tables()
            keep += [k_table, v_table]
            seq.ssm = ffi.cast("float *", ffi.from_buffer(state.ssm))
            seq.conv = ffi.cast("float *", ffi.from_buffer(state.conv))
            seq.k_pages = ffi.cast("void *const *", ffi.from_buffer(k_table))
            seq.v_pages = ffi.cast("void *const *", ffi.from_buffer(v_table))
            seq.max_pages, seq.block, seq.position = k_table.shape[1], state.kv.block, state.position
            seq.kv_type = _KV_TYPES[state.kv.dtype_name]
        pointers = ffi.new("fm_seq *[]", [seqs + i for i in range(len(segments))])
        counts = np.array([len(s[0]) for s in segments], np.int32)
        tokens = np.ascontiguousarray(np.concatenate([s[0] for s in segments]), dtype=np.int32)
        rows = len(tokens) if all_logits else len(segments)
        logits = np.empty((rows, self.model.config.n_vocab), np.float32) if want else None
        out = ffi.cast("float *", ffi.from_buffer(logits)) if want else ffi.NULL
        inputs = self._inputs(segments, media, keep) if any(m is not None for m in media) else ffi.NULL
        rc = self.lib.fm_forward_inputs(self._ctx, pointers, ffi.cast("int32_t *", ffi.from_buffer(counts)),
                                        len(segments), ffi.cast("int32_t *", ffi.from_buffer(tokens)), inputs,
                                        out, int(all_logits))
        if rc != 0:
            raise FermoeError("native forward refused its input")
        for (tokens_i, state, _), m in zip(segments, media):
            end = state.position + len(tokens_i)
            state.position = end
            state.kv.filled_to(end)
            if m is not None:
                state.rope_delta = m.next_position() - end
        return logits

    def _inputs(self, segments, media, keep):
        """The fm_inputs of a pass where some sequence has images or runs after one: every
        token's (t, h, w) position (text ones from their sequence's), the image rows."""
        ffi, cfg = self.ffi, self.model.config
        pos, rows, embeds, n = [], [], [], 0
        for (tokens, state, _), m in zip(segments, media):
            row = np.full(len(tokens), -1, np.int32)
            if m is None:
                pos.append(text_positions(state.position, len(tokens)))
            else:
                pos.append(m.positions)
                row[m.rows] = n + np.arange(len(m.rows), dtype=np.int32)
                embeds.append(m.embeds)
                n += len(m.rows)
            rows.append(row)
        arrays = [np.ascontiguousarray(np.concatenate(pos), np.int64), np.concatenate(rows),
                  np.ascontiguousarray(np.concatenate(embeds) if n else np.zeros((1, cfg.n_embd)), np.float32),
                  mrope_streams(cfg.rope_dim, cfg.rope_sections)]
        keep += arrays
        inputs = ffi.new("fm_inputs *")
        inputs.rope_pos = ffi.cast("int64_t *", ffi.from_buffer(arrays[0]))
        inputs.embd_row = ffi.cast("int32_t *", ffi.from_buffer(arrays[1]))
        inputs.embd = ffi.cast("float *", ffi.from_buffer(arrays[2]))
        inputs.rope_stream = ffi.cast("int32_t *", ffi.from_buffer(arrays[3]))
        keep.append(inputs)
        return inputs
