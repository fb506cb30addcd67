"""The GPU phase of a request: its prompt prefilled on a GPU worker, whose snapshots
land in the arena, before a CPU worker resumes from the last one and decodes.

    QUEUED --place--> PREFILLING (on a GPU worker) --Prefilled--> HANDED_OFF --> RUNNING (a CPU worker)
                         |  a device error, a lost worker, no slot for the prompt's end
                         +--> QUEUED again, marked gpu_failed: prefilled on the CPU worker

The coordinator's loop asks `place` where the head of its queue goes, hands this
module the GPU workers' messages, and tells it when a request ends or a worker is lost;
the queue and the CPU workers stay the coordinator's.
"""
from __future__ import annotations

import logging
import time

from shared import protocol as P
from shared.engine import update_rate

from .placement import place_prefill
from .requests import Phase, Request, Unfinished, planned_refs, resume_refs
from .scheduler import WorkerView

log = logging.getLogger("fermoe.coordinator")


def _mean(rates) -> float:
    """The mean of the known (positive) rates; 0 if none is."""
    known = [r for r in rates if r > 0]
    return sum(known) / len(known) if known else 0.0


class GPUPrefills:
    def __init__(self, opts, index, arena, workers: dict[str, WorkerView], requests: dict[str, Request], send,
                 unfinished: Unfinished):
        self.opts, self.index, self.arena = opts, index, arena
        self.workers, self.requests, self.send = workers, requests, send
        self.unfinished = unfinished            # slots of ended requests a worker may still write

    def place(self, req: Request) -> str:
        """Where a queued request's prompt is prefilled: "gpu" (sent to a GPU worker: off
        the queue), "cpu" (on the CPU worker that decodes it), or "wait" (--prefill gpu with
        every GPU worker busy)."""
        if req.phase is Phase.HANDED_OFF or req.gpu_failed or self.arena is None or not self.opts.gpus:
            return "cpu"
        gpus = [w for w in self.workers.values() if w.kind == "gpu" and w.alive and w.ready]
        cached = self.index.cached(req.cache_tokens)
        uncached = len(req.tokens) - cached
        cpus = [w for w in self.workers.values() if w.kind == "cpu" and w.ready]
        cpu_tok_s, cpu_vision_tok_s = (_mean(w.prefill_tok_s for w in cpus), _mean(w.vision_tok_s for w in cpus))
        queued = {w.worker_id: sum(self.requests[r].gpu_tokens for r in w.requests if r in self.requests)
                  for w in gpus}
        image_tokens = sum(im.rows * im.cols for im in req.images if im.start + im.rows * im.cols > cached)
        placement = place_prefill(self.opts.prefill, uncached, gpus, cpu_tok_s, queued, image_tokens, cpu_vision_tok_s)
        if placement is None:
            return "wait"
        req.estimates = placement.estimates
        if placement.device == "cpu" or not self._start(req, placement.worker):
            return "cpu"
        return "gpu"

    def _start(self, req: Request, wid: str) -> bool:
        """Send the Prefill: the cached prefix to resume from, the planned snapshots up to the
        prompt's end (with a state). False if that end cannot be stored (the arena full of pinned entries):
        the prompt is then prefilled on a CPU worker, before any token is sent."""
        replay = req.attempts > 0
        resume = self.index.lookup(req.cache_tokens, replay=replay)
        if not replay:
            req.cached_tokens = resume.position if resume else 0
        planned = self.index.plan(req.cache_tokens, resume.position if resume else 0, req.marks)
        if not planned or planned[-1].position != len(req.tokens) or planned[-1].state < 0:
            log.warning("request %s: no snapshot slot free for the end of its prompt: prefilling it on a CPU worker",
                        req.rid)
            self.index.release(resume)
            self.index.abort(planned)
            req.gpu_failed = True
            return False
        req.resume, req.planned, req.worker, req.prefill_device = resume, planned, wid, "gpu"
        req.gpu_tokens = len(req.tokens) - (resume.position if resume else 0)
        req.phase = Phase.PREFILLING
        req.first_dispatch = req.first_dispatch or time.monotonic()
        req.attempts += 1
        self.workers[wid].requests.add(req.rid)
        refs, data = resume_refs(resume, self.arena, self.workers[wid].arena)
        # images: the tower runs where the prefill runs (the GPU worker, for those past `resume`)
        self.send(wid, P.Prefill(request_id=req.rid, tokens=req.tokens, resume=refs, snapshots=planned_refs(planned),
                                 images=req.images), data)
        return True

    def prefilled(self, wid: str, msg: P.Prefilled) -> Request | None:
        """A GPU worker's Prefilled: the request, now HANDED_OFF (its last snapshot pinned for
        the CPU worker) or back to QUEUED marked gpu_failed, to go back to the front of the
        queue; None if it ended meanwhile."""
        self.unfinished.stopped(msg.request_id, wid)
        req = self.requests.get(msg.request_id)
        view = self.workers[wid]
        view.requests.discard(msg.request_id)
        if req is None or req.worker != wid:
            return None                                 # cancelled meanwhile
        req.worker = None
        if msg.error is not None or req.planned:
            why = msg.error or f"{len(req.planned)} planned snapshots never written"
            log.warning("request %s: its prefill on %s failed (%s): prefilling it on a CPU worker", req.rid, wid, why)
            self.fail_over(req)
            return req
        prefilled = msg.batch_tokens or req.gpu_tokens      # a batch's time is all its prompts'
        text_ms = msg.prefill_ms - msg.vision_ms            # the tower's time has a rate of its own
        if text_ms > view.prefill_fixed_ms:             # the rate of what the fixed cost leaves
            view.prefill_tok_s = update_rate(view.prefill_tok_s, 1000 * prefilled / (text_ms - view.prefill_fixed_ms))
        if msg.vision_tokens > 0 and msg.vision_ms > 0:
            view.vision_tok_s = update_rate(view.vision_tok_s, 1000 * msg.vision_tokens / msg.vision_ms)
        req.gpu_prefill_ms, req.prefill_batch = msg.prefill_ms, msg.batch_prompts
        req.release(self.index)
        # the CPU worker resumes from the end of the prompt: pinned now, before anything can evict it
        req.handoff, req.phase = self.index.lookup(req.cache_tokens, counted=False), Phase.HANDED_OFF
        return req

    def fail_over(self, req: Request) -> None:
        """The request's GPU prefill is lost: its prompt runs on a CPU worker."""
        req.release(self.index)
        req.gpu_failed, req.prefill_device, req.phase = True, None, Phase.QUEUED

