"""Where a prompt is prefilled (coordinator/placement.py), and what the workers measure
at start to decide it by (shared/engine.measure_prefill_rate), on fake workers and a
fake clock."""
from __future__ import annotations

import types

import pytest

from coordinator.placement import GPU_QUEUE, Placement, place_prefill
from coordinator.scheduler import WorkerView
from shared import engine as engine_module
from shared.engine import measure_prefill_rate
from shared.errors import FermoeError

GPU = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=3000.0, prefill_fixed_ms=280.0)
CPU_TOK_S = 120.0


def test_a_short_prompt_stays_on_the_cpu_and_a_long_one_goes_to_the_gpu():
    """The GPU's fixed cost (streaming its expert layers) outweighs its rate for a few
    tokens: 16 tokens take 133 ms on the CPU and 285 ms on the GPU; 947 take 7.9 s and 0.6 s."""
    short = place_prefill("auto", 16, [GPU], CPU_TOK_S)
    assert short.device == "cpu" and short.estimates == pytest.approx({"gpu": 285.33, "cpu": 133.33}, abs=0.01)
    long = place_prefill("auto", 947, [GPU], CPU_TOK_S)
    assert (long.device, long.worker) == ("gpu", "gpu0")
    assert place_prefill("gpu", 16, [GPU], CPU_TOK_S).device == "gpu"          # overridden
    assert place_prefill("cpu", 947, [GPU], CPU_TOK_S).device == "cpu"
    assert place_prefill("auto", 947, [GPU], 0.0).device == "gpu"             # the CPU's rate unknown yet


def test_a_busy_gpu_queues_what_it_still_does_faster_and_a_full_one_makes_gpu_wait():
    """A prompt behind a running batch waits for it, then shares the next batch's fixed
    cost: 947 tokens behind 2000 queued ones take 2 x 280 + 2947 / 3 = 1542 ms on the GPU,
    still ahead of the CPU's 7.9 s; 16 tokens stay on the CPU (133 ms) while it is busy."""
    busy = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=3000.0, prefill_fixed_ms=280.0,
                      requests={"r"})
    queued = place_prefill("auto", 947, [busy], CPU_TOK_S, {"gpu0": 2000})
    assert queued.device == "gpu" and queued.estimates["gpu"] == pytest.approx(1542.33, abs=0.01)
    assert place_prefill("auto", 16, [busy], CPU_TOK_S, {"gpu0": 2000}).device == "cpu"
    assert place_prefill("auto", 947, [busy], 1000.0, {"gpu0": 2000}).device == "cpu"   # a CPU this fast: 947 ms
    full = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=3000.0, requests={f"r{i}" for i in range(8)})
    assert place_prefill("auto", 947, [full], CPU_TOK_S).device == "cpu"
    assert place_prefill("gpu", 947, [full], CPU_TOK_S) is None
    assert place_prefill("auto", 0, [GPU], CPU_TOK_S).device == "cpu"          # nothing to prefill
    faster = WorkerView("gpu1", ready=True, kind="gpu", prefill_tok_s=6000.0, prefill_fixed_ms=280.0)
    assert place_prefill("gpu", 947, [GPU, faster], CPU_TOK_S).worker == "gpu1"


def test_a_full_faster_gpu_leaves_the_prompt_to_a_free_slower_one():
    """Fault guarded: the fastest GPU worker picked among all of them, its queue full or
    not: a prompt sent to a full one waits behind all it holds, or is never taken, while
    another GPU worker is free. gpu0 (6000 tok/s) holding 7 prompts still wins, 947 tokens
    behind its 1000 queued take 2 x 280 + 1947 / 6 = 884.5 ms against gpu1's (1000 tok/s)
    280 + 947 = 1227; holding GPU_QUEUE prompts of as many tokens it is full, and gpu1
    takes the prompt."""
    assert GPU_QUEUE == 8

    def fast(n):
        return WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=6000.0, prefill_fixed_ms=280.0,
                          requests={f"r{i}" for i in range(n)})
    slow = WorkerView("gpu1", ready=True, kind="gpu", prefill_tok_s=1000.0, prefill_fixed_ms=280.0)
    for mode in ("auto", "gpu"):
        busy = place_prefill(mode, 947, [fast(7), slow], CPU_TOK_S, {"gpu0": 1000})
        assert (busy.device, busy.worker) == ("gpu", "gpu0")
        assert busy.estimates == pytest.approx({"gpu": 884.5, "cpu": 7891.67}, abs=0.01)
        full = place_prefill(mode, 947, [fast(8), slow], CPU_TOK_S, {"gpu0": 1000})
        assert (full.device, full.worker) == ("gpu", "gpu1")
        assert full.estimates == pytest.approx({"gpu": 1227.0, "cpu": 7891.67}, abs=0.01)


