"""The GPU worker: prefill jobs whose snapshots (the last one the final state with its
logits) land in the snapshot slots, where a CPU worker resumes and decodes; and the
worker link both worker kinds speak to the coordinator with. The workers run in this
process; their messages are collected instead of sent."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import zmq

from cpu_worker.worker import CPUWorker
from gpu_worker.worker import GPUWorker
from shared import protocol as P
from shared.engine import ReferenceEngine
from shared.generate import generate
from shared.sampling import SamplingParams
from shared.shm_arena import SnapshotArena
from shared.state import kv_slot_nbytes, restore_snapshots, state_slot_nbytes
from shared.worker_link import WorkerLink
from tests.support.gpu_device import DEVICES, assert_close, open_test_device

BLOCK = 8
GPU_RTOL = 3e-5          # the GPU engine's fp32 logits against the reference (as test_gpu_engine)
PROMPT = np.random.default_rng(1).integers(3, 500, 30).tolist()
MORE = np.random.default_rng(2).integers(3, 500, 10).tolist()


def _collecting(worker, arena):
    """The worker's link as a Welcome leaves it, with the snapshot `arena`; sends collected."""
    worker.sent = []
    worker.link.send = lambda msg, *frames, **how: worker.sent.append(msg)
    worker.link.arena, worker.link.block = arena, BLOCK
    worker.link.slot_bytes, worker.link.state_slot_bytes = arena.slot_bytes, arena.state_slot_bytes
    return worker


@pytest.fixture
def arena(tiny):
    arena = SnapshotArena.create(kv_slot_nbytes(tiny.config, BLOCK, "f16"), 8,
                                 state_slot_bytes=state_slot_nbytes(tiny.config), n_state_slots=8)
    yield arena
    arena.close()
    arena.unlink()


@pytest.fixture(scope="module")
def reference_logits(tiny):
    ref = ReferenceEngine(tiny)
    return ref.forward(PROMPT + MORE, ref.new_state())


@pytest.fixture(params=DEVICES)
def gpu_worker(request, tiny_q4_path, arena):
    device = open_test_device(request.param)
    w = GPUWorker(str(tiny_q4_path), "tcp://127.0.0.1:9", "gpu-test", device=device, probe_tokens=[8])
    yield _collecting(w, arena)
    w.close()


def _refs(first_slot: int, positions, links=()) -> list[P.SnapshotRef]:
    """Snapshots in KV slots from first_slot on, each with the state slot of the same
    number but those at `links` (KV links of the chain, no state)."""
    return [P.SnapshotRef(slot=first_slot + i, state=-1 if p in links else first_slot + i, position=p)
            for i, p in enumerate(positions)]


def _restore(tiny, arena, chain):
    """The state of the chain's last snapshot: its KV slots in order, the last one's state slot."""
    return restore_snapshots(tiny.config, tiny.fingerprint, [arena.slot(r.slot) for r in chain],
                             arena.state_slot(chain[-1].state), BLOCK)


