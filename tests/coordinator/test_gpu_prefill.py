"""A request's GPU phase (coordinator/gpu_prefill.py) as the coordinator's loop drives
it, on fake worker views, a real SnapshotIndex and a send that records what each worker
is told: where a prompt goes, what a failure does, and where the CPU worker resumes."""
from __future__ import annotations

import types

import pytest

from coordinator import gpu_prefill
from coordinator.gpu_prefill import GPUPrefills
from coordinator.requests import Phase, Request, Unfinished
from coordinator.scheduler import WorkerView
from coordinator.snapshots import SnapshotIndex
from shared import protocol as P
from shared.sampling import SamplingParams
from tests.support.deadline import deadline

BLOCK = 4


@pytest.fixture(autouse=True)
def _fail_fast_if_the_index_loops():
    """The snapshot index's walk up a chain whose parents loop (a mutant of snapshots.py) would
    spin: fail in 30 s naming that, instead of hanging (each test takes well under a second)."""
    with deadline(30, "an index walk that never ends: a chain's parents form a loop?"):
        yield


class _Arena:
    """A snapshot arena whose slots read as their names."""

    def slot(self, i):
        return b"kv%d" % i

    def state_slot(self, i):
        return b"state%d" % i


class Setup:
    """A GPUPrefills over one GPU worker and one CPU worker (both with the arena: no
    snapshot travels as bytes, so the arena itself is never read)."""

    def __init__(self, prefill="gpu", index=None, arena=object(), gpu_arena=True):
        self.index = SnapshotIndex(64, block=BLOCK) if index is None else index
        self.workers = {"gpu0": WorkerView("gpu0", ready=True, arena=gpu_arena, kind="gpu", prefill_tok_s=3000.0,
                                           prefill_fixed_ms=280.0),
                        "cpu0": WorkerView("cpu0", ready=True, arena=True, prefill_tok_s=120.0)}
        self.requests, self.sent, self.frames = {}, [], []
        self.unfinished = Unfinished(self.index)
        self.gpu = GPUPrefills(types.SimpleNamespace(gpus=[0], prefill=prefill), self.index, arena, self.workers,
                               self.requests, self.record, self.unfinished)

    def record(self, wid, msg, data=()):
        self.sent.append((wid, msg))
        self.frames.append(data)

    def cache(self, tokens):
        """An earlier prompt of these tokens prefilled and its snapshots written."""
        self.index.commit(self.index.plan(tokens, 0))

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


def test_a_prompt_resumes_from_the_cache_and_the_next_one_waits_behind_its_tokens():
    """Fault guarded: a prompt sent to the GPU worker without the cached prefix it extends
    (prefilled from 0, its usage reporting 0 cached tokens), or a prompt placed behind it
    estimated without the tokens still queued there. 32 tokens whose first 8 are cached:
    resumed from the snapshots at 4 and 8, a hit of 8, 24 tokens to prefill: 280 + 24 / 3
    = 288 ms on the GPU, 24 / 0.12 = 200 on the CPU. 66 more tokens behind it wait for
    the running batch's fixed cost, then share the next's: 2 x 280 + (24 + 66) / 3 = 590
    ms, 550 on the CPU; nothing cached for them: a miss, 0 cached tokens."""
    s = Setup()
    first = s.request("first", list(range(1, 33)))
    s.cache(first.tokens[:8])
    assert s.gpu.place(first) == "gpu"
    (wid, prefill), = s.sent
    assert (wid, prefill.request_id, [r.position for r in prefill.resume]) == ("gpu0", "first", [4, 8])
    assert [r.position for r in prefill.snapshots] == [12, 16, 20, 24, 28, 32]
    assert (first.cached_tokens, first.gpu_tokens, first.attempts) == (8, 24, 1)
    assert first.estimates == {"gpu": 288.0, "cpu": 200.0}
    second = s.request("second", list(range(100, 166)))
    assert s.gpu.place(second) == "gpu"
    assert second.estimates == {"gpu": 590.0, "cpu": 550.0}
    assert (second.cached_tokens, second.gpu_tokens) == (0, 66)
    stats = s.index.stats()
    assert (stats["hits"], stats["hit_tokens"], stats["misses"], stats["replays"]) == (1, 8, 1, 0)


def test_a_gpu_worker_without_the_arena_is_sent_the_resumed_snapshots_bytes():
    """Fault guarded: the resumed snapshots' bytes not sent to a GPU worker that has not
    mapped the arena, or read from no arena: it could restore nothing. They go as frames:
    the KV slot of each resumed snapshot in order, then the state slot of the last."""
    s = Setup(arena=_Arena(), gpu_arena=False)
    req = s.request("r", list(range(1, 31)))
    s.cache(req.tokens[:8])
    assert s.gpu.place(req) == "gpu"
    (_, prefill), = s.sent
    kv4, kv8 = prefill.resume
    assert s.frames == [[b"kv%d" % kv4.slot, b"kv%d" % kv8.slot, b"state%d" % kv8.state]]