def test_images_count_at_each_kinds_tower_rate_once_both_are_known():
    """A prompt of 30 tokens with 256 image tokens: the text alone stays on the CPU (250 ms
    against 290); with a GPU tower of 2000 image tokens/s and a CPU one of 100, the images
    add 128 ms there and 2.56 s here: it goes to the GPU. Until both rates are known the
    images are left out; images the cache covers are not counted (the caller's)."""
    gpu = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=3000.0, prefill_fixed_ms=280.0, vision_tok_s=2000.0)
    text_only = place_prefill("auto", 30, [gpu], CPU_TOK_S)
    assert text_only.device == "cpu"
    both = place_prefill("auto", 30, [gpu], CPU_TOK_S, image_tokens=256, cpu_vision_tok_s=100.0)
    assert both.device == "gpu" and both.estimates == pytest.approx({"gpu": 418.0, "cpu": 2810.0}, abs=0.01)
    unknown_cpu = place_prefill("auto", 30, [gpu], CPU_TOK_S, image_tokens=256, cpu_vision_tok_s=0.0)
    unknown_gpu = place_prefill("auto", 30, [GPU], CPU_TOK_S, image_tokens=256, cpu_vision_tok_s=100.0)
    assert unknown_cpu.estimates == unknown_gpu.estimates == text_only.estimates
    fast_cpu_tower = place_prefill("auto", 30, [gpu], CPU_TOK_S, image_tokens=256, cpu_vision_tok_s=1e6)
    assert fast_cpu_tower.device == "cpu"


def test_what_goes_to_the_cpu_carries_the_cpus_estimate_alone():
    """Fault guarded: a prompt kept on the CPU (told so, nothing to prefill, no GPU worker,
    or every GPU worker full) reported without its CPU estimate, under another name, or
    with a null one when the CPU's rate is unknown. 960 tokens at 120 tok/s: 8000 ms."""
    full = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=3000.0, requests={f"r{i}" for i in range(8)})
    for placed in (place_prefill("cpu", 960, [GPU], CPU_TOK_S), place_prefill("auto", 960, [], CPU_TOK_S),
                   place_prefill("auto", 960, [full], CPU_TOK_S)):
        assert placed == Placement("cpu", None, {"cpu": 8000.0})
    assert place_prefill("auto", 0, [GPU], CPU_TOK_S) == Placement("cpu", None, {"cpu": 0.0})
    assert place_prefill("cpu", 960, [GPU], 0.0) == Placement("cpu", None, {})
    assert place_prefill("auto", 960, [full], 0.0) == Placement("cpu", None, {})


def test_a_one_token_prompt_is_prefilled_where_it_is_told():
    """Fault guarded: one token to prefill taken for nothing to prefill: --prefill gpu
    kept it on the CPU. On the GPU: 280 + 1 / 3 ms."""
    assert place_prefill("gpu", 1, [GPU], CPU_TOK_S) == Placement("gpu", "gpu0", {"gpu": 280.0 + 1 / 3,
                                                                                   "cpu": 1000 / 120})


def test_a_gpu_worker_of_unknown_rate_is_passed_over():
    """Fault guarded: the choice among GPU workers crashing on one whose rate is not
    measured yet (no estimate), or preferring it: gpu1, known, takes the prompt, 280 + 300."""
    unknown = WorkerView("gpu0", ready=True, kind="gpu", prefill_fixed_ms=280.0)
    known = WorkerView("gpu1", ready=True, kind="gpu", prefill_tok_s=3000.0, prefill_fixed_ms=280.0)
    assert place_prefill("gpu", 900, [unknown, known], CPU_TOK_S) == Placement("gpu", "gpu1", {"gpu": 580.0,
                                                                                               "cpu": 7500.0})


