"""The GPU worker process: prefills prompts for the coordinator, never decodes.

One DEALER socket to the coordinator's worker endpoint (shared/worker_link.py, as the
CPU workers have). A Prefill job restores its resume snapshots (or starts empty), runs
its images past them through the vision tower (on the GPU: gpu_worker/vision.py), then
the rest of the prompt through the GPU engine with the planned snapshot positions that
take a state as chunk boundaries, and writes each snapshot into the coordinator's
snapshot arena (a state lands from the device in its state slot, a block's KV is copied
from the prompt's into its KV slot after; the last one: the final state and its
logits), where a CPU worker resumes from it and decodes. Started by the coordinator, or by hand:
`gpu_worker --connect tcp://HOST:PORT --model MODEL [--gpu N] [--gpu-mem SIZE] [--mmproj FILE]`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import uuid

from shared import protocol as P
from shared.engine import measure_prefill_rate
from shared.errors import FermoeError
from shared.hybrid_link import PeerError
from shared.model import Model
from shared.state import SequenceState, restore_snapshots
from shared.worker_link import (HEARTBEAT_S, WorkerLink, add_worker_options, attach_experts, serve_until_stopped,
                                worker_main)

from .engine import GPUEngine, PrefillJob, PrefillStopped

log = logging.getLogger("fermoe.gpu_worker")
# The prompts timed at start, each while the one before took under PROBE_BUDGET_S: the
# rate the worker announces is the largest's, and prompts up to its size find the memory
# planned and the streamed expert layers packed (a first long prompt would pay for both).
PROBE_TOKENS = (64, 256, 1024)
PROBE_BUDGET_S = 2.0
# A Prefill takes the prompts waiting behind it into its batch while they add up to
# BATCH_TOKENS (or the first prompt's length, if longer): a long prompt already shares its
# expert streaming among its own tokens; short ones share it with each other. The batch
# holds at most the coordinator's max_model_len positions in all, what its memory plan
# counts a GPU worker's prompt state for; the prompts it sends are its limit on their number.
BATCH_TOKENS = 2048
# With CPU workers' mailboxes to serve, the loop looks at them between its messages: right
# after a request, often (the next step of a decoding sequence comes within a sampling's time);
# idle for longer, every IDLE_POLL_S (a first step waits that long, an idle worker costs no core).
BUSY_POLL_S, IDLE_POLL_S, BUSY_FOR_S = 0.0002, 0.002, 0.1


class GPUWorker:
    def __init__(self, model_path: str, connect: str, worker_id: str, gpu: int = 0, gpu_mem: int | None = None,
                 shared_memory: bool = True, device=None, probe_tokens=PROBE_TOKENS, shared_experts: str | None = None,
                 mmproj: str | None = None, curve_key: str | None = None):
        """mmproj: the vision tower's file; a prompt with images needs it (curve_key: the
        worker's key file, for a coordinator that requires CURVE keys). The tower goes
        on the device first: its weights and a workspace for a 1024x1024 image come out
        of gpu_mem, the prefill engine plans with the rest."""
        from shared.builtin import resolve_model
        self.model = Model(resolve_model(model_path))
        experts = attach_experts(shared_experts, self.model)
        self.tower = self.vision = None
        if mmproj is not None:
            from .vision import gpu_engines, open_tower
            self.tower = open_tower(mmproj, self.model)
            try:
                self.engine, self.vision = gpu_engines(self.model, self.tower, gpu_mem=gpu_mem, gpu=gpu, device=device,
                                                       shared_experts=experts)
            except BaseException:
                self.tower.close()
                raise
        else:
            self.engine = GPUEngine(self.model, gpu_mem=gpu_mem, gpu=gpu, device=device, shared_experts=experts)
        self.worker_id, self.probe_tokens = worker_id, probe_tokens
        self.link = WorkerLink(connect, worker_id, self._configure, shared_memory, curve_key)
        self.handlers = {P.Prefill: self.handle_prefill, P.Stop: self.handle_stop, P.Shutdown: self.handle_shutdown,
                         P.HybridPeer: self.handle_hybrid_peer}
        self.peers: dict = {}               # cpu worker id -> the StepServer of its mailbox (the hybrid decode)
        self._last_step = 0.0               # when a mailbox last held a request (monotonic)
        self._registered = None             # the arena page-locked for the engine's copies
        self._images = None
        if self.vision is not None:
            from .vision import image_encoder
            self._images = image_encoder(self.tower, self.vision)
        self.running = True

    def _configure(self, kv_cache_dtype: str) -> None:
        self.engine.set_kv_cache_dtype(kv_cache_dtype)
        self.model.extend_context(self.link.max_model_len)   # --max-model-len above the file's context length

    def prefill_rate(self) -> tuple[float, float, int]:
        return measure_prefill_rate(self.engine, self.model.config, self.probe_tokens, PROBE_BUDGET_S)

    def event_loop(self) -> None:
        rate, fixed_s, size = self.prefill_rate()
        log.info("%s: prefill %.0f ms + %.0f tok/s (probes up to %d tokens)", self.engine.device.name,
                 1000 * fixed_s, rate, size)
        self.link.hello(os.getpid(), 1, self.model.fingerprint, kind="gpu", device=self.engine.device.name,
                        prefill_tok_s=round(rate, 1), prefill_fixed_ms=round(1000 * fixed_s, 2))
        while self.running:
            if self.peers:                  # decode steps first: the mailboxes polled between messages
                if not self.link.serve(self.handlers, 0) and not self.serve_steps():
                    self.link.beat(0)
                    busy = time.monotonic() - self._last_step < BUSY_FOR_S
                    time.sleep(BUSY_POLL_S if busy else IDLE_POLL_S)
            elif not self.link.serve(self.handlers, int(HEARTBEAT_S * 1000)):
                self.link.beat(0)

    def handle_hybrid_peer(self, msg: P.HybridPeer, data=()) -> None:
        """Serve a CPU worker's decode steps through its mailbox (its pid tells when it is gone)."""
        from shared.exchange import Exchange
        from shared.hybrid_link import mailbox_bytes, process_gone

        from .step_server import StepServer
        try:
            ex = Exchange.attach(msg.mailbox, mailbox_bytes(self.model.config))
        except Exception as e:          # noqa: BLE001 -- a bad name must not end the worker
            self.link.report(f"the hybrid mailbox {msg.mailbox!r} of {msg.worker_id}: {type(e).__name__}: {e}")
            return
        old = self.peers.pop(msg.worker_id, None)
        if old is not None:
            old.close()
        self.peers[msg.worker_id] = StepServer(ex, self.engine,
                                               gone=lambda: process_gone(msg.pid, f"the CPU worker {msg.worker_id}"))
        log.info("serving the decode steps of %s (pid %d)", msg.worker_id, msg.pid)

    def serve_steps(self) -> bool:
        """Answer what the CPU workers' mailboxes hold; whether any request came. A CPU worker
        gone is dropped with its sequences."""
        served = False
        for wid, server in list(self.peers.items()):
            try:
                while server.poll(0.0):
                    served = True
            except PeerError as e:
                log.warning("dropping %s's decode steps: %s", wid, e)
                self.peers.pop(wid).close()
        if served:
            self._last_step = time.monotonic()
        return served

    def handle_prefill(self, msg: P.Prefill, data: list[bytes] = ()) -> None:
        """Run the job with the prompts already waiting behind it (one batch: the expert
        layers stream once for all of them), heartbeating meanwhile (a long prompt takes a
        minute). A Stop of a job, or a Shutdown, ends the batch between passes once every
        job in it is stopped. A bad job fails alone; a device error fails the batch, never
        the worker."""
        batch = PrefillBatch(self.link, msg, data)
        batch.run(self)
        batch.report(self.link)

    def job(self, msg: P.Prefill, data: list[bytes]) -> tuple[PrefillJob, dict]:
        """A Prefill as the engine's job: its resumed state (or an empty one), the rest of
        its prompt, its snapshots' recurrent parts landing in their state slots; and the
        buffers of each snapshot position (KV slot, state slot) for its KV after."""
        kv_slots, state_slot = self.link.resume_slots(msg, data)
        if kv_slots:
            state = restore_snapshots(self.model.config, self.model.fingerprint, kv_slots, state_slot,
                                      self.link.block, self.engine.kv_cache_dtype)
        else:       # not the engine's page-locked new_state(): the results land in the slots
            state = SequenceState(self.model.config, self.model.fingerprint, kv_dtype=self.engine.kv_cache_dtype)
        end = len(msg.tokens)
        if not msg.snapshots or msg.snapshots[-1].position != end or msg.snapshots[-1].state < 0:
            raise FermoeError(f"a prefill of {end} tokens must end with a snapshot with a state at position {end}")
        if state.position >= end:
            raise FermoeError(f"the resumed state is at position {state.position}: nothing of the {end}-token "
                              "prompt is left to prefill")
        if self.link.arena is not None and self._registered is not self.link.arena:
            self.engine.land.register(self.link.arena.memory())      # snapshots land in their slots
            self._registered = self.link.arena
        buffers = {ref.position: self.link.snapshot_buffers(ref.slot, ref.state) for ref in msg.snapshots}
        into = {p: state_slot for p, (_, state_slot) in buffers.items() if state_slot is not None}
        media = self.media(msg, state.position).slice(state.position, end) if msg.images else None
        return PrefillJob(msg.tokens[state.position:], state, into=into, block=self.link.block, media=media), buffers

    def media(self, msg: P.Prefill, start: int):
        """The TokenMedia of a Prefill's prompt: its images past `start` through the tower
        (on the GPU), every token's M-RoPE position."""
        from shared.vision.prompt import media_of_images
        if self._images is None:
            raise FermoeError("the prompt has images, but this GPU worker has no vision tower (--mmproj)")
        return media_of_images(len(msg.tokens), msg.images, self.model.config.n_embd, self._images, start)

    def handle_stop(self, msg: P.Stop, data=()) -> None:
        pass                    # of a job already over (one running is stopped by handle_prefill's urgent)

    def handle_shutdown(self, msg: P.Shutdown, data=()) -> None:
        self.running = False

    def close(self) -> None:
        for server in self.peers.values():
            server.close()
        if self.vision is not None:         # before the engine, which may close the device
            self.vision.close()
            self.tower.close()
        self.engine.close()                 # before the link: it unregisters the arena the link unmaps
        self.link.close()