def test_a_replay_on_the_gpu_resumes_its_own_snapshots_without_counting_a_hit(monkeypatch):
    """Fault guarded: the lookup of a request replayed after its CPU worker died counted as
    a client's cache hit and its cached tokens overwritten (its usage then reported what
    its own first attempt wrote as cached), or its attempts miscounted (the daemon ends a
    request after MAX_ATTEMPTS). Its first attempt found nothing cached and wrote the
    snapshots up to 8: resumed from 8, a replay of 8 tokens, still 0 cached, its second
    attempt; its first dispatch is this one's time (the log's queued time ends there)."""
    monkeypatch.setattr(gpu_prefill, "time", types.SimpleNamespace(monotonic=lambda: 2.5))
    s = Setup()
    req = s.request("r", list(range(1, 31)))
    req.attempts = 1
    s.cache(req.tokens[:8])
    assert s.gpu.place(req) == "gpu"
    (_, prefill), = s.sent
    assert [r.position for r in prefill.resume] == [4, 8]
    assert (req.cached_tokens, req.gpu_tokens, req.attempts, req.first_dispatch) == (0, 22, 2, 2.5)
    stats = s.index.stats()
    assert (stats["replays"], stats["replay_hit_tokens"], stats["hits"], stats["misses"]) == (1, 8, 0, 0)


def test_a_prompt_whose_end_finds_no_slot_is_prefilled_on_the_cpu_and_frees_what_it_took():
    """Fault guarded: a prompt sent to the GPU worker though its end got no snapshot slot
    (the CPU worker would have nothing to resume from), or the lookup and slots it took
    kept pinned after all. 3 KV slots: the cached first block holds one, a 14-token prompt
    resumed from it gets 8 and 12, none for 14. It goes to the CPU, marked so; 2 slots free
    again, nothing pinned. With no slot at all (2 slots, another prompt writing both), the same."""
    s = Setup(index=SnapshotIndex(3, block=BLOCK))
    req = s.request("r", list(range(1, 15)))
    s.cache(req.tokens[:4])
    assert s.gpu.place(req) == "cpu"
    assert s.sent == [] and (req.gpu_failed, req.phase, req.worker) == (True, Phase.QUEUED, None)
    assert (s.index.stats()["pinned"], s.index.stats()["free_slots"]) == (0, 2)
    s = Setup(index=SnapshotIndex(2, block=BLOCK))
    assert len(s.index.plan(list(range(100, 108)), 0)) == 2
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "cpu" and s.sent == [] and req.gpu_failed is True


def test_a_prompt_goes_to_the_gpu_with_a_state_for_its_end_only():
    """Fault guarded: a GPU prefill refused unless a snapshot before the end also has a
    state: with one state slot the block boundaries are KV links (state -1) and only the
    end holds the state, which is all the CPU worker resumes from."""
    s = Setup(index=SnapshotIndex(64, block=BLOCK, n_state_slots=1))
    req = s.request("r", list(range(1, 15)))
    assert s.gpu.place(req) == "gpu"
    (_, prefill), = s.sent
    assert [(r.position, r.state) for r in prefill.snapshots] == [(4, -1), (8, -1), (12, -1), (14, 0)]


def test_a_one_token_prompt_and_a_chats_turn_starts_are_planned_on_the_gpu():
    """Fault guarded: the snapshots planned from position 1 when nothing is cached (a
    one-token prompt then has none at its end and never reaches the GPU worker), or a
    chat's turn starts (marks) left out of the plan (a next turn diverging there finds no
    snapshot). --prefill gpu: one token, its one snapshot at 1; 30 tokens marked at 10,
    a snapshot at 10 besides the block boundaries and the end."""
    s = Setup()
    one = s.request("one", [7])
    assert s.gpu.place(one) == "gpu"
    assert [r.position for r in s.sent[-1][1].snapshots] == [1] and one.gpu_tokens == 1
    chat = s.request("chat", list(range(100, 130)))
    chat.marks = [10]
    assert s.gpu.place(chat) == "gpu"
    assert [r.position for r in s.sent[-1][1].snapshots] == [4, 8, 10, 12, 16, 20, 24, 28, 30]


def test_a_gpu_only_prompt_waits_while_the_gpu_worker_is_full():
    """Fault guarded: --prefill gpu with the GPU worker holding GPU_QUEUE (8) prompts not
    answered "wait": the loop then gives the prompt to a CPU worker."""
    s = Setup()
    s.workers["gpu0"].requests.update(f"q{i}" for i in range(8))
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "wait"
    assert s.sent == [] and req.phase is Phase.QUEUED and s.index.stats()["pinned"] == 0


