"""A request's GPU phase (coordinator/gpu_prefill.py) as the coordinator's loop drives
it, on fake worker views, a real SnapshotIndex and a send that records what each worker
is told: where a prompt goes, what a failure does, and where the CPU worker resumes."""
from __future__ import annotations

import types

import pytest

from coordinator.gpu_prefill import GPUPrefills
from coordinator.requests import Phase, Request, Unfinished
from coordinator.scheduler import WorkerView
from coordinator.snapshots import SnapshotIndex
from shared import protocol as P
from shared.sampling import SamplingParams

BLOCK = 4


class Setup:
    """A GPUPrefills over one GPU worker and one CPU worker (both with the arena: no
    snapshot travels as bytes, so the arena itself is never read)."""

    def __init__(self, prefill="gpu"):
        self.index = SnapshotIndex(64, block=BLOCK)
        self.workers = {"gpu0": WorkerView("gpu0", ready=True, arena=True, kind="gpu", prefill_tok_s=3000.0,
                                           prefill_fixed_ms=280.0),
                        "cpu0": WorkerView("cpu0", ready=True, arena=True, prefill_tok_s=120.0)}
        self.requests, self.sent = {}, []
        self.gpu = GPUPrefills(types.SimpleNamespace(gpus=[0], prefill=prefill), self.index, object(), self.workers,
                               self.requests, lambda wid, msg, data=(): self.sent.append((wid, msg)),
                               Unfinished(self.index))

    def request(self, rid, tokens, key=None, images=()) -> Request:
        req = Request(b"client", P.Generate(request_id=rid, tokens=tokens), tokens, SamplingParams(), None,
                      images=list(images), key=key)
        self.requests[rid] = req
        return req

    def write_all(self, req):
        """The GPU worker wrote every snapshot planned for the request (its SnapshotWritten)."""
        self.index.commit(req.planned)
        req.planned = []


def test_a_prompt_the_gpu_worker_failed_goes_to_a_cpu_worker_and_never_back():
    """Fault guarded: a request a GPU worker failed (a device error, no memory for it)
    not marked so, or the mark not read when it is placed again: it went back to the GPU
    worker that failed it, and again after each failure, its client waiting for ever
    (--prefill gpu, the GPU worker free and faster: only the mark sends it to a CPU
    worker). Its snapshot slots are freed at the failure, and a worker lost mid-prefill
    does the same."""
    s = Setup()
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "gpu"
    (wid, prefill), = s.sent
    assert (wid, type(prefill), req.phase, req.worker) == ("gpu0", P.Prefill, Phase.PREFILLING, "gpu0")
    assert s.index.stats()["pinned"] == len(prefill.snapshots) == 8          # 7 block boundaries and the end
    back = s.gpu.prefilled("gpu0", P.Prefilled(request_id="r", prefill_ms=5.0, error="out of memory"))
    assert back is req and (req.phase, req.gpu_failed, req.worker, req.prefill_device) == \
        (Phase.QUEUED, True, None, None)
    assert s.index.stats()["pinned"] == 0 and s.workers["gpu0"].requests == set()
    assert s.gpu.place(req) == "cpu" and len(s.sent) == 1                     # nothing more to the GPU worker
    lost = s.request("lost", list(range(40, 70)))
    assert s.gpu.place(lost) == "gpu" and s.index.stats()["pinned"] == 8
    s.gpu.fail_over(lost)                               # what the daemon does for a lost worker's prefill
    assert (lost.phase, lost.gpu_failed, s.index.stats()["pinned"]) == (Phase.QUEUED, True, 0)
    assert s.gpu.place(lost) == "cpu" and len(s.sent) == 2


def test_an_image_prompt_prefilled_on_the_gpu_is_resumed_at_its_end():
    """Fault guarded: the hand-over's lookup made with the prompt's tokens instead of its
    cache key (an image's tokens are keyed by its pixels): it found nothing, and the CPU
    worker prefilled the whole prompt and ran the tower again, the GPU's work thrown away.
    The GPU worker is sent the images; once it has written the snapshots, the request is
    handed off pinned at the prompt's end, and the image's tokens count for placement
    only where the cache does not cover them."""
    s = Setup()
    tokens = [1, 2, 3] + [9] * 6 + [4, 5, 6, 7, 8, 10, 11]                  # an image's 2 x 3 tokens at 3
    key = tokens[:3] + [(1 << 30) + i for i in range(6)] + tokens[9:]
    image = P.ImageInput(data=b"png", start=3, rows=2, cols=3)
    req = s.request("img", tokens, key=key, images=[image])
    assert s.gpu.place(req) == "gpu"
    (_, prefill), = s.sent
    assert prefill.images == [image] and prefill.tokens == tokens and prefill.resume == []
    assert [r.position for r in prefill.snapshots] == [4, 8, 12, 16]
    s.write_all(req)
    handed = s.gpu.prefilled("gpu0", P.Prefilled(request_id="img", prefill_ms=50.0))
    assert handed is req and req.phase is Phase.HANDED_OFF and req.prefill_device == "gpu"
    assert (req.handoff.position, req.handoff.exact) == (16, True)
    assert [e.position for e in req.handoff.entries] == [4, 8, 12, 16]
    assert s.gpu.place(req) == "cpu" and len(s.sent) == 1                     # the CPU worker decodes it now
    assert s.index.cached(tokens) == 0                                       # the tokens alone are not the key


def test_a_prompt_cached_past_its_image_is_placed_without_the_images_cost():
    """Placement adds an image's tower time only for an image the cache does not cover:
    the same image and text cached whole up to a later turn leaves 4 text tokens, which
    stay on the CPU (33 ms against 281 on the GPU); the first time, the image's 6 tokens
    at the towers' rates (GPU 1000, CPU 10 tokens/s) send it to the GPU."""
    s = Setup(prefill="auto")
    s.workers["gpu0"].vision_tok_s, s.workers["cpu0"].vision_tok_s = 1000.0, 10.0
    tokens = [1, 2, 3] + [9] * 6 + [4, 5, 6]
    key = tokens[:3] + [(1 << 30) + i for i in range(6)] + tokens[9:]
    image = P.ImageInput(data=b"png", start=3, rows=2, cols=3)
    first = s.request("first", tokens, key=key, images=[image])
    assert s.gpu.place(first) == "gpu"
    assert first.estimates == pytest.approx({"gpu": 280.0 + 4.0 + 6.0, "cpu": 100.0 + 600.0})
    s.write_all(first)
    s.gpu.prefilled("gpu0", P.Prefilled(request_id="first", prefill_ms=280.0))
    first.release(s.index)
    later = s.request("later", tokens + [20, 21, 22, 23], key=key + [20, 21, 22, 23], images=[image])
    assert s.gpu.place(later) == "cpu"
    assert later.estimates == pytest.approx({"gpu": 280.0 + 4 / 3, "cpu": 4 / 0.12})