def test_a_prefill_lands_every_snapshot_and_a_cpu_worker_decodes_from_the_last(gpu_worker, tiny, tiny_q4_path,
                                                                                 reference_logits):
    """Each slot restores to the state at its position (its logits the reference's
    there); an extended prompt resumes from them on the GPU; a CPU worker handed the
    chain samples what a CPU-only run samples."""
    slots = gpu_worker.link.arena
    first = _refs(0, [8, 16, 24, 30])
    gpu_worker.handle_prefill(P.Prefill(request_id="a", tokens=PROMPT, resume=[], snapshots=first))
    assert [m.slot for m in gpu_worker.sent if isinstance(m, P.SnapshotWritten)] == [0, 1, 2, 3]
    done = gpu_worker.sent[-1]
    assert isinstance(done, P.Prefilled) and done.error is None and done.prefill_ms > 0
    for k, ref in enumerate(first):
        state = _restore(tiny, slots, first[:k + 1])
        assert state.position == ref.position
        assert_close(state.logits, reference_logits[ref.position - 1], GPU_RTOL, floor=1.0)

    chain = first + _refs(4, [32, 40])                    # the extension resumes from all four
    gpu_worker.handle_prefill(P.Prefill(request_id="b", tokens=PROMPT + MORE, resume=first, snapshots=chain[4:]))
    assert gpu_worker.sent[-1] == P.Prefilled(request_id="b", prefill_ms=gpu_worker.sent[-1].prefill_ms,
                                              batch_tokens=len(MORE))
    state = _restore(tiny, slots, chain[:3] + chain[4:])
    assert state.position == 40
    assert_close(state.logits, reference_logits[39], GPU_RTOL, floor=1.0)

    cpu = CPUWorker(str(tiny_q4_path), "tcp://127.0.0.1:9", "cpu-test", threads=1)
    _collecting(cpu, SnapshotArena.attach(slots.name, slots.slot_bytes, slots.n_slots, slots.state_slot_bytes,
                                          slots.n_state_slots))    # as another process
    try:
        cpu.handle_assign(P.Assign(request_id="a", tokens=PROMPT, resume=first, snapshots=[], max_tokens=12,
                                   sampling=SamplingParams(temperature=0.0, seed=1), ignore_eos=True))
        while cpu.sequences:
            cpu.work_round()
        sampled = [m.token for m in cpu.sent if isinstance(m, P.Sampled)]
        assert sampled == list(generate(cpu.engine, PROMPT, 12, SamplingParams(temperature=0.0)))
    finally:
        cpu.close()


def test_snapshots_land_in_their_slots_or_through_reused_staging(gpu_worker, tiny_q4_path, monkeypatch):
    """With the arena page-locked the device copies into the slots themselves; without,
    through page-locked buffers kept from one prefill to the next: the same bytes, and no
    page-locked allocation after the first prefill either way."""
    device, allocated = gpu_worker.engine.device, []
    pagelocked_empty = device.pagelocked_empty
    monkeypatch.setattr(device, "pagelocked_empty", lambda *a: allocated.append(a) or pagelocked_empty(*a))
    arena, refs = gpu_worker.link.arena, _refs(0, [8, 16, 24, 30], links=[16])
    job = P.Prefill(request_id="a", tokens=PROMPT, resume=[], snapshots=refs)
    written = []
    for staged in (False, True, True):
        if staged:
            gpu_worker.engine.land.unregister()
        for r in refs:                                    # nothing left from the run before
            arena.slot(r.slot)[:] = bytes(arena.slot_bytes)
            arena.state_slot(r.slot)[:] = bytes(arena.state_slot_bytes)
        gpu_worker.handle_prefill(job)
        assert gpu_worker.sent[-1].error is None
        written.append([bytes(arena.slot(r.slot)) + bytes(arena.state_slot(r.slot)) for r in refs])
        if not staged:
            assert gpu_worker.engine.land._registered, "the arena was not page-locked"
    assert written[0] == written[1] == written[2]
    first = len(allocated)
    gpu_worker.handle_prefill(job)
    assert len(allocated) == first                        # staging and landing rows reused


@pytest.mark.parametrize("snapshots, images, problem", [
    (_refs(0, [8, 16]), [], "must end with a snapshot with a state at position 30"),
    ([], [], "must end with a snapshot with a state at position 30"),
    (_refs(0, [8, 30], links=[30]), [], "must end with a snapshot with a state at position 30"),
    (_refs(0, [30]), [P.ImageInput(data=b"png", start=2, rows=2, cols=2)], "this GPU worker has no vision tower"),
])
def test_a_bad_job_fails_alone_and_the_worker_serves_on(gpu_worker, snapshots, images, problem):
    """(A prompt with images on a worker without --mmproj: the coordinator prefills it on a CPU worker.)"""
    gpu_worker.handle_prefill(P.Prefill(request_id="bad", tokens=PROMPT, resume=[], snapshots=snapshots,
                                        images=images))
    assert gpu_worker.sent[-1].request_id == "bad" and problem in gpu_worker.sent[-1].error
    gpu_worker.handle_prefill(P.Prefill(request_id="ok", tokens=PROMPT[:8], resume=[], snapshots=_refs(0, [8])))
    assert gpu_worker.sent[-1] == P.Prefilled(request_id="ok", prefill_ms=gpu_worker.sent[-1].prefill_ms,
                                              batch_tokens=8)