def test_no_gpu_prefill_without_the_snapshot_arena():
    """Fault guarded: a prompt placed on the GPU worker when the coordinator has no
    snapshot arena (--snapshot-mem 0: nowhere for its snapshots to land): the attempt
    fails for want of a slot, counts a cache miss and marks the request failed on the GPU.
    Without the arena the prompt goes to the CPU worker without a lookup."""
    s = Setup(index=SnapshotIndex(0, block=BLOCK), arena=None)
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "cpu"
    assert s.sent == [] and req.gpu_failed is False and s.index.stats()["misses"] == 0


def test_a_prefill_with_a_snapshot_never_written_goes_to_a_cpu_worker():
    """Fault guarded: a Prefilled without an error taken as done while a snapshot planned
    for the prompt was never written (one whose bytes did not arrive): the CPU worker would
    resume from a slot never written. The request goes back to the queue for a CPU worker,
    its slots freed, and its time teaches the GPU worker no rate."""
    s = Setup()
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "gpu"
    s.index.commit(req.planned[:-1])
    req.planned = req.planned[-1:]
    back = s.gpu.prefilled("gpu0", P.Prefilled(request_id="r", prefill_ms=400.0, batch_tokens=30))
    assert back is req and (req.phase, req.gpu_failed, req.handoff) == (Phase.QUEUED, True, None)
    assert s.index.stats()["pinned"] == 0 and s.workers["gpu0"].prefill_tok_s == 3000.0


def test_a_prefilled_from_a_worker_that_no_longer_holds_the_request_is_ignored():
    """Fault guarded: a Prefilled taken from a GPU worker the request is not on (it runs
    on a CPU worker now): its snapshots released and its phase changed under the CPU worker."""
    s = Setup()
    req = s.request("r", list(range(1, 31)))
    req.worker, req.phase = "cpu0", Phase.RUNNING
    assert s.gpu.prefilled("gpu0", P.Prefilled(request_id="r", prefill_ms=400.0)) is None
    assert (req.worker, req.phase, req.gpu_failed) == ("cpu0", Phase.RUNNING, False)


def test_a_prompt_cancelled_on_the_gpu_frees_its_slots_when_the_gpu_worker_stops():
    """Fault guarded: the slots of a request cancelled while on the GPU worker never freed
    when the worker's Prefilled for it comes (the cache shrinks with every cancel)."""
    s = Setup()
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "gpu"
    s.requests.pop("r")                                 # what the daemon's end() does on a cancel
    s.workers["gpu0"].requests.discard("r")
    s.unfinished.hold(req)
    req.release(s.index)
    assert s.index.stats()["pinned"] == 8
    assert s.gpu.prefilled("gpu0", P.Prefilled(request_id="r", prefill_ms=0.0, error="stopped")) is None
    assert (s.index.stats()["pinned"], s.index.stats()["free_slots"]) == (0, 64)


def test_a_prefill_updates_the_gpu_workers_rates_from_its_batch():
    """Fault guarded: the GPU worker's rates learned from the wrong figures: the request's
    own tokens instead of its batch's, the tower's time counted as the text's, the fixed
    cost not taken off. A batch of 4000 tokens in 1280 ms, 200 of them the tower's for 1000
    image tokens: 1080 - 280 = 800 ms of text, 5000 tok/s, averaged with the 3000 known
    (weight 0.3): 3600; the tower's 5000 with the 2000 known: 2900. The hand-off's lookup
    is no client's: no hit counted."""
    s = Setup()
    s.workers["gpu0"].vision_tok_s = 2000.0
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "gpu"
    s.write_all(req)
    handed = s.gpu.prefilled("gpu0", P.Prefilled(request_id="r", prefill_ms=1280.0, batch_tokens=4000,
                                                 batch_prompts=3, vision_tokens=1000, vision_ms=200.0))
    assert handed is req and req.phase is Phase.HANDED_OFF
    assert (s.workers["gpu0"].prefill_tok_s, s.workers["gpu0"].vision_tok_s) == (3600.0, 2900.0)
    assert (req.gpu_prefill_ms, req.prefill_batch) == (1280.0, 3)
    stats = s.index.stats()
    assert (stats["hits"], stats["misses"]) == (0, 1)


