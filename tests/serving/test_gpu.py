"""A coordinator with a GPU worker (the host emulation of the kernels, FERMOE_GPU=emulate):
prompts prefilled on it, decoded by a CPU worker from the snapshot it leaves in the
store, with the tokens a CPU-only run samples; the cache and --prefill decide when
the GPU is used."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from coordinator.client import Client
from coordinator.supervisor import MAX_RESTARTS
from tests.support.bench_keys import assert_keys_documented
from tests.support.serving_harness import (Daemon, free_port, local_ids, replies_within, requests_lost, shm_names,
                                          streamed_ids, wait_until)

# A request's wait for its next reply once a GPU worker has failed or died: its prompt runs
# on a CPU worker in seconds; a fault that leaves it waiting fails the test after this, not
# after the client's timeout.
FAILED_OVER_S = 60
DROPPED_S = 10              # for the daemon to drop a worker whose process it saw die
NEAR_TIE = 0.1             # logits: above what rounding the activations moves them by on the tiny model
PROMPT = "A long enough prompt, prefilled on the graphics card and then decoded on the CPU."


@pytest.fixture(autouse=True)
def emulated_gpu(monkeypatch):
    monkeypatch.setenv("FERMOE_GPU", "emulate")


def gpu_ready(daemon) -> dict:
    """The daemon's workers by id, once its GPU worker has joined (it compiles the
    emulation and times a prompt first)."""
    def joined():
        if any("worker gpu0 died" in line for line in daemon.log):   # restarted, or given up: never in time
            raise AssertionError("the GPU worker died while starting")
        return {w.worker_id: w for w in c.status().workers if w.alive}.get("gpu0") and \
            {w.worker_id: w for w in c.status().workers}
    with Client(daemon.addr) as c:
        try:
            return wait_until(joined, 300, "the GPU worker never joined")
        except AssertionError as e:
            raise AssertionError(f"{e}; the daemon's log:\n{''.join(daemon.log)}") from None


def assert_greedy_as_cpu_only(model_path, prompt: str, ids: list[int]) -> None:
    """The greedy tokens of a CPU-only run, tie-aware: the GPU prefills with fp32
    activations where the CPU engine rounds them to 8 bits (W4A8), so the state it hands
    over differs by that rounding; the streams may part only where the CPU-only run's
    two best logits were within NEAR_TIE of each other."""
    from cpu_worker.native_engine import NativeEngine
    from shared.model import Model
    model = Model(str(model_path))
    engine = NativeEngine(model, threads=1)
    try:
        state, history = engine.new_state(), model.tokenizer.encode(prompt)
        logits = engine.forward(history, state, all_logits=False)[-1]
        for i, token in enumerate(ids):
            best = int(np.argmax(logits))
            if token != best:
                margin = logits[best] - logits[token]
                assert margin < NEAR_TIE, f"token {i}: {token} where CPU-only took {best}, {margin:.3f} ahead"
                return
            logits = engine.forward([token], state, all_logits=False)[-1]
    finally:
        engine.close()


def generate(daemon, prompt, **params):
    with Client(daemon.addr, timeout_s=300) as c:
        msgs = list(c.generate(prompt, **params))
    return streamed_ids(msgs), msgs[-1]


def test_a_prompt_prefilled_on_the_gpu_is_decoded_on_a_cpu_worker(tiny_q4_path):
    """--prefill gpu: the GPU worker is listed with its device and rate; the prompt runs
    there, a CPU worker decodes from its final snapshot and samples what `fermoe generate
    --engine cpu` samples; the same prompt again, and extended, reuse the cache: the
    repeat needs no prefill at all, the extension only its new tokens (on the GPU)."""
    daemon = Daemon(tiny_q4_path, "--gpu", "auto", "--prefill", "gpu")
    try:
        workers = gpu_ready(daemon)
        gpu = workers["gpu0"]
        assert (gpu.kind, gpu.device, gpu.alive) == ("gpu", "host emulation", True) and gpu.prefill_tok_s > 0
        assert all(w.kind == "cpu" and w.prefill_tok_s > 0 for k, w in workers.items() if k != "gpu0")

        params = dict(max_tokens=12, ignore_eos=True, temperature=0.0)
        with Client(daemon.addr) as c:
            before = c.status().snapshots
        ids, done = generate(daemon, PROMPT, **params)
        with Client(daemon.addr) as c:
            after = c.status().snapshots         # the hand-over's lookup is neither a hit nor a replay
        assert (after["hits"], after["replays"], after["misses"]) == (before["hits"], before["replays"],
                                                                      before["misses"] + 1)
        assert done.prefill_device == "gpu" and done.cached_prompt_tokens == 0 and done.finish_reason == "length"
        assert done.prefill_ms > 0 and "gpu" in done.prefill_estimates_ms
        assert_greedy_as_cpu_only(tiny_q4_path, PROMPT, ids)

        again_ids, again = generate(daemon, PROMPT, **params)
        assert again_ids == ids and again.prefill_device is None
        assert again.cached_prompt_tokens == again.prompt_tokens

        longer = PROMPT + " And a few more words."
        _, extended = generate(daemon, longer, **params)
        assert extended.prefill_device == "gpu" and extended.cached_prompt_tokens == again.prompt_tokens
        gpu_lines = [line for line in daemon.log if "gpu worker gpu0" in line and "joined" in line]
        assert gpu_lines, "".join(daemon.log)
        # one copy of the experts: packed into shared memory, every worker reading them there
        packed = [line for line in daemon.log if "experts packed into shared memory" in line]
        assert len(packed) == 1 and len(shm_names(daemon.proc.pid)) == 2, "".join(daemon.log)
        segment = packed[0].split("shared memory ")[1].split(":")[0]
        for w in workers.values():
            with open(f"/proc/{w.pid}/cmdline", "rb") as f:
                assert f"--shared-experts\0{segment}\0".encode() in f.read(), w.worker_id
            with open(f"/proc/{w.pid}/maps") as f:
                assert f"/dev/shm/{segment}" in f.read(), f"{w.worker_id} does not map the experts"
    finally:
        assert daemon.stop() == 0
    assert not shm_names(daemon.proc.pid), "SIGTERM left a shared-memory segment"


def test_prompts_waiting_for_the_gpu_share_a_batch_while_generations_run_on(tiny_q4_path):
    """--prefill gpu: prompts sent together are prefilled in fewer batches than prompts
    (those waiting behind the first go in one), each decoded as a CPU-only run decodes it;
    a generation already running on a CPU worker streams on while they prefill."""
    import threading
    import time
    daemon = Daemon(tiny_q4_path, "--gpu", "auto", "--prefill", "gpu")
    try:
        gpu_ready(daemon)
        stamps = []

        def running():
            with Client(daemon.addr, timeout_s=300) as c:
                for m in c.generate("Once", max_tokens=3000, ignore_eos=True, temperature=0.0):
                    stamps.append(time.monotonic())
        long = threading.Thread(target=running)
        long.start()
        wait_until(lambda: len(stamps) > 1, 120, "the long generation's first tokens")
        prompts = [f"{PROMPT} Variation {i} of four." for i in range(4)]
        out, threads = {}, [threading.Thread(target=lambda p=p: out.__setitem__(p, generate(
            daemon, p, max_tokens=6, ignore_eos=True, temperature=0.0))) for p in prompts]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        t1 = time.monotonic()
        dones = [out[p][1] for p in prompts]
        assert all(d.prefill_device == "gpu" and d.finish_reason == "length" for d in dones), dones
        assert max(d.prefill_batch for d in dones) >= 2, [d.prefill_batch for d in dones]
        for p in prompts:
            assert_greedy_as_cpu_only(tiny_q4_path, p, out[p][0])
        during = [t for t in stamps if t0 < t < t1]
        assert len(during) >= 10, f"{len(during)} tokens of the running generation while the prompts prefilled"
        long.join(300)
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("mode", ["cpu", "auto"])
def test_prefill_cpu_never_uses_the_gpu_and_auto_says_what_it_chose(tiny_q4_path, mode):
    daemon = Daemon(tiny_q4_path, "--gpu", "auto", "--prefill", mode)
    try:
        gpu_ready(daemon)
        ids, done = generate(daemon, PROMPT, max_tokens=6, temperature=0.0)
        assert done.prefill_device in (("cpu",) if mode == "cpu" else ("cpu", "gpu"))
        if mode == "auto":       # both were estimated, and the faster one taken
            est = done.prefill_estimates_ms
            assert set(est) == {"gpu", "cpu"} and done.prefill_device == min(est, key=est.get)
        assert_greedy_as_cpu_only(tiny_q4_path, PROMPT, ids)
    finally:
        assert daemon.stop() == 0


def test_impossible_gpu_options_are_refused(tiny_q4_path, monkeypatch):
    for env, args, problem in [
        ("emulate", ["--gpu", "3"], "--gpu 3: this machine's GPUs are [0]"),
        ("emulate", ["--gpu", "x"], "--gpu 'x': expected auto, none or device indices"),
        ("emulate", ["--prefill", "tpu"], "--prefill 'tpu': expected auto, gpu, cpu"),
        ("emulate", ["--gpu-mem", "0"], "--gpu-mem 0: must be positive"),
        ("emulate", ["--gpu", "none", "--prefill", "gpu"], "--prefill gpu: no GPU to prefill on (--gpu none)"),
        ("tpu", ["--prefill", "gpu"], "--prefill gpu: no GPU to prefill on (FERMOE_GPU='tpu' is not emulate)"),
    ]:
        monkeypatch.setenv("FERMOE_GPU", env)
        out = subprocess.run([sys.executable, "-m", "coordinator.daemon", "--model", str(tiny_q4_path), *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and problem in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_prefill_the_gpu_cannot_hold_fails_over_to_a_cpu_worker(tiny_q4_path):
    """--gpu-mem just enough for the GPU worker's first plan: a longer prompt does not fit
    there (as an out-of-memory would fail), is prefilled on a CPU worker instead with the
    reason logged, and samples exactly the CPU-only tokens; a short one still goes to the GPU.
    Fault guarded: the request placed on the GPU worker again after it failed there, and
    again after each failure; the test fails at the second failure, not after the client's
    timeout."""
    budget = smallest_gpu_mem(tiny_q4_path)

    def failures(rid):
        return sum(f"request {rid}: its prefill on gpu0 failed" in line for line in daemon.log)
    daemon = Daemon(tiny_q4_path, "--gpu", "auto", "--prefill", "gpu", "--gpu-mem", str(budget))
    try:
        gpu_ready(daemon)
        long = [3 + i % 500 for i in range(200)]
        with Client(daemon.addr, timeout_s=300) as c:
            rid = c.submit(tokens=long, max_tokens=6, temperature=0.0)
            # a prompt placed on the GPU worker again after it failed there would fail for ever
            msgs = replies_within(c, rid, FAILED_OVER_S, lambda: f"its prefill failed on gpu0 {failures(rid)} "
                                  "time(s): not re-run on a CPU worker", daemon.log,
                                  stuck=lambda: f"sent back to gpu0 after it failed there ({failures(rid)} failures)"
                                  if failures(rid) > 1 else None)
            short = list(c.generate(tokens=long[:20], max_tokens=2, temperature=0.0))[-1]
        assert msgs[-1].prefill_device == "cpu" and msgs[-1].finish_reason == "length"
        assert streamed_ids(msgs) == local_ids(tiny_q4_path, long, 6, temperature=0.0)
        assert any("its prefill on gpu0 failed" in line and "too small" in line for line in daemon.log)
        assert failures(rid) == 1 and short.prefill_device == "gpu"
    finally:
        assert daemon.stop() == 0


def test_a_gpu_worker_killed_mid_prefill_is_restarted_and_its_request_completes(tiny_q4_path):
    """Its request is prefilled on a CPU worker and samples the CPU-only tokens; the GPU
    worker comes back. Faults that leave the request waiting for ever (the dead worker not
    dropped, its request left on it or on its restarted successor) fail the test in
    seconds, naming which, not after the client's timeout."""
    daemon = Daemon(tiny_q4_path, "--gpu", "auto", "--prefill", "gpu")
    try:
        old = gpu_ready(daemon)["gpu0"].pid
        prompt = [3 + i % 500 for i in range(400)]           # seconds of emulated prefill
        with Client(daemon.addr, timeout_s=300) as c:
            rid = c.submit(tokens=prompt, max_tokens=4, temperature=0.0)
            wait_until(lambda: any(w.worker_id == "gpu0" and w.running for w in c.status().workers), 60,
                       "the prompt never reached the GPU worker")
            os.kill(old, signal.SIGKILL)
            killed, lost = time.monotonic(), requests_lost(c)

            def still_listed():         # the daemon reaps its children at once: a while is a fault
                if time.monotonic() - killed > DROPPED_S and any(w.pid == old for w in c.status().workers):
                    return f"gpu0 (pid {old}) was killed {DROPPED_S} s ago and the daemon still lists it"
                return None
            msgs = replies_within(c, rid, FAILED_OVER_S, lambda: "gpu0 was killed while prefilling it and it was "
                                  "not re-run on a CPU worker (listed now, with the requests each runs: "
                                  f"{[(w.worker_id, w.pid, w.running) for w in c.status().workers]})", daemon.log,
                                  stuck=lambda: still_listed() or lost())
            assert msgs[-1].finish_reason == "length" and msgs[-1].prefill_device == "cpu"
            assert streamed_ids(msgs) == local_ids(tiny_q4_path, prompt, 4, temperature=0.0)
            assert any(f"request {rid} was prefilling on gpu0" in line for line in daemon.log), "".join(daemon.log)
            wait_until(lambda: any(w.worker_id == "gpu0" and w.alive and w.pid != old for w in c.status().workers),
                       300, "the GPU worker was not restarted")
    finally:
        assert daemon.stop() == 0