class PrefillBatch:
    """The Prefill jobs that run as one engine batch: collected (the first and those
    waiting behind it that fit), run, then reported (their snapshots written, a
    Prefilled each)."""

    def __init__(self, link: WorkerLink, msg: P.Prefill, data: list[bytes]):
        self.t0 = time.perf_counter()
        self.room = max(len(msg.tokens), min(BATCH_TOKENS, link.max_model_len or BATCH_TOKENS)) - len(msg.tokens)
        self.messages = [(msg, data)] + link.waiting(P.Prefill, self.fits)
        self.ids = {m.request_id for m, _ in self.messages}
        self.stopped, self.everything = set(), threading.Event()
        self.jobs: list[tuple[P.Prefill, PrefillJob, dict]] = []    # (its message, its engine job, its buffers)
        self.failed: dict[str, str] = {}                            # request id -> why
        self.vision_tokens, self.vision_ms = 0, 0.0

    def fits(self, m: P.Prefill) -> bool:
        """Whether a waiting Prefill joins the batch: its tokens fit the room left."""
        self.room -= len(m.tokens)
        return self.room >= 0

    def urgent(self, m) -> None:
        """A message that came while the batch runs: a Stop of one of its jobs, or a
        Shutdown; the batch ends once all of them are stopped."""
        if isinstance(m, P.Stop) and m.request_id in self.ids:
            self.stopped.add(m.request_id)
        if isinstance(m, P.Shutdown) or self.stopped >= self.ids:
            self.everything.set()

    def between_passes(self, worker: GPUWorker) -> bool:
        """The decode steps waiting on the worker run first (they are short); whether the batch ends."""
        worker.serve_steps()
        return self.everything.is_set()

    def run(self, worker: GPUWorker) -> None:
        """The jobs through the worker's engine, heartbeating; a job's failure is kept by
        its request id (every job's, for the batch's own)."""
        images = worker._images
        tower = (images.tokens, images.seconds) if images is not None else (0, 0.0)
        try:
            with worker.link.keepalive(len(self.messages), self.urgent):   # the vision tower's passes take seconds too
                for m, d in self.messages:
                    try:
                        self.jobs.append((m, *worker.job(m, d)))
                    except Exception as e:             # this prompt's own fault: the others run
                        self.failed[m.request_id] = f"{type(e).__name__}: {e}"
                if self.jobs:
                    worker.engine.prefill_batch([job for _, job, _ in self.jobs], lambda: self.between_passes(worker))
        except Exception as e:                 # report, never die silently
            if not isinstance(e, PrefillStopped):
                log.exception("prefill of %s failed", ", ".join(m.request_id for m, _, _ in self.jobs))
            self.failed.update((m.request_id, f"{type(e).__name__}: {e}") for m, _, _ in self.jobs)
        if images is not None:
            self.vision_tokens, self.vision_ms = images.tokens - tower[0], 1000 * (images.seconds - tower[1])

    def report(self, link: WorkerLink) -> None:
        """The snapshots of the jobs that ran written, then a Prefilled for every message."""
        tokens = sum(len(job.tokens) for _, job, _ in self.jobs)
        for m, job, buffers in self.jobs:
            if m.request_id not in self.failed:      # each snapshot's KV from the whole prompt's, its state landed
                for ref in m.snapshots:
                    link.write_snapshot(m.request_id, ref.slot, ref.state, job.state, ref.position,
                                        buffers[ref.position])
        ms = 1000 * (time.perf_counter() - self.t0)
        for m, _ in self.messages:
            error = self.failed.get(m.request_id)
            link.send(P.Prefilled(request_id=m.request_id, prefill_ms=0.0 if error else ms, error=error,
                                  batch_tokens=0 if error else tokens, batch_prompts=len(self.jobs),
                                  vision_tokens=0 if error else self.vision_tokens,
                                  vision_ms=0.0 if error else round(self.vision_ms, 3)))


