"""The GPU prefill engine (`--engine gpu`): a prompt through the whole model on the
GPU in as few passes as the memory budget allows, experts streamed from host memory
(experts.py), the sequence state handed back in the layout every engine shares
(shared/state.py), so a CPU engine decodes on from it.

A pass of n tokens at positions [p0, p0 + n), top to bottom as the reference reads:

    h = embed(tokens)
    for each layer:  h += mixer(rmsnorm(h))       gated attention or Gated DeltaNet
                     h += moe(rmsnorm(h))         routed experts + shared expert
    logits = output(rmsnorm(h)) for the rows asked for

Snapshot positions (block boundaries) cut the GDN chunks, so the state there comes
out of the chunked recurrence as it passes; their conv states, KV and logits too.
Several prompts may go through together (prefill_batch, batch.py): the row-wise steps
run over all their rows at once, the mixers over each prompt's rows on its own state.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from shared.engine import check_tokens
from shared.errors import FermoeError
from shared.model import Model
from shared.reference import mrope_angles, rope_angles
from shared.state import DEFAULT_KV_DTYPE, SequenceState, kv_dtype
from shared.vision.prompt import media_for

from .batch import Lane, PrefillJob, Prompt, Segment, logit_rows, segment_of
from .buffers import DeviceArray
from .cuda import open_device
from .experts import ExpertStore, spread_resident
from .kernels import KERNEL_TYPES
from .landing import Landing
from .ops import AttnHeads, GDNHeads, Ops
from .plan import fit_passes
from .weights import ResidentWeights, resident_nbytes
from .workspace import LOGIT_ROWS, Workspace, chunks_of

log = logging.getLogger("fermoe.gpu")
PLAN_TOKENS = 64         # the pass the first plan is made for, before any prompt is seen
RECURRENT_BELOW = 32     # passes this short run the token-sequential GDN kernel ("auto")
GDN_MODES = ("auto", "chunked", "recurrent")
IDLE = "idle"            # the kernel timer's mark at a pass's end: the device waits for the host from there


def expected_used_fraction(n_tokens: int, n_expert: int, k: int) -> float:
    """Share of a layer's experts that n tokens are expected to route to (uniform routing)."""
    return 1.0 - (1.0 - k / n_expert) ** n_tokens


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """[j, k) spans of `rows` whose values are consecutive (rows[j + 1] = rows[j] + 1...)."""
    cuts = [j for j in range(1, len(rows)) if rows[j] != rows[j - 1] + 1]
    return list(zip([0] + cuts, cuts + [len(rows)]))


class PrefillStopped(FermoeError):
    """A prefill ended early because its caller asked (a cancelled request)."""