def smallest_gpu_mem(model_path) -> int:
    """The least --gpu-mem (to 64 KiB) a GPU engine on the model starts with."""
    from gpu_worker.emulator import EmulatedDevice
    from gpu_worker.engine import GPUEngine
    from shared.errors import FermoeError
    from shared.model import Model
    model, lo, hi = Model(str(model_path)), 1 << 20, 1 << 30
    while hi - lo > 1 << 16:
        mid = (lo + hi) // 2
        try:
            GPUEngine(model, gpu_mem=mid, device=EmulatedDevice()).close()
            hi = mid
        except FermoeError:
            lo = mid
    return hi


def test_bench_serve_with_a_gpu_worker(tiny_q4_path):
    from bench.serve import run as bench_serve
    out = bench_serve(str(tiny_q4_path), prompt_tokens=40, decode_tokens=4,
                      extra=["--block", "8", "--gpu", "auto", "--prefill", "gpu"])
    assert out["prefill_device"] == {"cold": "gpu", "extended16": "gpu"}
    assert out["cached_tokens"] == {"cold": 0, "repeated": 40, "extended16": 40}
    assert 0 < out["cold_prefill_s"] < out["ttft_cold_s"] and out["cold_rest_s"] > 0
    assert {w["kind"] for w in out["workers_detail"]} == {"cpu", "gpu"}
    burst = out["cold_burst"]            # sent at once: those waiting behind the first share a batch
    assert burst["prefill_device"] == ["gpu"] * 4 and max(burst["prefill_batch"]) >= 2
    assert 0 < burst["ttft_s"][-1] <= burst["last_first_token_s"]
    memory = out["host_memory"]      # every process of the daemon, at its fullest
    assert {"coordinator.daemon", "cpu_worker.worker", "gpu_worker.worker"} <= set(memory["peak_by_process_gib"])
    assert memory["peak_gib"] == pytest.approx(sum(memory["peak_by_process_gib"].values()), abs=0.05)
    import bench.serve
    assert_keys_documented(out, bench.serve)