@pytest.mark.parametrize("staged", [False, True])
def test_prompts_waiting_behind_a_prefill_join_its_batch(gpu_worker, tiny, monkeypatch, staged):
    """Prefills already queued behind the one being handled run in the same batch, up to
    its token budget (the rest, and other messages, stay queued in order); each prompt's
    slots hold its own states, landed in the page-locked arena or staged; a bad job among
    them fails alone."""
    if staged:                                            # as if the arena could not be page-locked
        gpu_worker._registered = gpu_worker.link.arena
    batches = []
    prefill_batch = gpu_worker.engine.prefill_batch
    monkeypatch.setattr(gpu_worker.engine, "prefill_batch", lambda jobs, *a: batches.append(len(jobs))
                        or prefill_batch(jobs, *a))
    monkeypatch.setattr("gpu_worker.worker.BATCH_TOKENS", len(PROMPT) + 8 + 2 * len(MORE))
    prompts = {"a": PROMPT, "b": PROMPT[:8], "bad": MORE, "c": MORE, "late": PROMPT}
    slots = {"a": _refs(0, [8, 16, 24, 30], links=[16]), "b": _refs(4, [8]), "bad": [], "c": _refs(5, [8, 10]),
             "late": _refs(7, [30])}      # a chain: a slot holds its own block of KV
    jobs = {rid: P.Prefill(request_id=rid, tokens=t, resume=[], snapshots=slots[rid]) for rid, t in prompts.items()}
    queue = [jobs["b"], jobs["bad"], P.Stop(request_id="x"), jobs["c"], jobs["late"]]
    gpu_worker.link._early.extend([P.encode(m)] for m in queue)
    gpu_worker.handle_prefill(jobs["a"])
    assert batches == [3]                 # a, b, c: late is over the budget; bad failed before the batch ran
    done = {m.request_id: m for m in gpu_worker.sent if isinstance(m, P.Prefilled)}
    assert sorted(done) == ["a", "b", "bad", "c"] and "must end with a snapshot" in done["bad"].error
    assert {done[r].batch_tokens for r in "abc"} == {len(PROMPT) + 8 + len(MORE)}
    arena = gpu_worker.link.arena
    for rid in "abc":
        want = ReferenceEngine(tiny).forward(prompts[rid], ReferenceEngine(tiny).new_state())
        for k, ref in enumerate(slots[rid]):              # every snapshot with a state, the chain its own
            if ref.state < 0:
                assert not any(arena.state_slot(ref.slot)), "a KV link got a state"
                continue
            state = _restore(tiny, arena, slots[rid][:k + 1])
            assert state.position == ref.position
            assert_close(state.logits, want[ref.position - 1], GPU_RTOL, floor=1.0)
            engine = ReferenceEngine(tiny, kv_cache_dtype="f16")
            there = engine.new_state()
            engine.forward(prompts[rid][:ref.position], there)
            assert_close(state.ssm, there.ssm, GPU_RTOL, floor=0.1)
    left = [P.decode(f[0], P.TO_WORKER) for f in gpu_worker.link._early]
    assert left == [P.Stop(request_id="x"), jobs["late"]]


def test_the_gpu_worker_announces_its_kind_device_and_rate(tiny_q4_path, monkeypatch):
    """Its Hello, read by a stand-in coordinator: kind gpu, the device's name, the
    prefill rate it measured; then the Welcome is answered with Attached."""
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = GPUWorker(str(tiny_q4_path), f"tcp://127.0.0.1:{port}", "gpu-hello", probe_tokens=[8])
    try:
        worker.link.hello(os.getpid(), 1, worker.model.fingerprint, kind="gpu", device=worker.engine.device.name,
                          prefill_tok_s=round(worker.prefill_rate()[0], 1))
        assert router.poll(10000)
        wid, frame = router.recv_multipart()
        hello = P.decode(frame, P.FROM_WORKER)
        assert (wid, hello.kind, hello.device) == (b"gpu-hello", "gpu", worker.engine.device.name)
        assert hello.prefill_tok_s > 0 and hello.fingerprint == worker.model.fingerprint
    finally:
        worker.close()
        router.close()