def test_a_tie_stays_on_the_cpu():
    """Fault guarded: a prompt sent to the GPU worker when it is no faster, paying the
    hand-off for nothing: 200 tokens take 100 + 200 / 2 = 200 ms on a GPU of 2000 tok/s and
    200 ms on a CPU of 1000."""
    gpu = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=2000.0, prefill_fixed_ms=100.0)
    assert place_prefill("auto", 200, [gpu], 1000.0) == Placement("cpu", None, {"gpu": 200.0, "cpu": 200.0})


def test_rates_below_a_token_a_second_are_still_rates():
    """Fault guarded: a rate at or under 1 tok/s (a slow CPU worker, a slow tower) taken
    as unknown: the estimate dropped or the image left out. 3 tokens on a CPU of 0.5
    tok/s: 6 s; one image token at 0.5 tok/s on the GPU's tower, 0.25 on the CPU's: 2 s
    and 4 s; the GPU then takes it (280 + 1 + 2000 against 6000 + 4000)."""
    gpu = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=3000.0, prefill_fixed_ms=280.0, vision_tok_s=0.5)
    assert place_prefill("auto", 3, [gpu], 0.5) == Placement("gpu", "gpu0", {"gpu": 281.0, "cpu": 6000.0})
    assert place_prefill("auto", 3, [gpu], 0.5, image_tokens=1, cpu_vision_tok_s=0.25) == \
        Placement("gpu", "gpu0", {"gpu": 2281.0, "cpu": 10000.0})


def test_images_are_counted_only_when_given_with_both_rates():
    """Fault guarded: the defaults counting an image that is not there (a text prompt
    once both towers have rates) or a CPU tower rate not measured: the estimates stay
    the text's, 290 ms on the GPU and 250 on the CPU for 30 tokens."""
    gpu = WorkerView("gpu0", ready=True, kind="gpu", prefill_tok_s=3000.0, prefill_fixed_ms=280.0, vision_tok_s=2000.0)
    text = Placement("cpu", None, {"gpu": 290.0, "cpu": 250.0})
    assert place_prefill("auto", 30, [gpu], CPU_TOK_S, cpu_vision_tok_s=100.0) == text
    assert place_prefill("auto", 30, [gpu], CPU_TOK_S, image_tokens=256) == text


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _Engine:
    """A prompt of n tokens takes fixed_s + n / tok_s on the fake clock; over max_tokens
    it does not fit."""

    def __init__(self, clock, fixed_s, tok_s, max_tokens=1 << 20):
        self.clock, self.fixed_s, self.tok_s, self.max_tokens, self.runs = clock, fixed_s, tok_s, max_tokens, []

    def new_state(self):
        return None

    def forward(self, tokens, state, all_logits=True):
        if len(tokens) > self.max_tokens:
            raise FermoeError("does not fit")
        self.runs.append(len(tokens))
        self.clock.now += self.fixed_s + len(tokens) / self.tok_s


@pytest.fixture
def clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


CFG = types.SimpleNamespace(n_ctx_train=4096, n_vocab=512)


def test_the_probe_fits_a_fixed_cost_and_a_rate(clock):
    eng = _Engine(clock, fixed_s=0.28, tok_s=3000.0)
    rate, fixed, size = measure_prefill_rate(eng, CFG, (64, 256, 1024), budget_s=2.0)
    assert (rate, fixed, size) == (pytest.approx(3000.0), pytest.approx(0.28), 1024)
    assert eng.runs == [64, 64, 256, 256, 1024, 1024]                 # each size once untimed, once timed
    assert type(rate) is float and type(fixed) is float               # they go into a Hello: msgpack takes no numpy
    one = measure_prefill_rate(_Engine(clock, 0.0, 100.0), CFG, (32,))
    assert one == (pytest.approx(100.0), 0.0, 32)


def test_the_probe_stops_before_a_size_over_its_budget_or_its_memory(clock):
    slow = _Engine(clock, fixed_s=0.5, tok_s=100.0)                  # 64 tokens: 1.14 s; 256 would take 4.6
    assert measure_prefill_rate(slow, CFG, (64, 256, 1024), budget_s=2.0)[2] == 64
    small = _Engine(clock, fixed_s=0.1, tok_s=3000.0, max_tokens=300)
    assert measure_prefill_rate(small, CFG, (64, 256, 1024), budget_s=2.0)[2] == 256
    with pytest.raises(FermoeError):
        measure_prefill_rate(_Engine(clock, 0.1, 3000.0, max_tokens=10), CFG, (64, 256))