def test_a_gpu_worker_that_keeps_failing_is_given_up_and_prompts_stay_on_the_cpu(tiny_q4_path):
    """A GPU worker that cannot start (here: --gpu-mem too small for its weights) is
    restarted within the restart budget, then given up; requests are served throughout,
    prefilled on the CPU."""
    daemon = Daemon(tiny_q4_path, "--gpu", "auto", "--gpu-mem", "1MiB")
    try:
        wait_until(lambda: any("gpu0 died" in line and "not restarting it" in line for line in daemon.log), 300,
                   "the failing GPU worker was never given up")
        ids, done = generate(daemon, PROMPT, max_tokens=4, temperature=0.0)
        assert done.prefill_device == "cpu" and ids == local_ids(tiny_q4_path, PROMPT, 4, temperature=0.0)
        assert sum("started gpu worker gpu0" in line for line in daemon.log) == 1 + MAX_RESTARTS
    finally:
        assert daemon.stop() == 0


def test_the_http_api_on_top(tiny_q4_path):
    """An OpenAI request over HTTP is prefilled on the GPU worker; /metrics counts where
    prompts were prefilled, on what estimate, and each worker's rate."""
    import httpx
    port = free_port()
    daemon = Daemon(tiny_q4_path, "--gpu", "auto", "--prefill", "gpu", "--http", f"127.0.0.1:{port}")
    try:
        gpu_ready(daemon)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "the front end never became healthy")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(f"{url}/metrics").text
        assert 'fermoe:prefills_total{device="gpu"} 1.0' in metrics
        assert 'fermoe:prefill_estimate_seconds_count{device="gpu"} 1.0' in metrics
        assert 'fermoe:worker_prefill_tokens_per_second{kind="gpu",worker_id="gpu0"}' in metrics
    finally:
        assert daemon.stop() == 0