def run_gpu_worker(args) -> int:
    from shared.options import gpu_engine_options
    if args.cpus:               # the host thread that feeds the GPU, on a core no decode thread takes
        from shared.topology import cpu_list
        cpus = cpu_list(args.cpus)
        os.sched_setaffinity(0, cpus)
        log.info("placement: CPUs %s", cpus)
    worker = GPUWorker(args.model, args.connect, args.worker_id or f"gpu-{uuid.uuid4().hex[:8]}",
                       shared_memory=not args.no_shared_memory, shared_experts=args.shared_experts,
                       mmproj=args.mmproj, curve_key=args.curve_key, **gpu_engine_options(args))
    return serve_until_stopped(worker)


def main(argv=None) -> int:
    from shared.options import add_gpu_options
    p = argparse.ArgumentParser(prog="gpu_worker", description="fermoe GPU prefill worker")
    add_worker_options(p)
    add_gpu_options(p)
    p.add_argument("--cpus", default=None, help="comma-separated CPUs to run on (default: any)")
    p.add_argument("--mmproj", default=None,
                   help="the model's vision tower (mmproj GGUF), run on the GPU: prompts with images")
    return worker_main("gpu_worker", p, run_gpu_worker, argv)


if __name__ == "__main__":
    sys.exit(main())