@pytest.mark.parametrize("vision_tokens, vision_ms, rate", [(6, 0.0, 3000.0), (0, 2.0, 3000.0), (1, 0.5, 2700.0)])
def test_the_towers_rate_learns_only_from_images_it_encoded(vision_tokens, vision_ms, rate):
    """Fault guarded: a batch whose tower time reads 0 ms divided by (the loop crashes), one
    that encoded no image taken as a rate of 0, or one image token in under a millisecond
    ignored. 1 token in 0.5 ms: 2000 tok/s, with the 3000 known: 2700."""
    s = Setup()
    s.workers["gpu0"].vision_tok_s = 3000.0
    req = s.request("r", list(range(1, 31)))
    assert s.gpu.place(req) == "gpu"
    s.write_all(req)
    s.gpu.prefilled("gpu0", P.Prefilled(request_id="r", prefill_ms=100.0, vision_tokens=vision_tokens,
                                        vision_ms=vision_ms))
    assert s.workers["gpu0"].vision_tok_s == rate


def test_the_cpu_estimate_is_at_the_mean_rate_of_the_measured_cpu_workers():
    """Fault guarded: the CPU workers' rate taken as their sum, with an unmeasured one (0)
    in the mean, or made up when none is measured. 100 and 140 tok/s and one unmeasured:
    120, 30 tokens in 250 ms (290 on the GPU); a worker slower than a token a second still
    counts: 0.5 and 1.5 average 1, 30 s; with none measured there is no CPU estimate and
    the prompt goes to the GPU (behind the previous one: 2 x 280 + (30 + 30) / 3 = 580 ms)."""
    s = Setup(prefill="auto")
    s.workers["cpu0"].prefill_tok_s = 100.0
    s.workers["cpu1"] = WorkerView("cpu1", ready=True, arena=True, prefill_tok_s=140.0)
    s.workers["cpu2"] = WorkerView("cpu2", ready=True, arena=True)
    mean = s.request("mean", list(range(1, 31)))
    assert s.gpu.place(mean) == "cpu" and mean.estimates == {"gpu": 290.0, "cpu": 250.0}
    s.workers["cpu0"].prefill_tok_s, s.workers["cpu1"].prefill_tok_s = 0.5, 1.5
    slow = s.request("slow", list(range(1, 31)))
    assert s.gpu.place(slow) == "gpu" and slow.estimates == {"gpu": 290.0, "cpu": 30000.0}
    s.workers["cpu0"].prefill_tok_s = s.workers["cpu1"].prefill_tok_s = 0.0
    unknown = s.request("unknown", list(range(40, 70)))
    assert s.gpu.place(unknown) == "gpu" and unknown.estimates == {"gpu": 580.0}


@pytest.mark.parametrize("start, estimates", [(2, {"gpu": 281.0, "cpu": 25.0}), (3, {"gpu": 287.0, "cpu": 625.0})])
def test_an_image_counts_unless_the_cache_covers_it_to_its_end(start, estimates):
    """Fault guarded: an image the cache covers to its last token counted again (its tower
    time added: the prompt sent to the GPU for nothing), or one it covers in part left out.
    The same image (2 x 3 tokens) and a different question: the cache reaches the block
    boundary at 8, 3 text tokens are left (281 ms on the GPU, 25 on the CPU). An image at
    2 ends there; one at 3 ends at 9 and its 6 tokens add 6 ms on the GPU (1000 tok/s) and
    600 on the CPU (10 tok/s)."""
    s = Setup(prefill="auto")
    s.workers["gpu0"].vision_tok_s, s.workers["cpu0"].vision_tok_s = 1000.0, 10.0
    image = P.ImageInput(data=b"png", start=start, rows=2, cols=3)
    head = list(range(1, start + 1)) + [(1 << 30) + i for i in range(6)]       # the image keyed by its pixels
    s.cache(head + [4, 5, 6][:11 - len(head)])
    tokens = list(range(1, start + 1)) + [9] * 6 + [20, 21, 22][:11 - len(head)]
    req = s.request("r", tokens, key=head + tokens[len(head):], images=[image])
    assert len(tokens) == 11 and s.index.cached(req.cache_tokens) == 8
    assert s.gpu.place(req) == ("cpu" if start == 2 else "gpu") and req.estimates == estimates


def test_no_snapshot_is_planned_before_the_point_the_gpu_worker_resumes_from():
    """Fault guarded: the snapshots planned from position 0 although the prompt resumes
    from the cache: a turn start before the resume point (6, not cached), which the GPU
    worker never passes, planned anyway: never written, the prefill fails over to a CPU
    worker. 32 tokens, the first 8 cached, marked at 6 and 18."""
    s = Setup()
    req = s.request("r", list(range(1, 33)))
    req.marks = [6, 18]
    s.cache(req.tokens[:8])
    assert s.gpu.place(req) == "gpu"
    assert [r.position for r in s.sent[-1][1].snapshots] == [12, 16, 18, 20, 24, 28, 32]