@pytest.mark.gpu
def test_on_the_cuda_device_a_served_prompt_is_prefilled_there_and_decoded_on_the_cpu(tiny_q4_path, monkeypatch):
    """The end-to-end path above on the real device (the GPU machine: `pytest -m gpu`)."""
    from shared.devices import gpu_devices
    monkeypatch.delenv("FERMOE_GPU")
    found, why = gpu_devices()
    if not found:
        pytest.skip(f"no CUDA device here: {why}")
    daemon = Daemon(tiny_q4_path, "--gpu", "0", "--prefill", "gpu")
    try:
        gpu = gpu_ready(daemon)["gpu0"]
        assert gpu.kind == "gpu" and gpu.device != "host emulation" and gpu.prefill_tok_s > 0
        params = dict(max_tokens=12, ignore_eos=True, temperature=0.0)
        ids, done = generate(daemon, PROMPT, **params)
        assert done.prefill_device == "gpu" and done.finish_reason == "length"
        assert_greedy_as_cpu_only(tiny_q4_path, PROMPT, ids)
        again_ids, again = generate(daemon, PROMPT, **params)
        assert again_ids == ids and again.cached_prompt_tokens == again.prompt_tokens
    finally:
        assert daemon.stop() == 0
    assert not shm_names(daemon.proc.pid)
