"""The CPU worker process: runs sequences the coordinator assigns to it.

One DEALER socket to the coordinator's worker endpoint. Each sequence is restored
from the snapshot slots named in its Assign (or started empty), prefilled up to
each planned snapshot position with a state slot in turn (writing the slots as it
passes; a KV link of the chain is written from the pages once passed), then
decoded one token at a time. The slots live in the coordinator's shared-memory
arena; a worker that cannot map it (another host) gets and sends them as raw
frames beside the messages instead. A round is one forward pass (each weight read once
for all of its sequences), as vLLM's scheduler builds them: one token for every
decoding sequence first, then prompt chunks in arrival order, each stopping at its
next snapshot position with a state, up to PASS_TOKENS in all, or DECODING_PASS_TOKENS while a
sequence is decoding. So a long prompt never stalls the generations already running
for more than one short pass, a prompt alone prefills in long ones (more tokens per
expert), and N clients cost far less than N times one. Started by the coordinator,
or by hand to add capacity:
`cpu_worker --connect tcp://HOST:PORT`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field

from shared import protocol as P
from shared.engine import measure_prefill_rate, update_rate
from shared.errors import FermoeError
from shared.generate import Decoder
from shared.model import Model
from shared.sampling import SamplingParams
from shared.state import SequenceState, restore_snapshots
from shared.worker_link import (HEARTBEAT_S, WorkerLink, add_worker_options, attach_experts, serve_until_stopped,
                                worker_main)

from shared.topology import cpu_list, default_cpus, numa_nodes

log = logging.getLogger("fermoe.cpu_worker")
DECODE_MODES = ("cpu", "hybrid", "auto")
PASS_TOKENS = 256           # tokens of one forward pass (at most the engine's max_batch) ...
DECODING_PASS_TOKENS = 64   # ... and while sequences decode: the pause a prompt chunk puts in their streams
MIN_PROMPT_TOKENS = 8       # prompt tokens a pass takes however many sequences decode: no prompt starves
RATE_PROBE_TOKENS = 32      # the prompt timed at start: the prefill rate the worker announces
SPARE_STATES = 2            # finished sequences' recurrent buffers kept for restores (a large model's: 63 MB)


@dataclass
class Sequence:
    msg: P.Assign
    state: SequenceState
    params: SamplingParams
    pending: list = field(default_factory=list)    # SnapshotRefs still to write, in position order
    decode_slots: list = field(default_factory=list)   # (KV, state) pairs for snapshots while decoding
    decode_gap: bool = False     # a block boundary passed without a slot: later decode snapshots are useless
    link_at: int = -1            # the last block boundary written as a KV link while decoding
    decoder: Decoder | None = None
    media: object = None         # the prompt's images and M-RoPE positions (TokenMedia), None: text
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    vision: tuple = (0, 0.0)     # its images' tokens through the tower, and the milliseconds it took
    hybrid_key: int | None = None    # its key on the GPU worker once it decodes there (the hybrid)
    hybrid_off: bool = False     # the hybrid gave it up: it decodes here from now on
    level_at: int = 0            # the position its own copy of the state was last whole at
    since: list = field(default_factory=list)   # and the tokens stepped on the GPU worker since
    hybrid_steps: int = 0        # its steps that ran on the GPU worker


class CPUWorker:
    def __init__(self, model_path: str, connect: str, worker_id: str, threads: int | None, engine: str = "cpu",
                 cpus: list[int] | None = None, shared_memory: bool = True, probe_tokens: int = RATE_PROBE_TOKENS,
                 shared_experts: str | None = None, mmproj: str | None = None, curve_key: str | None = None,
                 decode: str = "cpu"):
        """mmproj: the vision tower's file; a sequence with images needs it. curve_key: the
        worker's key file, for a coordinator that requires CURVE keys. decode: cpu, or hybrid
        (open a mailbox for a GPU worker to run the dense part of every sequence's decode steps,
        shared/hybrid_link.py), or auto (the same, each sequence decoding where the steps have
        been faster)."""
        from shared.builtin import resolve_model
        from .engines import cpu_engine
        self.model = Model(resolve_model(model_path))
        self.engine = cpu_engine(engine, self.model, threads=threads, cpus=cpus,
                                 experts=attach_experts(shared_experts, self.model))
        self.worker_id, self.probe_tokens = worker_id, probe_tokens
        self.link = WorkerLink(connect, worker_id, self._configure, shared_memory, curve_key)
        self.handlers = {P.Assign: self.handle_assign, P.Stop: self.handle_stop, P.Shutdown: self.handle_shutdown,
                         P.DecodeSlots: self.handle_decode_slots, P.HybridReady: self.handle_hybrid_ready,
                         P.HybridLost: self.handle_hybrid_lost}
        self.mailbox = self.peer = None         # the hybrid decode's mailbox, and its GPU worker once one serves it
        self._keys = 0
        if decode not in DECODE_MODES:
            raise FermoeError(f"--decode {decode!r}: expected {', '.join(DECODE_MODES)}")
        self.decode_mode = decode
        self.step_ms = {"cpu": 0.0, "hybrid": 0.0}     # a decode-only pass's time each way (running averages)
        if decode != "cpu":
            if not hasattr(self.engine, "routed_experts"):
                raise FermoeError(f"--decode {decode} needs the cpu engine (this worker runs {engine})")
            self.mailbox = self._open_mailbox()
        self.mmproj, self._images = mmproj, None      # the tower, opened with the first image
        self.sequences: dict[str, Sequence] = {}
        self._spare: list[bytearray] = []          # recurrent buffers of finished sequences
        self.running = True

    def _configure(self, kv_cache_dtype: str) -> None:
        self.engine.kv_cache_dtype = kv_cache_dtype     # the snapshot slots hold this KV
        self.model.extend_context(self.link.max_model_len)   # --max-model-len above the file's context length

    # ---- messages ---------------------------------------------------------
    def send(self, msg) -> None:
        self.link.send(msg)

    def event_loop(self) -> None:
        rate, _, _ = measure_prefill_rate(self.engine, self.model.config, [self.probe_tokens])
        self.link.hello(os.getpid(), self.engine.threads, self.model.fingerprint,
                        prefill_tok_s=round(rate, 1), mailbox=self.mailbox.name if self.mailbox else "")
        while self.running:
            busy = bool(self.sequences)
            prefault = not busy and self.link.prefaulting
            if self.link.serve(self.handlers, 0 if busy or prefault else int(HEARTBEAT_S * 1000)):
                continue                                 # drain messages before working
            self.link.beat(len(self.sequences))
            if busy:
                self.work_round()
            elif prefault:              # idle: map the snapshot slots' pages, so that no request's
                self.link.prefault_step()   # snapshot write pays for faulting them in

    def handle_assign(self, msg: P.Assign, data: list[bytes] = ()) -> None:
        try:
            self.sequences[msg.request_id] = self.start(msg, data)
        except Exception as e:         # the request ends with the reason; the worker serves on
            known = isinstance(e, (FermoeError, ValueError))
            if not known:
                log.exception("starting request %s failed", msg.request_id)
            self.send(P.Finished(request_id=msg.request_id, finish_reason="error", prefill_ms=0.0,
                                 decode_ms=0.0, completion_tokens=0,
                                 error=str(e) if known else f"{type(e).__name__}: {e}"))

    def handle_stop(self, msg: P.Stop, data=()) -> None:
        seq = self.sequences.pop(msg.request_id, None)
        if seq is not None:
            self.finish(msg.request_id, seq, "cancelled")

    def handle_shutdown(self, msg: P.Shutdown, data=()) -> None:
        self.running = False

    def handle_hybrid_ready(self, msg: P.HybridReady, data=()) -> None:
        """A GPU worker serves the mailbox: the decode steps of sequences from here on go there."""
        if self.mailbox is None:
            self.link.report("a HybridReady, but this worker has no hybrid mailbox (--decode hybrid or auto)")
            return
        if self.peer is not None:
            self.link.report("a second HybridReady: the mailbox has a GPU worker already")
            return
        from shared.hybrid_link import DensePeer, process_gone
        self.peer = DensePeer(self.mailbox, self.engine, gone=lambda: process_gone(msg.pid, "the GPU worker"))
        log.info("decoding with the GPU worker (pid %d): the dense part there, the routed experts here", msg.pid)

    def handle_hybrid_lost(self, msg: P.HybridLost, data=()) -> None:
        if self.peer is not None:
            self.peer.broken = "the GPU worker is gone"
            self._lose_peer()

    def _lose_peer(self) -> None:
        """The GPU worker is gone: every sequence decodes here (taken back at its next pass), and
        a new mailbox waits for the next GPU worker (the old one's message counts are spent)."""
        self.peer = None
        self.mailbox.close()
        self.mailbox = self._open_mailbox()
        self.send(P.HybridMailbox(mailbox=self.mailbox.name))

    def _open_mailbox(self):
        from shared.exchange import Exchange
        from shared.hybrid_link import MAILBOX_PREFIX, mailbox_bytes
        return Exchange.create(mailbox_bytes(self.model.config), prefix=MAILBOX_PREFIX)

    # ---- sequences --------------------------------------------------------
    def start(self, msg: P.Assign, data: list[bytes] = ()) -> Sequence:
        kv_slots, state_slot = self.link.resume_slots(msg, data)
        if kv_slots:
            state = restore_snapshots(self.model.config, self.model.fingerprint, kv_slots, state_slot,
                                      self.link.block, self.engine.kv_cache_dtype,
                                      self._spare.pop() if self._spare else None)
        else:
            state = self.engine.new_state()
        media, vision = self.media(msg, state.position) if msg.images else (None, (0, 0.0))
        return Sequence(msg, state, msg.sampling, sorted(msg.snapshots, key=lambda s: s.position),
                        decode_slots=[tuple(p) for p in msg.decode_slots], media=media, vision=vision)

    def media(self, msg: P.Assign, start: int):
        """The TokenMedia of an Assign's prompt: its images through the tower (those its
        resumed snapshots do not cover: none for a repeated prompt), every token's position;
        and (image tokens encoded, milliseconds)."""
        from shared.vision.prompt import media_of_images
        if self.mmproj is None:
            raise FermoeError("the prompt has images, but this worker has no vision tower (--mmproj)")
        # the tower may run longer than the coordinator's heartbeat timeout (a large image on
        # a few cores): a thread keeps beating meanwhile
        with self.link.keepalive(len(self.sequences)):
            if self._images is None:
                from .vision_engine import image_encoder
                self._images = image_encoder(self.mmproj, self.model, self.engine.threads)
            before = self._images.tokens, self._images.seconds
            media = media_of_images(len(msg.tokens), msg.images, self.model.config.n_embd, self._images, start)
            return media, (self._images.tokens - before[0], 1000 * (self._images.seconds - before[1]))

    def work_round(self) -> None:
        """One forward pass: a token for each decoding sequence, then prompt chunks."""
        batch = []                                  # (rid, seq, tokens) of this pass
        for rid, seq in list(self.sequences.items()):
            if seq.state.position < len(seq.msg.tokens) or not self.guarded(rid, seq, self.sample):
                continue
            if seq.decoder.finish_reason is None:
                batch.append((rid, seq, seq.decoder.history[-1:]))
            else:
                self.sequences.pop(rid, None)
                self.guarded(rid, seq, self.write_final_snapshot)
                self.finish(rid, seq, seq.decoder.finish_reason)
        budget = min(DECODING_PASS_TOKENS if batch else PASS_TOKENS, self.engine.max_batch)
        budget = max(budget - len(batch), MIN_PROMPT_TOKENS)
        for rid, seq in list(self.sequences.items()):
            pos, tokens = seq.state.position, seq.msg.tokens
            if pos >= len(tokens) or budget <= 0 or not self.guarded(rid, seq, self.write_snapshots):
                continue
            end = min([len(tokens), pos + budget] + [r.position for r in seq.pending if r.state >= 0][:1])
            batch.append((rid, seq, tokens[pos:end]))
            budget -= end - pos
        if batch:
            self.run_pass(batch)

    def run_pass(self, batch) -> None:
        t0 = time.perf_counter()
        try:
            logits, timed_as = self._forward(batch)
        except Exception as e:                  # the pass failed: every sequence in it did
            log.exception("forward pass failed")
            for rid, seq, _ in batch:
                self.sequences.pop(rid, None)
                self.finish(rid, seq, "error", f"{type(e).__name__}: {e}")
            return
        elapsed = time.perf_counter() - t0
        if timed_as is not None:                # decode rows alone, all of them one way: its time counts
            self.step_ms[timed_as] = update_rate(self.step_ms[timed_as], 1000 * elapsed)
        for (rid, seq, _), row in zip(batch, logits):
            if seq.decoder is not None:
                seq.decoder.logits = row
                seq.decode_s += elapsed
                if seq.decode_slots and seq.state.position % self.link.block == 0:
                    self.guarded(rid, seq, self.write_boundary_snapshot)
            else:
                seq.prefill_ms += 1000 * elapsed
                if seq.msg.progress:
                    self.send(P.Progress(request_id=rid, processed=seq.state.position, time_ms=seq.prefill_ms))
                self.guarded(rid, seq, self.write_snapshots)

    def _forward(self, batch) -> tuple[list, str | None]:
        """The pass's logits, a row a sequence: the decoding ones' on the GPU worker when one
        serves this worker (the hybrid), the rest (and all, without it) on this worker's engine;
        and how its time counts for --decode auto ("cpu", "hybrid", or None: not a decode-only
        pass all one way)."""
        remote = [i for i, (_, seq, _) in enumerate(batch)
                  if self.peer is not None and seq.decoder is not None and not seq.hybrid_off]
        rows: list = [None] * len(batch)
        if remote:
            try:
                for row, i in zip(self._hybrid_step([batch[i] for i in remote]), remote):
                    rows[i] = row
            except FermoeError as e:            # the GPU worker failed the step, or is gone
                self._hybrid_failed(e, [batch[i][1] for i in remote])
                remote = []
        local = [i for i in range(len(batch)) if i not in remote]
        timed_as = None                         # a decode-only pass all one way is timed for --decode auto
        if all(seq.decoder is not None for _, seq, _ in batch) and not (local and remote):
            timed_as = "hybrid" if remote else "cpu"
        if local:
            segments = []
            for i in local:
                _, seq, tokens = batch[i]
                replay = self._take_back(seq)   # a sequence the hybrid gave up: its steps since run again
                segments.append((replay + list(tokens), seq.state) if replay else self._segment(seq, tokens))
            for row, i in zip(self.engine.forward_batch(segments), local):
                rows[i] = row
        return rows, timed_as

    def _decode_hybrid(self) -> bool:
        """Whether a sequence starting to decode goes to the GPU worker: always with --decode
        hybrid; with auto, a way not yet timed first, then the faster one."""
        if self.decode_mode == "cpu" or self.peer is None:
            return False
        if self.decode_mode == "hybrid":
            return True
        return decode_hybrid_faster(self.step_ms["cpu"], self.step_ms["hybrid"])

    def _hybrid_step(self, part) -> list:
        peer = self.peer
        for _, seq, _ in part:
            if seq.hybrid_key is None:          # its state as it stands goes over once
                self._keys += 1
                peer.admit(self._keys, seq.state)
                seq.hybrid_key, seq.level_at, seq.since = self._keys, seq.state.position, []
        tokens = [int(t[0]) for _, _, t in part]
        logits = peer.step([seq.hybrid_key for _, seq, _ in part], tokens)
        for (_, seq, _), token in zip(part, tokens):
            seq.state.position += 1             # its own copy's recurrent part and KV lag until a sync
            seq.since.append(token)
            seq.hybrid_steps += 1
        return list(logits)

    def _hybrid_failed(self, e: Exception, seqs) -> None:
        """A step failed on the GPU worker: these sequences decode here from now on (from their
        last whole state, the steps since run again); a GPU worker gone serves none any more."""
        gone = self.peer is not None and self.peer.broken is not None
        log.warning("a hybrid step failed (%s): %s on this worker's CPUs", e,
                    "every sequence decodes" if gone else "its sequences decode")
        if gone:
            self._lose_peer()
        for seq in seqs:
            seq.hybrid_off = True
            if self.peer is not None and seq.hybrid_key is not None:
                try:                            # its device memory there given back
                    self.peer.release(seq.hybrid_key)
                except FermoeError:
                    if self.peer.broken:
                        self._lose_peer()

    def _take_back(self, seq: Sequence) -> list:
        """A sequence the hybrid gave up (or whose GPU worker is gone): its own copy back to
        where it was whole; returns the tokens to run again from there."""
        if seq.hybrid_key is None or (self.peer is not None and not seq.hybrid_off):
            return []
        replay, seq.since = seq.since, []
        seq.state.position, seq.hybrid_key, seq.hybrid_off = seq.level_at, None, True
        return replay

    def _level(self, seq: Sequence) -> None:
        """Its own copy of the state made whole (before a snapshot is written from it)."""
        if seq.hybrid_key is None or not seq.since:
            return
        if self.peer is not None and not seq.hybrid_off:
            try:
                self.peer.sync(seq.hybrid_key, seq.state)
                seq.level_at, seq.since = seq.state.position, []
                return
            except FermoeError as e:
                self._hybrid_failed(e, [seq])
        replay = self._take_back(seq)
        seq.decoder.logits = self.engine.forward(replay, seq.state, all_logits=False)[-1]

    @staticmethod
    def _segment(seq: Sequence, tokens):
        """A forward_batch segment: a prompt chunk with images carries its part of the media."""
        if seq.media is None or seq.decoder is not None:
            return tokens, seq.state
        pos = seq.state.position
        return tokens, seq.state, seq.media.slice(pos, pos + len(tokens))

    def write_boundary_snapshot(self, rid: str, seq: Sequence) -> None:
        """At a block boundary while decoding: a snapshot into a decode pair, keeping one
        with a state for the final state (with a state itself if a spare one has, else a
        KV link of the chain); without a spare pair the chain has a gap, and no later
        decode snapshot could be resumed from."""
        with_state = [p for p in seq.decode_slots if p[1] >= 0]
        links = [p for p in seq.decode_slots if p[1] < 0]
        pair = with_state[0] if len(with_state) >= 2 else links[0] if links and with_state else None
        if pair is None or seq.decode_gap:
            seq.decode_gap = True
            return
        self._level(seq)
        seq.decode_slots.remove(pair)
        if pair[1] < 0:
            seq.link_at = seq.state.position
        self.link.write_snapshot(rid, *pair, seq.state, seq.state.position)

    def write_final_snapshot(self, rid: str, seq: Sequence) -> None:
        """Where the generation ended (not on a boundary written with a state already): the
        next chat turn, which appends to this one, resumes here."""
        pos = seq.state.position
        pair = next((p for p in seq.decode_slots if p[1] >= 0), None)
        if pair is not None and not seq.decode_gap and pos > len(seq.msg.tokens) and \
                (pos % self.link.block or seq.link_at == pos):
            self._level(seq)
            seq.decode_slots.remove(pair)
            self.link.write_snapshot(rid, *pair, seq.state, pos)

    def handle_decode_slots(self, msg: P.DecodeSlots, data=()) -> None:
        seq = self.sequences.get(msg.request_id)
        if seq is not None:
            seq.decode_slots += [tuple(p) for p in msg.slots]

    def guarded(self, rid: str, seq: Sequence, step) -> bool:
        """step(rid, seq); a failure ends that sequence with an error, never the worker."""
        try:
            step(rid, seq)
            return True
        except Exception as e:                 # report, never die silently
            log.exception("sequence %s failed", rid)
            self.sequences.pop(rid, None)
            self.finish(rid, seq, "error", f"{type(e).__name__}: {e}")
            return False

    def sample(self, rid: str, seq: Sequence) -> None:
        first = seq.decoder is None
        if first:
            seq.hybrid_off = not self._decode_hybrid()
            stop_ids = () if seq.msg.ignore_eos else self.model.tokenizer.eos_ids
            seq.decoder = Decoder(self.engine, seq.state, seq.state.logits.copy(), seq.msg.tokens, seq.params,
                                  seq.msg.max_tokens, stop_ids, logprobs=seq.msg.logprobs, mask=self.mask(seq.msg),
                                  reasoning_budget=seq.msg.reasoning_budget, reasoning_end=seq.msg.reasoning_end)
        if seq.decoder.finish_reason is None:
            token = seq.decoder.sample()
            logprob, top = seq.decoder.last_logprobs or (None, None)
            vision_tokens, vision_ms = seq.vision if first else (0, 0.0)
            self.send(P.Sampled(request_id=rid, token=token, prefill_ms=seq.prefill_ms if first else None,
                                logprob=logprob, top_logprobs=None if top is None else
                                [P.TokenLogprob(token=t, logprob=lp) for t, lp in top],
                                vision_tokens=vision_tokens, vision_ms=round(vision_ms, 3)))

    def mask(self, msg: P.Assign):
        """The sequence's own grammar matcher (each of a batch has one; the pass stays one
        forward for all), or None when it is unconstrained."""
        if msg.grammar is None:
            return None
        from shared.token_mask import TokenMask, ll_tokenizer
        return TokenMask(ll_tokenizer(self.model.tokenizer, self.model.config.n_vocab), msg.grammar)

    def write_snapshots(self, rid: str, seq: Sequence) -> None:
        """Every planned snapshot the prompt has reached: one with a state slot where the
        prompt stands (a pass stops there), a KV link of the chain at or before it."""
        while seq.pending and (seq.pending[0].position == seq.state.position
                               or seq.pending[0].state < 0 and seq.pending[0].position <= seq.state.position):
            ref = seq.pending.pop(0)
            self.link.write_snapshot(rid, ref.slot, ref.state, seq.state, ref.position)

    def finish(self, rid: str, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.hybrid_key is not None and not seq.hybrid_off and self.peer is not None:
            try:
                self.peer.release(seq.hybrid_key)
            except FermoeError as e:
                self._hybrid_failed(e, [])
        if isinstance(seq.state.buffer, bytearray) and len(self._spare) < SPARE_STATES:
            self._spare.append(seq.state.buffer)         # the next restore copies into it
        done = seq.decoder.history[len(seq.msg.tokens):] if seq.decoder else []
        self.send(P.Finished(request_id=rid, finish_reason=reason, prefill_ms=seq.prefill_ms,
                             decode_ms=1000 * seq.decode_s, completion_tokens=len(done), error=error,
                             hybrid_steps=seq.hybrid_steps))

    def close(self) -> None:
        self.link.close()
        if self.mailbox is not None:
            self.mailbox.close()
        self.engine.close()


def decode_hybrid_faster(cpu_ms: float, hybrid_ms: float) -> bool:
    """--decode auto's choice for a sequence starting to decode, from the decode-only passes'
    running times each way (0: not timed yet): the hybrid first, then the CPU, then the faster."""
    if hybrid_ms <= 0:
        return True
    if cpu_ms <= 0:
        return False
    return hybrid_ms < cpu_ms


def run_cpu_worker(args) -> int:
    cpus = cpu_list(args.cpus) if args.cpus else None
    if args.node is not None and args.node not in numa_nodes():
        raise FermoeError(f"--node {args.node}: this machine's NUMA nodes are {sorted(numa_nodes())}")
    if cpus is not None or args.node is not None:
        from .numa_placement import place
        log.info("placement: %s", place(args.node or 0, cpus or default_cpus(args.node), args.numa_interleave))
    worker = CPUWorker(args.model, args.connect, args.worker_id or f"cpu-{uuid.uuid4().hex[:8]}",
                       args.threads, args.engine, cpus, shared_memory=not args.no_shared_memory,
                       shared_experts=args.shared_experts, mmproj=args.mmproj, curve_key=args.curve_key,
                       decode=args.decode)
    return serve_until_stopped(worker)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cpu_worker", description="fermoe CPU decode worker")
    add_worker_options(p)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--engine", default="cpu", help="cpu (default) or reference")
    p.add_argument("--cpus", default=None, help="comma-separated CPUs to pin to (default: the node's physical cores)")
    p.add_argument("--node", type=int, default=None, help="NUMA node whose memory to use")
    p.add_argument("--numa-interleave", action="store_true", help="interleave memory over all nodes")
    p.add_argument("--mmproj", default=None, help="the model's vision tower (mmproj GGUF): prompts with images")
    p.add_argument("--decode", default="cpu", choices=DECODE_MODES,
                   help="cpu, or hybrid: open a mailbox for a GPU worker to run the dense part of the decode steps; "
                        "auto: the same, each sequence decoding the way steps have been faster (default cpu)")
    return worker_main("cpu_worker", p, run_cpu_worker, argv)


if __name__ == "__main__":
    sys.exit(main())
