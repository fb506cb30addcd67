"""--decode hybrid in a real daemon (the GPU emulated, FERMOE_GPU=emulate): a CPU worker's
decode steps run their dense part on the GPU worker and their routed experts on the CPU
worker, through the mailbox the coordinator pairs them by; either worker killed mid-
generation, the request still ends with its tokens."""
from __future__ import annotations

import os
import re
import signal

import pytest

from coordinator.client import Client
from tests.serving.test_gpu import PROMPT, assert_greedy_as_cpu_only, gpu_ready, smallest_gpu_mem
from tests.support.serving_harness import Daemon, replies_within, streamed_ids, wait_until

KILLED_S = 60               # a request's wait for its next reply once a worker of it is killed


@pytest.fixture(autouse=True)
def emulated_gpu(monkeypatch):
    monkeypatch.setenv("FERMOE_GPU", "emulate")


@pytest.fixture(scope="module")
def budget(tiny_q4_path) -> str:
    """A --gpu-mem that keeps no expert layer resident: every layer's experts go to the CPU."""
    return str(smallest_gpu_mem(tiny_q4_path))


def hybrid_daemon(path, budget, decode="hybrid"):
    return Daemon(path, "--gpu", "auto", "--prefill", "gpu", "--gpu-mem", budget, "--decode", decode,
                  "--cpu-workers-per-socket", "1")


def paired(daemon) -> None:
    wait_until(lambda: any("decodes with gpu0" in line for line in daemon.log), 60,
               "the coordinator never paired the CPU worker with the GPU worker")


@pytest.mark.parametrize("kind", ["emulate", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_steps_run_on_the_gpu_worker_with_the_cpus_experts(tiny_q4_path, budget, kind, monkeypatch):
    """Guards the pairing and the steps: the request says its decode was hybrid, its greedy
    tokens are the CPU-only run's (tie-aware: the dense part in fp32 there), and the same
    prompt again decodes the same tokens from the cache. On the CUDA device too (`-m gpu`)."""
    if kind == "cuda":
        from shared.devices import gpu_devices
        monkeypatch.delenv("FERMOE_GPU")
        found, why = gpu_devices()
        if not found:
            pytest.skip(f"no CUDA device here: {why}")
    daemon = hybrid_daemon(tiny_q4_path, budget)
    try:
        gpu_ready(daemon)
        paired(daemon)
        params = dict(max_tokens=10, ignore_eos=True, temperature=0.0)
        with Client(daemon.addr, timeout_s=300) as c:
            msgs = list(c.generate(PROMPT, **params))
            again = list(c.generate(PROMPT, **params))
        done = msgs[-1]
        assert (done.finish_reason, done.prefill_device, done.decode_device) == ("length", "gpu", "hybrid"), done
        assert_greedy_as_cpu_only(tiny_q4_path, PROMPT, streamed_ids(msgs))
        assert streamed_ids(again) == streamed_ids(msgs) and again[-1].decode_device == "hybrid"
        assert any("serving the decode steps of cpu0.0" in line for line in daemon.log), "".join(daemon.log)
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("victim", ["gpu0", "cpu0.0"])
def test_a_worker_killed_mid_generation_costs_no_request(tiny_q4_path, budget, victim):
    """Guards the fallbacks: the GPU worker killed while it runs a sequence's steps, the CPU
    worker decodes it alone from its last whole state (the steps since run again), and once
    the GPU worker is restarted, with it again; the CPU worker killed, the coordinator replays
    the request and the GPU worker serves on."""
    daemon = hybrid_daemon(tiny_q4_path, budget)
    try:
        gpu_ready(daemon)
        paired(daemon)
        with Client(daemon.addr, timeout_s=300) as c:
            workers = {w.worker_id: w for w in c.status().workers}
            rid = c.submit(prompt=PROMPT, max_tokens=24, ignore_eos=True, temperature=0.0)
            first = []
            for msg in c.stream(rid):               # 4 tokens: decoding by now
                first.append(msg)
                if len(streamed_ids(first)) == 4:
                    break
            os.kill(workers[victim].pid, signal.SIGKILL)
            msgs = first + replies_within(c, rid, KILLED_S, lambda: f"{victim} was killed mid-generation and the "
                                          "request never ended", daemon.log)
        done = msgs[-1]
        assert done.finish_reason == "length" and done.completion_tokens == 24, done
        assert_greedy_as_cpu_only(tiny_q4_path, PROMPT, streamed_ids(msgs))
        if victim == "cpu0.0":          # the coordinator removes the mailbox its killed creator could not
            wait_until(lambda: not any(n.startswith(f"fermoe_hybrid-{workers[victim].pid}-")
                                       for n in os.listdir("/dev/shm")), 30, "the killed CPU worker's mailbox stayed")
        if victim == "gpu0":            # the GPU worker restarted, the CPU worker's new mailbox paired with it
            assert any("a hybrid step failed" in line for line in daemon.log), "".join(daemon.log)
            wait_until(lambda: sum("cpu0.0 decodes with gpu0" in line for line in daemon.log) == 2, 120,
                       "the restarted GPU worker was never paired with the CPU worker's new mailbox")
            with Client(daemon.addr, timeout_s=300) as c:
                assert list(c.generate(PROMPT, max_tokens=3, temperature=0.0))[-1].decode_device == "hybrid"
    finally:
        assert daemon.stop() == 0


def test_impossible_decode_options_are_refused(tiny_q4_path, monkeypatch):
    """Guards --decode: hybrid or auto without a GPU, or with an engine that has no W4A8
    experts, is refused naming why; a mode that does not exist is argparse's refusal."""
    from coordinator.options import parse_options
    from shared.errors import FermoeError
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    for args, problem in [(["--gpu", "none", "--decode", "hybrid"], "--decode hybrid: needs a GPU worker"),
                          (["--gpu", "none", "--decode", "auto"], "--decode auto: needs a GPU worker"),
                          (["--engine", "reference", "--decode", "hybrid"], "and --engine cpu")]:
        with pytest.raises(FermoeError, match=re.escape(problem)):
            parse_options(["--model", str(tiny_q4_path), "--snapshot-disk", "0", *args])
    with pytest.raises(SystemExit):
        parse_options(["--model", str(tiny_q4_path), "--decode", "gpu"])
    assert parse_options(["--model", str(tiny_q4_path), "--snapshot-disk", "0", "--decode", "auto"]).decode == "auto"


def test_decode_auto_takes_the_faster_way_per_request(tiny_q4_path, budget):
    """Guards --decode auto: the first request decodes hybrid (not yet timed), the second on
    the CPU (not yet timed), then the faster: the CPU, where the GPU is emulated on it."""
    daemon = hybrid_daemon(tiny_q4_path, budget, decode="auto")
    try:
        gpu_ready(daemon)
        paired(daemon)
        with Client(daemon.addr, timeout_s=300) as c:
            ways = [list(c.generate(f"{PROMPT} {i}", max_tokens=6, ignore_eos=True, temperature=0.0))[-1].decode_device
                    for i in range(3)]
        assert ways == ["hybrid", "cpu", "cpu"], ways
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("cpu_ms, hybrid_ms, hybrid", [(0, 0, True), (5.0, 0, True), (0, 9.0, False),
                                                        (5.0, 9.0, False), (9.0, 5.0, True)])
def test_the_auto_choice(cpu_ms, hybrid_ms, hybrid):
    """The rule itself: a way not yet timed (0) is tried, the hybrid first; then the faster."""
    from cpu_worker.worker import decode_hybrid_faster
    assert decode_hybrid_faster(cpu_ms, hybrid_ms) is hybrid