class GPUEngine:
    name = "gpu"
    threads = 1              # the host thread that feeds the device

    def __init__(self, model: Model, gpu_mem: int | None = None, gpu: int = 0,
                 kv_cache_dtype: str = DEFAULT_KV_DTYPE, max_pass_tokens: int | None = None,
                 ring_slots: int = 2, resident: bool = True, pinned: bool = True, overlap: bool = True,
                 lm_head: str = "gpu", gdn: str = "auto", used_experts: float = 0.8, device=None,
                 shared_experts=None, max_kv_layers: int | None = None):
        kv_dtype(kv_cache_dtype)
        if lm_head not in ("gpu", "cpu") or gdn not in GDN_MODES or (max_pass_tokens or 1) < 1:
            raise FermoeError(f"lm_head {lm_head!r} (gpu or cpu), gdn {gdn!r} ({', '.join(GDN_MODES)}), "
                              f"max_pass_tokens {max_pass_tokens} (>= 1)")
        self.model, self.cfg = model, model.config
        self.max_batch = self.cfg.n_ctx_train        # a prompt of any length: as many passes as it needs
        self.kv_cache_dtype, self.lm_head, self.gdn_mode, self.used_experts = kv_cache_dtype, lm_head, gdn, used_experts
        self._owns_device = device is None
        self.device = device if device is not None else open_device(gpu)
        free, _ = self.device.mem_get_info()
        budget = free if gpu_mem is None else gpu_mem
        if budget > free:
            raise FermoeError(f"--gpu-mem {budget >> 20} MiB: {self.device.name} has {free >> 20} MiB free")
        self.budget, self.max_pass_tokens, self.ring_slots = budget, max_pass_tokens, ring_slots
        self.outside_plan = 0                   # bytes held outside the prefill's plan (a hybrid decode's lanes)
        self.max_resident = None if resident else 0
        self.max_kv_layers = max_kv_layers      # None: every attention layer's KV on the device where it fits
        self.kv_slot: tuple[DeviceArray, DeviceArray] | None = None    # where a spilled layer's K, V pass through
        self.ops = Ops(self.device)
        self.attn_heads, self.gdn_heads = AttnHeads.of(self.cfg), GDNHeads.of(self.cfg)
        self.copy_stream = self.device.stream("copy") if overlap else self.ops.stream
        self.w = ResidentWeights(self.device, model)
        self.experts = ExpertStore(self.device, model, ring_slots, pinned, segment=shared_experts)
        self.resident_bytes = resident_nbytes(model)      # for the plan of every prefill
        self.ws, self.lanes = None, [Lane(self.device, self.cfg)]
        n = min(PLAN_TOKENS, max_pass_tokens or PLAN_TOKENS)
        self._fit(n, [n])
        log.info("%s: %s", self.device.name, self.plan.describe())
        self.profile = None                     # a PhaseTimer, for bench prefill
        self.land = Landing(self.device, self.cfg, model.fingerprint, kv_cache_dtype,    # the results, on the host
                            self.ops.stream)

    def set_kv_cache_dtype(self, name: str) -> None:
        """The KV element type of the states this engine hands over (a worker's snapshot
        slots hold the coordinator's); the device's own KV stays fp32."""
        kv_dtype(name)
        self.kv_cache_dtype = name
        self.land.unregister()
        self.land = Landing(self.device, self.cfg, self.model.fingerprint, name, self.ops.stream)

    # ---- the Engine interface ------------------------------------------------------
    def new_state(self) -> SequenceState:
        """An empty sequence whose recurrent buffer is page-locked: a prefill's state lands
        in it by asynchronous copies while later layers compute."""
        return self.land.pinned_state(SequenceState(self.cfg, self.model.fingerprint, kv_dtype=self.kv_cache_dtype))

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, media=None) -> np.ndarray:
        """Logits of every new position [T, vocab] (or [1, vocab]: the last); the state moves on.
        media: the tokens' images and M-RoPE positions (shared/vision/prompt.TokenMedia)."""
        return self.prefill(tokens, state, all_logits=all_logits, media=media)[0]

    def forward_batch(self, segments) -> np.ndarray:
        """Several sequences prefilled in one batch: the logits of each one's last token.
        segments: (tokens, state) or (tokens, state, media) each."""
        if not segments or len({id(s[1]) for s in segments}) != len(segments):
            raise FermoeError("forward_batch needs one or more distinct sequences")
        results = self.prefill_batch([PrefillJob(s[0], s[1], media=s[2] if len(s) > 2 else None) for s in segments])
        return np.concatenate([logits for logits, _ in results])

    def close(self) -> None:
        """Wait for the device's work; release the CUDA context if this engine opened it."""
        if getattr(self, "device", None) is None:
            return
        self.device.synchronize()
        self.land.unregister()
        self.experts.close()
        if self._owns_device and hasattr(self.device, "close"):
            self.device.close()
        self.device = None

    # ---- prefill ------------------------------------------------------------------------
    def prefill(self, tokens, state: SequenceState, snapshot_at=(), all_logits: bool = False,
                into: dict | None = None, block: int | None = None, should_stop=None, media=None):
        """Run the prompt; returns (logits, {position: SequenceState}) with the states at
        the snapshot positions in (state.position, state.position + len(tokens)].

        into: {position: state slot} instead of snapshot_at: each snapshot's recurrent part
        is written into its state slot (shared/state.py's layout; the caller copies the
        blocks' KV from the state into KV slots of `block` positions).
        should_stop(): asked before each pass after the first; true ends the prefill with
        PrefillStopped once the device is idle (the state and the slots are then unusable).
        media: the tokens' images and M-RoPE positions (TokenMedia)."""
        job = PrefillJob(tokens, state, snapshot_at, into, block, media)
        return self.prefill_batch([job], should_stop, all_logits)[0]

    def prefill_batch(self, jobs: list[PrefillJob], should_stop=None, all_logits: bool = False) -> list[tuple]:
        """Several prompts through the model together: their rows share every pass (the
        expert layers cross PCIe once for all of them), each prompt's recurrence, conv and
        attention on its own state. Returns each job's (logits, snapshots) as prefill()."""
        t0 = time.perf_counter()
        if not jobs:
            raise FermoeError("a prefill of no prompts")
        prompts, offset = [], 0
        for job in jobs:
            prompts.append(self._admit(job, offset))
            offset += len(prompts[-1].tokens)
        total, stream = offset, np.concatenate([p.tokens for p in prompts])
        # the stream is cut where a prompt ends or a snapshot falls: no GDN chunk spans one
        edges = sorted({p.offset + b - p.start for p in prompts for b in p.boundaries}
                       | {p.offset + len(p.tokens) for p in prompts})
        self._fit(total, [p.start + len(p.tokens) for p in prompts], edges)
        sites = self.land.begin([(p.state, p.start, len(p.tokens)) for p in prompts])
        for lane, (p, job) in enumerate(zip(prompts, jobs)):
            p.lane, p.site = self.lanes[lane], sites[lane]
            self._upload_state(p.state, p.lane)
            p.snaps = (self.land.slot_states(p.state, job.into) if job.into is not None
                       else {b: self.land.pinned_state(p.state) for b in p.boundaries})
        for a in range(0, total, self.pass_n):
            if a and should_stop is not None and should_stop():
                self.device.synchronize()
                raise PrefillStopped(f"stopped after {a} of {total} tokens")
            b = min(total, a + self.pass_n)
            segments = [segment_of(p, a, b) for p in prompts if p.offset < b and a < p.offset + len(p.tokens)]
            rows = logit_rows(segments, all_logits)
            logits = self._pass(stream[a:b], segments, list(rows))
            for r, (p, position) in zip(logits, rows.values()):
                p.logits[position] = r
                if all_logits:
                    p.rows.append(r)
        t1 = time.perf_counter()
        self.device.synchronize()              # the states' and the snapshots' asynchronous copies
        t2 = time.perf_counter()
        results = [self._finish(p, job, all_logits) for p, job in zip(prompts, jobs)]
        # host-side seconds: enqueueing (with the passes' own waits), waiting for the device, finishing
        self.last_timing = {"enqueue_s": t1 - t0, "wait_s": t2 - t1, "finish_s": time.perf_counter() - t2}
        return results

    def _admit(self, job: PrefillJob, offset: int) -> Prompt:
        tokens = check_tokens(job.tokens, self.cfg.n_vocab)
        state, T = job.state, len(tokens)
        start = state.position
        state.check_room(T)
        snapshot_at = job.snapshot_at
        if job.into is not None:
            if any(not start < p <= start + T for p in job.into) or not job.block:
                raise FermoeError(f"snapshot slots at {sorted(job.into)} (block {job.block}): each must be in "
                                  f"({start}, {start + T}], with a block size")
            snapshot_at = job.into
        boundaries = sorted({int(p) for p in snapshot_at if start < p <= start + T})
        if job.media is not None:
            job.media.check(T, self.cfg.n_embd)
        # text after an image (a rope delta) runs at positions from the state's own
        return Prompt(tokens, state, start, offset, boundaries, media_for(state, T, job.media))

    def _finish(self, p: Prompt, job: PrefillJob, all_logits: bool) -> tuple:
        """A prompt's results, landed: into its state, its snapshots (or their slots)."""
        T = len(p.tokens)
        end = p.start + T
        self.land.finish(p.site, p.state, T)
        p.state.set_logits(p.logits[end])
        if p.media is not None:             # as the CPU engine: the next position runs behind the length
            p.state.rope_delta = p.media.next_position() - end
            for q, snap in p.snaps.items():
                snap.rope_delta = p.media.slice(0, q - p.start).next_position() - q
        if job.into is not None:
            self.land.finish_slots(p.snaps, job.into, p.logits)
        else:
            self.land.finish_snapshots(p.snaps, p.state, p.logits)
        return (np.stack(p.rows) if all_logits else p.logits[end][None]), p.snaps

    def _mark(self, phase: str) -> None:
        if self.profile is not None:
            self.profile.mark(phase)

    def _pass(self, tokens: np.ndarray, segments: list[Segment], rows: list[int], routed=None) -> np.ndarray:
        """One pass over the rows of `segments` (consecutive, one prompt each); returns the
        logits of the pass rows `rows`. routed: the hybrid decode's routed experts
        (gpu_worker/hybrid.py), computed elsewhere instead of streamed here."""
        cfg, ws, ops, n = self.cfg, self.ws, self.ops, len(tokens)
        chunk_at = self._upload_inputs(segments, n)
        self._mark("embed")
        self._embed(tokens, segments)        # its upload waits for the device: before the first expert copies, not behind them
        if routed is None:
            used_only = expected_used_fraction(n, cfg.n_expert, cfg.n_expert_used) < self.used_experts
            self.experts.begin_pass(self.copy_stream, ops.stream, used_only)
        for L in range(cfg.n_layer):
            w = self.w.layers[L]
            self._mark("norms")
            ops.rmsnorm(ws.x, ws.h, w["attn_norm"].data, n, cfg.n_embd, cfg.rms_eps)
            if cfg.is_attention(L):
                self._attention(L, n, segments)
            else:
                self._gdn(L, n, segments, chunk_at)
            if routed is None or (routed.gpu_experts and L in self.experts.resident):
                self._moe(L, n)             # a hybrid step's layer whose experts are in VRAM anyway: here
            else:
                self._moe_hybrid(L, n, routed)
        self._mark("lm_head")
        logits = self._lm_head(rows)
        self._mark("end")
        if self.ops.k.timer is not None:     # the last kernel ends here, not at the host's next launch
            self.ops.k.timer.mark(IDLE)
        return logits

    # ---- inputs -------------------------------------------------------------------------
    def _upload_inputs(self, segments: list[Segment], n: int) -> dict[int, int]:
        """RoPE's cos and sin of every row's position and the GDN chunk table of the pass
        (cut where a prompt or a snapshot ends); returns the table's index of each chunk by
        its first row. A pass with images, or text after one, turns each frequency pair by
        the (t, h, w) position of its M-RoPE stream (the same angles for text)."""
        cfg, ws = self.cfg, self.ws
        half = cfg.rope_dim // 2
        if all(g.prompt.media is None for g in segments):
            positions = np.concatenate([np.arange(g.position, g.position + g.length) for g in segments])
            angle = rope_angles(positions, cfg.rope_dim, cfg.rope_theta)
        else:
            positions = np.concatenate([g.positions() for g in segments])
            angle = mrope_angles(positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_sections)
        ws.rope_cos.rows(0, n).view((n, half)).upload(np.cos(angle))
        ws.rope_sin.rows(0, n).view((n, half)).upload(np.sin(angle))
        starts, lengths = chunks_of(n, [g.begin + c for g in segments for c in g.cuts] + [g.end for g in segments])
        ws.chunks.set_chunks(starts, lengths)
        return {e: i for i, e in enumerate(starts)}

    def _embed(self, tokens: np.ndarray, segments: list[Segment]) -> None:
        """The prompt's rows of the embedding table, gathered here and dequantised there;
        the rows of image tokens then take the tower's embeddings instead."""
        emb, n, d = self.model.token_embd, len(tokens), self.cfg.n_embd
        uniq, index = np.unique(tokens, return_inverse=True)
        if emb.qtype in KERNEL_TYPES and len(emb.shape) == 2:
            raw, wtype = emb.select_rows(uniq, emb.name).raw, KERNEL_TYPES[emb.qtype]
        else:
            raw, wtype = emb.take(uniq).view(np.uint8), "f32"
        self.ws.embed_raw.view((raw.size,), np.uint8).upload(np.ascontiguousarray(raw).reshape(-1))
        self.ws.tokens.rows(0, n).upload(index.astype(np.int32))
        self.ops.embed(self.ws.h.rows(0, n), self.ws.embed_raw, self.ws.tokens, n, d, wtype)
        for g in segments:
            m = g.media()
            if m is None or not len(m.rows):
                continue
            rows = (g.begin + m.rows).tolist()
            for j, k in _runs(rows):        # an image's tokens are consecutive: one copy each
                # on the compute stream: after the gather, whatever the stream's flags
                self.ws.h.rows(rows[j], rows[k - 1] + 1).upload(m.embeds[j:k], self.ops.stream)

    # ---- mixers ---------------------------------------------------------------------------
    def _attention(self, L: int, n: int, segments: list[Segment]) -> None:
        cfg, ws, ops, w = self.cfg, self.ws, self.ops, self.w.layers[L]
        nh, nkv, hd, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_embd
        qg, q, attn = ws.proj.view((n, 2 * nh * hd)), ws.mix.view((n, nh * hd)), ws.mid.view((n, nh * hd))
        kk, vv = ws.kv_k.rows(0, n), ws.kv_v.rows(0, n)
        self._mark("dense")
        for out, name, width in ((qg, "attn_q", 2 * nh * hd), (kk, "attn_k", nkv * hd), (vv, "attn_v", nkv * hd)):
            ops.gemm(out, ws.x, w[name].data, n, width, d, w[name].wtype)
        a = cfg.attention_layers.index(L)
        self._mark("attention")
        for g in segments:                  # each prompt against its own keys
            s, e = g.begin, g.end
            Kc, Vc = self._keys_values(g, a)
            ops.attn_qk_norm_rope(q.rows(s, e), Kc, Vc, qg.rows(s, e), kk.rows(s, e), vv.rows(s, e),
                                  w["attn_q_norm"].data, w["attn_k_norm"].data, ws.rope_cos.rows(s, e),
                                  ws.rope_sin.rows(s, e), g.position, g.length, self.attn_heads, cfg.rms_eps,
                                  self.kv_cache_dtype == "f16")
            if g.prompt.site is not None:          # a hybrid decode's sequence keeps its KV here
                self._land_kv(g, a, Kc.rows(g.position, g.position + g.length), Vc.rows(g.position, g.position + g.length))
            ops.attn_prompt(attn.rows(s, e), q.rows(s, e), Kc, Vc, qg.rows(s, e), g.position, g.length, self.attn_heads)
        self._mark("dense")
        ops.gemm(ws.h, attn, w["attn_output"].data, n, d, nh * hd, w["attn_output"].wtype, accumulate=True)

    def _land_kv(self, g: Segment, a: int, keys: DeviceArray, values: DeviceArray) -> None:
        """Segment g's new K and V rows of attention layer a to the host, in the state's KV dtype."""
        if self.kv_cache_dtype == "f16":       # fp16 bits: half the bytes, and the state's pages take them as they are
            k16, v16 = self.ws.kv16_k.rows(g.begin, g.end), self.ws.kv16_v.rows(g.begin, g.end)
            self.ops.to_f16(k16, keys)
            self.ops.to_f16(v16, values)
            keys, values = k16, v16
        self.land.kv(g, a, keys, values)

    def _keys_values(self, g: Segment, a: int) -> tuple[DeviceArray, DeviceArray]:
        """Attention layer a's K and V on the device for segment g, rows [0, g.position)
        filled: the lane's own, or the slot with the rows of a layer kept in host memory
        copied in (those before the prefill, then those earlier passes landed)."""
        p = g.prompt
        lane = p.lane
        if lane.Kc[a] is not None:
            return lane.Kc[a], lane.Vc[a]
        rows = (lane.slot_row, lane.slot_row + lane.positions)
        K, V = self.kv_slot[0].rows(*rows), self.kv_slot[1].rows(*rows)
        landed = p.site.kv[a]
        for i, dst in enumerate((K, V)):
            before = lane.prior[a][i] if a in lane.prior else landed[i][:0]
            self._fill(dst, [before, landed[i][:g.position - p.start]])
        return K, V

    def _fill(self, dst: DeviceArray, parts: list[np.ndarray]) -> None:
        """dst's first rows from page-locked host rows, in order on the compute stream (after
        the copies that landed them); fp16 rows through the workspace's fp16 buffer."""
        row, stage = 0, self.ws.kv16_k
        for host in parts:
            for i in range(0, len(host), stage.shape[0]):
                piece = host[i:i + stage.shape[0]]
                m = len(piece)
                if piece.dtype == np.float32:
                    dst.rows(row, row + m).upload(piece, self.ops.stream)
                else:
                    buf = stage.rows(0, m)
                    self.device.memcpy_htod_async(int(buf), piece, self.ops.stream)
                    self.ops.from_f16(dst.rows(row, row + m), buf)
                row += m

    def _gdn(self, L: int, n: int, segments: list[Segment], chunk_at: dict[int, int]) -> None:
        cfg, ws, ops, w = self.cfg, self.ws, self.ops, self.w.layers[L]
        C, Di, d, K = cfg.conv_channels, cfg.ssm_d_inner, cfg.n_embd, cfg.ssm_conv_kernel
        heads = self.gdn_heads
        hv, dv = heads.hv, heads.dv
        qkv, conv, z = ws.proj.view((n, C)), ws.mix.view((n, C)), ws.mid.view((n, Di))
        beta_proj, alpha_proj = ws.beta_proj.rows(0, n), ws.alpha_proj.rows(0, n)
        self._mark("dense")
        for out, name, width in ((qkv, "attn_qkv", C), (z, "attn_gate", Di), (beta_proj, "ssm_beta", hv), (alpha_proj, "ssm_alpha", hv)):
            ops.gemm(out, ws.x, w[name].data, n, width, d, w[name].wtype)
        g_slot, land = cfg.gdn_layers.index(L), self.land
        self._mark("gdn")
        for seg in segments:                # each prompt's convolution continues its own history
            state, x = seg.prompt.lane.conv[L], qkv.rows(seg.begin, seg.end)
            ops.gdn_conv(conv.rows(seg.begin, seg.end), x, state, w["ssm_conv1d"].data, seg.length, C, K)
            for c in seg.cuts:              # the conv state at each snapshot position, then at the end
                ops.gdn_conv_history(ws.conv_snap, state, x, c, seg.length, C, K)
                land.conv(seg, g_slot, ws.conv_snap, at=c)
            ops.gdn_conv_history(state, state, x, seg.length, seg.length, C, K)
            if seg.last:
                land.conv(seg, g_slot, state)
        q, k, beta, g = ws.q.rows(0, n), ws.k.rows(0, n), ws.beta.rows(0, n), ws.g.rows(0, n)
        ops.gdn_qk_gates(q, k, beta, g, conv, beta_proj, alpha_proj, w["ssm_a"].data, w["ssm_dt"].data, n, heads, C,
                         cfg.rms_eps)
        values = 2 * cfg.ssm_key_dim                # the conv output's columns: q, k, then v
        v = conv.block(0, n, values, hv * dv)
        o = ws.o.rows(0, n)
        for seg in segments:                # each prompt's recurrence on its own state
            S = seg.prompt.lane.S[L]
            if self.gdn_mode == "recurrent" or (self.gdn_mode == "auto" and seg.length < RECURRENT_BELOW):
                for s, e in zip([0] + seg.cuts, seg.cuts + [seg.length]):
                    if e > s:
                        r0, r1 = seg.begin + s, seg.begin + e
                        v_se = conv.block(r0, r1 - r0, values, hv * dv)
                        ops.gdn_recurrent(o.rows(r0, r1), S, q.rows(r0, r1), k.rows(r0, r1), v_se,
                                          beta.rows(r0, r1), g.rows(r0, r1), r1 - r0, heads, C)
                    if e in seg.cuts:
                        land.ssm(seg, g_slot, S, at=e)
            else:
                c0, c1 = chunk_at[seg.begin], chunk_at.get(seg.end, len(chunk_at))
                ops.gdn_chunked(o, S, q, k, v, beta, g, ws.chunks.part(c0, c1), c1 - c0, heads, C)
                for c in seg.cuts:          # the state entering the chunk that starts there
                    chunk = chunk_at.get(seg.begin + c)
                    land.ssm(seg, g_slot, S if c == seg.length else ws.chunks.S0.rows(chunk, chunk + 1), at=c)
            if seg.last:
                land.ssm(seg, g_slot, S)
        ops.rmsnorm_gated(o, o, z, w["ssm_norm"].data, n * hv, dv, cfg.rms_eps)
        self._mark("dense")
        ops.gemm(ws.h, o, w["ssm_out"].data, n, d, Di, w["ssm_out"].wtype, accumulate=True)

    # ---- mixture of experts ------------------------------------------------------------------
    def _moe(self, L: int, n: int) -> None:
        cfg, ws, ops = self.cfg, self.ws, self.ops
        d, E, k, ff = cfg.n_embd, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp
        g = self._route(L, n)
        ops.moe_group(g, n, E, k)
        self._mark("copy_wait")
        slot, slot_map = self.experts.experts_for(L, g.counts)
        self._mark("experts")
        lay = self.experts.layouts[L]
        ops.moe_gateup(ws.act, ws.x, slot, slot_map, lay.expert_bytes, g, ff, d, lay.gate_up_type)
        ops.moe_down(ws.moe_out, ws.act, slot, slot_map, lay.expert_bytes, lay.down_offset, g, d, ff, lay.down_type)
        self.experts.release(L)
        self._combine(L, n, ws.moe_out, g, k)

    def _moe_hybrid(self, L: int, n: int, routed) -> None:
        """The MoE block with its routed experts computed by `routed` (a HybridRouting):
        the normalised rows and the chosen experts go down, the experts' weighted sum comes
        back; the shared expert (and the choices of the layer's hot experts) run here meanwhile."""
        cfg, ws, ops = self.cfg, self.ws, self.ops
        g = self._route(L, n)
        hot = routed.send(L, ws.x.rows(0, n), g.topk_ids.rows(0, n), g.topk_w.rows(0, n))
        if hot is not None:         # the choices of the layer's hot experts, here (the others weigh 0)
            slot, slot_map = hot
            d, E, k, ff, lay = cfg.n_embd, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, self.experts.layouts[L]
            ops.moe_group(g, n, E, k)
            ops.moe_gateup(ws.act, ws.x, slot, slot_map, lay.expert_bytes, g, ff, d, lay.gate_up_type)
            ops.moe_down(ws.moe_out, ws.act, slot, slot_map, lay.expert_bytes, lay.down_offset, g, d, ff,
                         lay.down_type)
            ops.moe_combine(ws.h, ws.moe_out, g, None, ws.x, None, n, d, k)
        self._combine(L, n, None, routed.sum_groups, 1, routed)

    def _route(self, L: int, n: int):
        """The block's normalised input (ws.x) and each row's experts and weights (ws.groups)."""
        cfg, ws, ops, w = self.cfg, self.ws, self.ops, self.w.layers[L]
        ops.rmsnorm(ws.x, ws.h, w["post_attention_norm"].data, n, cfg.n_embd, cfg.rms_eps)
        self._mark("dense")
        ops.gemm(ws.router, ws.x, w["ffn_gate_inp"].data, n, cfg.n_expert, cfg.n_embd, w["ffn_gate_inp"].wtype)
        self._mark("experts")
        ws.groups.reset(ops.stream)
        ops.moe_route(ws.groups.topk_ids, ws.groups.topk_w, ws.groups.counts, ws.router, n, cfg.n_expert,
                      cfg.n_expert_used)
        return ws.groups

    def _combine(self, L: int, n: int, y, g, k: int, routed=None) -> None:
        """h += the routed experts' rows y (k a token, weighted as g says) + the gated shared
        expert; with `routed`, y is its sum, taken once the shared expert is queued."""
        cfg, ws, ops, w = self.cfg, self.ws, self.ops, self.w.layers[L]
        d = cfg.n_embd
        shared = None
        if cfg.n_ff_shexp:
            fs, gate_up, down = cfg.n_ff_shexp, w["ffn_gate_up_shexp"], w["ffn_down_shexp"]
            self._mark("dense")
            ops.gemm(ws.shared_act, ws.x, gate_up.data, n, 2 * fs, d, gate_up.wtype)
            ops.gemm(ws.shared_out, ws.shared_act, down.data, n, d, fs, down.wtype, swiglu=True)
            shared = ws.shared_out
        if routed is not None:
            self._mark("experts")
            y = routed.receive(ws.moe_out.rows(0, n))
        gate_vec = w["ffn_gate_inp_shexp"].data if shared is not None else None
        self._mark("experts")
        ops.moe_combine(ws.h, y, g, shared, ws.x, gate_vec, n, d, k)

    # ---- logits ----------------------------------------------------------------------------------
    def _lm_head(self, rows: list[int]) -> np.ndarray:
        """Logits of the pass's rows `rows` (ascending), LOGIT_ROWS at a time."""
        cfg, ws, ops = self.cfg, self.ws, self.ops
        out = np.empty((len(rows), cfg.n_vocab), np.float32)
        for i in range(0, len(rows), LOGIT_ROWS):
            group = rows[i:i + LOGIT_ROWS]
            m = len(group)
            for j, k in _runs(group):            # gather the rows asked for, normalised: a launch a run
                ops.rmsnorm(ws.lm_rows.rows(j, k), ws.h.rows(group[j], group[k - 1] + 1), self.w.output_norm.data,
                            k - j, cfg.n_embd, cfg.rms_eps)
            if self.lm_head == "cpu":
                out[i:i + m] = self._cpu_logits(ws.lm_rows.rows(0, m).download())
                continue
            ops.gemm(ws.logits, ws.lm_rows, self.w.output.data, m, cfg.n_vocab, cfg.n_embd, self.w.output.wtype)
            out[i:i + m] = ws.logits.rows(0, m).download()
        return out

    def _cpu_logits(self, x: np.ndarray) -> np.ndarray:
        """The LM head on the host (the paper's other placement), with the CPU kernels
        (activations quantised by the native kernel: bit-exact with shared.quants')."""
        import native
        w = self.model.output
        kind = KERNEL_TYPES.get(w.qtype)
        if kind in ("q4_0", "q8_0"):
            return native.matmul(w.raw.reshape(w.shape[0], -1), native.quantize_row_q8_0(x), kind)
        return x @ w.f32().T

    # ---- state in and out --------------------------------------------------------------------------
    def _fit(self, T: int, positions: list[int], boundaries=()) -> None:
        """Memory for a batch of T tokens whose prompts reach `positions` (plan.fit_passes),
        VRAM freed before it is taken."""
        fit = fit_passes(self.model, self.budget - self.outside_plan, T, positions, boundaries, self.max_pass_tokens, self.ring_slots,
                         self.max_resident, self.resident_bytes, self.experts.layer_bytes, self.max_kv_layers)
        self._apply(fit.plan, fit.ws_tokens, fit.n_chunks, positions)
        self.pass_n = fit.pass_tokens

    def _apply(self, plan, ws_tokens: int, n_chunks: int, positions: list[int]) -> None:
        cfg, resident = self.cfg, spread_resident(self.cfg.n_layer, plan.resident_layers)
        if plan.resident_layers < len(self.experts.resident):
            self.experts.set_resident(resident)      # fewer: their VRAM freed before the buffers below take theirs
        while len(self.lanes) > len(positions):
            self.lanes.pop().free()
        for lane, n in zip(self.lanes, positions):
            if (lane.positions, lane.kv_layers) != (n, plan.kv_layers):
                lane.free_kv()
        slot_rows = sum(positions) if plan.spilled_kv_layers else 0
        if self.kv_slot is not None and self.kv_slot[0].shape[0] != slot_rows:
            for buf in self.kv_slot:
                buf.free()
            self.kv_slot = None
        if self.ws is None or (self.ws.T, self.ws.n_chunks) != (ws_tokens, n_chunks):
            if self.ws is not None:
                self.ws.free()
            self.ws = Workspace(self.device, cfg, ws_tokens, n_chunks)
            self.ops.split_scratch = self.ws.splitk
        while len(self.lanes) < len(positions):
            self.lanes.append(Lane(self.device, cfg))
        row = 0
        for lane, n in zip(self.lanes, positions):
            if lane.positions != n:
                lane.alloc_kv(n, plan.kv_layers)
            lane.slot_row, row = row, row + n
        if slot_rows and self.kv_slot is None:
            shape = (slot_rows, cfg.n_head_kv, cfg.head_dim)
            self.kv_slot = (DeviceArray(self.device, shape), DeviceArray(self.device, shape))
        self.experts.set_resident(resident)
        self.plan = plan

    def _upload_state(self, state: SequenceState, lane: Lane) -> None:
        cfg = self.cfg
        if state.kv.dtype_name != self.kv_cache_dtype:
            raise FermoeError(f"the state keeps its KV in {state.kv.dtype_name}; this engine runs "
                              f"--kv-cache-dtype {self.kv_cache_dtype}")
        for g, L in enumerate(cfg.gdn_layers):
            if state.position == 0:            # nothing consumed: the recurrent state is zero
                lane.S[L].zero(self.ops.stream)
                lane.conv[L].zero(self.ops.stream)
            else:
                lane.S[L].upload(state.ssm[g])
                lane.conv[L].upload(state.conv[g])
        lane.prior = {}
        for a in range(len(cfg.attention_layers)):
            keys, values = state.kv.view(a)
            if a >= lane.kv_layers:          # kept in host memory: page-locked, copied up at each pass
                if len(keys):
                    lane.prior[a] = (self._pinned_copy(keys), self._pinned_copy(values))
            elif len(keys):
                lane.Kc[a].rows(0, len(keys)).upload(keys)
                lane.Vc[a].rows(0, len(values)).upload(values)

    def _pinned_copy(self, host: np.ndarray) -> np.ndarray:
        out = self.device.pagelocked_empty(host.shape, host.dtype)
        out[...] = host
        return out