def test_the_worker_link_reports_what_it_cannot_take():
    """Over a real socket: a Welcome is answered with Attached (no arena offered); a
    message with stray data frames and one this worker kind does not take are reported
    to the coordinator as errors, and the link goes on."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    configured, handled = [], []
    link = WorkerLink(f"tcp://127.0.0.1:{port}", "w1", configured.append)
    try:
        link.hello(1, 1, "fp")
        assert router.poll(5000) and P.decode(router.recv_multipart()[1], P.FROM_WORKER).worker_id == "w1"

        def exchange(*frames) -> P.Error | P.Attached:
            router.send_multipart([b"w1", *frames])
            assert link.serve({P.Stop: lambda m, d: handled.append(m)}, 5000)
            assert router.poll(5000)
            return P.decode(router.recv_multipart()[1], P.FROM_WORKER)

        welcome = P.Welcome(arena="", slot_bytes=0, n_slots=0, state_slot_bytes=0, n_state_slots=0, block=BLOCK,
                            kv_cache_dtype="f32")
        assert exchange(P.encode(welcome)) == P.Attached(arena=False) and configured == ["f32"]
        assert "Stop came with 1 data frames" in exchange(P.encode(P.Stop(request_id="r")), b"x").message
        prefill = P.Prefill(request_id="r", tokens=[1], resume=[], snapshots=[])
        assert "does not take Prefill messages" in exchange(P.encode(prefill)).message
        router.send_multipart([b"w1", P.encode(P.Stop(request_id="r"))])
        assert link.serve({P.Stop: lambda m, d: handled.append(m)}, 5000) and handled == [P.Stop(request_id="r")]
        bad = P.Welcome(arena="", slot_bytes=0, n_slots=0, state_slot_bytes=0, n_state_slots=0, block=BLOCK,
                        kv_cache_dtype="f8")
        assert "f8" in exchange(P.encode(bad)).message and configured == ["f32"]
    finally:
        link.sock.close()
        router.close()


def test_a_long_prefill_heartbeats_and_stops_between_passes(tiny_q4_path, tiny, arena):
    """Over a real socket: while a prefill of many passes runs, the worker heartbeats
    (running 1), and a Stop of it ends it at the next pass with a Prefilled naming why;
    a Stop of another request does not."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = GPUWorker(str(tiny_q4_path), f"tcp://127.0.0.1:{port}", "gpu-long", device=open_test_device("emulate"),
                       probe_tokens=[8])
    worker.link.arena, worker.link.block = arena, BLOCK
    worker.link.slot_bytes, worker.link.state_slot_bytes = arena.slot_bytes, arena.state_slot_bytes
    worker.engine.max_pass_tokens = 8                     # 64 tokens: 8 passes
    prompt = (PROMPT + MORE + PROMPT)[:64]
    job = P.Prefill(request_id="long", tokens=prompt, resume=[], snapshots=_refs(0, range(8, 65, 8)))
    runner = threading.Thread(target=worker.handle_prefill, args=(job,))
    try:
        runner.start()

        def next_message():
            assert router.poll(30000), "the worker fell silent"
            return P.decode(router.recv_multipart()[1], P.FROM_WORKER)
        msg = next_message()
        while not isinstance(msg, P.Heartbeat):
            msg = next_message()
        assert msg.running == 1
        router.send_multipart([b"gpu-long", P.encode(P.Stop(request_id="other"))])
        router.send_multipart([b"gpu-long", P.encode(P.Stop(request_id="long"))])
        while not isinstance(msg, P.Prefilled):
            msg = next_message()
        assert msg.request_id == "long" and "PrefillStopped: stopped after" in msg.error
        assert "of 64 tokens" in msg.error and "after 64" not in msg.error
        runner.join(30)
        served = []
        handlers = {P.Stop: lambda m, d: served.append(m.request_id)}
        while worker.link.serve(handlers, 0):             # what came meanwhile is served after
            pass
        assert served == ["other", "long"]
    finally:
        runner.join(30)
        worker.link.arena = None                          # the fixture's, closed there
        worker.close()
        router.close()


@pytest.mark.parametrize("kind", DEVICES)
def test_with_a_tower_the_images_run_on_the_gpu(tiny, tiny_q4_path, tmp_path, kind):
    """--mmproj: the tower goes on the worker's device before the prefill engine, out of its
    --gpu-mem; a Prefill's image is encoded there (the reference's tokens); a budget the
    tower alone fills is refused."""
    import io

    from PIL import Image

    from gpu_worker.vision import GPUVisionEngine
    from shared.errors import FermoeError
    from shared.vision.image import load
    from shared.vision.reference import encode_image
    from modeltools.vision.synth import RandomTower, preset_config, synth_mmproj
    from tests.vision.test_gpu_tower import TOWER_RTOL
    path = tmp_path / "mmproj.gguf"
    cfg = preset_config("tiny", projection_dim=tiny.config.n_embd)
    synth_mmproj(path, cfg, "f32", seed=1)
    device = open_test_device(kind)
    budget = device.mem_get_info()[0] // 2
    worker = GPUWorker(str(tiny_q4_path), "tcp://127.0.0.1:9", "gpu-mm", device=device, probe_tokens=[8],
                       gpu_mem=budget, mmproj=str(path))
    try:
        assert isinstance(worker.vision, GPUVisionEngine) and worker.vision.device is worker.engine.device
        assert worker.engine.budget == budget - worker.vision.nbytes
        rgb = np.random.default_rng(3).integers(0, 256, (64, 256, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "PNG")
        pixels, (gh, gw) = load(buf.getvalue(), cfg)
        n = gh * gw // 4
        tokens = (PROMPT * 8)[:n + 10]
        msg = P.Prefill(request_id="img", tokens=tokens, resume=[], snapshots=_refs(0, [len(tokens)]),
                        images=[P.ImageInput(data=buf.getvalue(), start=4, rows=gh // 2, cols=gw // 2)])
        media = worker.media(msg, 0)
        want = encode_image(RandomTower(cfg, seed=1), pixels, (gh, gw))
        assert_close(media.embeds, want, TOWER_RTOL, floor=0.1)
        assert list(media.rows) == list(range(4, 4 + n))
    finally:
        worker.close()
    with pytest.raises(FermoeError, match="the vision tower alone takes"):
        GPUWorker(str(tiny_q4_path), "tcp://127.0.0.1:9", "gpu-mm", device=open_test_device(kind), probe_tokens=[8],
                  gpu_mem=1 << 20, mmproj=str(path))


def test_a_device_error_fails_the_batch_and_the_worker_serves_on(gpu_worker, monkeypatch):
    """An error out of the engine (not a Stop) is logged and fails every prompt of the
    batch with its message; the next Prefill runs."""
    prefill_batch = gpu_worker.engine.prefill_batch

    def broken(jobs, *a):
        raise RuntimeError("the device fell over")
    monkeypatch.setattr(gpu_worker.engine, "prefill_batch", broken)
    gpu_worker.handle_prefill(P.Prefill(request_id="a", tokens=PROMPT, resume=[], snapshots=_refs(0, [8, 30])))
    assert gpu_worker.sent[-1].request_id == "a" and "RuntimeError: the device fell over" in gpu_worker.sent[-1].error
    assert not any(isinstance(m, P.SnapshotWritten) for m in gpu_worker.sent)
    monkeypatch.setattr(gpu_worker.engine, "prefill_batch", prefill_batch)
    gpu_worker.handle_prefill(P.Prefill(request_id="b", tokens=PROMPT[:8], resume=[], snapshots=_refs(0, [8])))
    assert gpu_worker.sent[-1] == P.Prefilled(request_id="b", prefill_ms=gpu_worker.sent[-1].prefill_ms,
                                              batch_tokens=8)
