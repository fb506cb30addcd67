"""Long prompts on a small GPU: the memory plan that moves attention layers' KV to
page-locked host memory when the whole KV does not fit (a pure function of the config
and the budget), and the engine that runs it with the logits and states of a run that
keeps every layer's KV on the device."""
from __future__ import annotations

import types

import numpy as np
import pytest

from gpu_worker.plan import MARGIN, fit_passes, kv_layer_nbytes, make_plan
from modeltools.synth import preset_config
from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from shared.state import kv_bytes_per_position
from tests.gpu_worker.test_engine import PROMPT, device_kind, gpu  # noqa: F401 (a fixture)

GiB = 1 << 30
# The full-size model's budget figures (what resident_nbytes and an expert layer of the
# 128-expert Q4_0 file come to), so the plan is checked at the real dimensions without
# the 10 GB file.
RESIDENT, EXPERT_LAYER = 1_090_000_000, 226_500_000


@pytest.fixture(scope="module")
def big():
    return types.SimpleNamespace(config=preset_config("qwen3.6-35b-a3b", experts=128))


def plan_of(model, T, budget=6 * GiB, **kw):
    return fit_passes(model, budget, T, [T], resident_bytes=RESIDENT, layer_bytes=EXPERT_LAYER, **kw)


def test_kv_of_one_layer_is_its_share_of_a_positions_bytes(big):
    """Guards the slot's size: one attention layer's fp32 K and V, not every layer's."""
    cfg = big.config
    assert kv_layer_nbytes(cfg, 1) == 2 * cfg.n_head_kv * cfg.head_dim * 4
    assert kv_layer_nbytes(cfg, 1000) * len(cfg.attention_layers) == kv_bytes_per_position(cfg, "f32") * 1000


@pytest.mark.parametrize("T", [947, 8192, 32768])
def test_prompts_whose_kv_fits_keep_it_all_on_the_device(big, T):
    """Guards against spilling KV that fits: up to 32768 positions at 6 GiB, every attention
    layer's KV stays on the device (passes shrink first), and no slot is planned."""
    fit = plan_of(big, T)
    plan = fit.plan
    assert plan.kv_layers == plan.n_kv_layers == len(big.config.attention_layers) and plan.spilled_kv_layers == 0
    assert plan.kv == plan.n_kv_layers * kv_layer_nbytes(big.config, T)
    assert plan.total + MARGIN <= plan.budget
    assert "all 10 attention layers on the device" in plan.describe()


def test_a_128k_prompt_moves_kv_to_host_memory_and_fits(big):
    """131072 positions are 5 GiB of fp32 KV: at 6 GiB the plan keeps what fits of it on
    the device beside one layer's slot, no expert layer resident, within the budget."""
    T = 131072
    plan = plan_of(big, T).plan
    per = kv_layer_nbytes(big.config, T)
    assert plan.spilled_kv_layers > 0 and plan.resident_layers == 0
    assert plan.kv == (plan.kv_layers + 1) * per
    assert plan.total + MARGIN <= plan.budget
    # the most layers that fit: one more would not
    assert plan.total + per + MARGIN > plan.budget
    text = plan.describe()
    assert f"{plan.kv_layers} of 10 attention layers on the device, {plan.spilled_kv_layers} in page-locked host memory" in text


def test_kv_layers_can_be_capped_and_the_rest_go_through_the_slot(big):
    """max_kv_layers (the ablation, and the tests' way to spill on a small model) keeps at
    most that many layers' KV on the device even when all would fit."""
    T = 8192
    plan = plan_of(big, T, budget=40 * GiB, max_kv_layers=3).plan
    assert (plan.kv_layers, plan.spilled_kv_layers) == (3, 7)
    assert plan.kv == 4 * kv_layer_nbytes(big.config, T)
    assert plan_of(big, T, budget=40 * GiB, max_kv_layers=0).plan.kv_layers == 0
    with pytest.raises(FermoeError, match="asks for kv_spill"):
        make_plan(big, 40 * GiB, T, resident_bytes=RESIDENT, layer_bytes=EXPERT_LAYER, max_kv_layers=3)


def test_a_budget_that_holds_no_slot_is_refused(big):
    """The weights and a ring alone exceed the budget: a one-line error, not a plan."""
    with pytest.raises(FermoeError, match="too small.*a slot for one attention layer's KV"):
        plan_of(big, 131072, budget=RESIDENT + 2 * EXPERT_LAYER + (64 << 20))


# ---- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_q4_path):
    from shared.model import Model
    return Model(tiny_q4_path)


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("kv_layers", [0, 1])
def test_kv_in_host_memory_gives_the_logits_and_states_of_kv_on_the_device(tiny, device_kind, kv, kv_layers):
    """Guards the slot's refill: a layer whose KV lives in host memory, over passes of a
    few tokens, must see every earlier position's keys (those landed by earlier passes and,
    on a resumed state, those before the prefill), exactly as a layer kept on the device."""
    on_device = gpu(tiny, device_kind, max_pass_tokens=24, kv_cache_dtype=kv)
    spilled = gpu(tiny, device_kind, max_pass_tokens=24, kv_cache_dtype=kv, max_kv_layers=kv_layers)
    a, b = on_device.new_state(), spilled.new_state()
    want, want_snaps = on_device.prefill(PROMPT[:50], a, snapshot_at=[16, 40], all_logits=True)
    got, got_snaps = spilled.prefill(PROMPT[:50], b, snapshot_at=[16, 40], all_logits=True)
    assert spilled.plan.kv_layers == kv_layers and spilled.plan.spilled_kv_layers == 2 - kv_layers
    np.testing.assert_array_equal(got, want)
    for p in (16, 40):
        for layer in range(2):
            for x, y in zip(got_snaps[p].kv.view(layer), want_snaps[p].kv.view(layer)):
                np.testing.assert_array_equal(x, y)
    # resumed: the 50 positions before the prefill come from the state, then 30 new ones in passes
    np.testing.assert_array_equal(spilled.forward(PROMPT[50:], b), on_device.forward(PROMPT[50:], a))
    for layer in range(2):
        for x, y in zip(b.kv.view(layer), a.kv.view(layer)):
            np.testing.assert_array_equal(x, y)
    on_device.close()
    spilled.close()


def test_a_batch_of_prompts_each_reads_its_own_rows_of_the_slot(tiny, device_kind):
    """Guards the slot's rows by lane: two prompts in one batch with their KV in host memory
    each get the logits they get alone."""
    engine = gpu(tiny, device_kind, max_pass_tokens=16, max_kv_layers=0)
    ref = ReferenceEngine(tiny)
    first, second = PROMPT[:40], PROMPT[40:75]
    together = engine.forward_batch([(first, engine.new_state()), (second, engine.new_state())])
    for got, tokens in zip(together, (first, second)):
        np.testing.assert_allclose(got, ref.forward(tokens, ref.new_state())[-1], rtol=3e-5, atol=3e-5 * 4)
    engine.close()


def test_bench_prefill_says_where_the_kv_lived(tiny_q4_path, monkeypatch):
    """`bench prefill --kv-layers 1 --no-profile`: the memory report names the layers kept
    in VRAM and in host memory, with their bytes (guards a report that reads the plan's
    defaults instead of the engine's)."""
    from bench.prefill import run
    from tests.support.bench_keys import assert_keys_documented
    import bench.prefill
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    out = run(str(tiny_q4_path), prompt_tokens=64, reps=1, chunk=32, kv_layers=1, profile=False)
    mem = out["memory"]
    cfg = preset_config("tiny")
    assert (mem["kv_device_layers"], mem["kv_host_layers"]) == (1, 1) and out["switches"]["kv_layers"] == 1
    assert mem["kv_placement"].startswith("1 of 2 attention layers on the device, 1 in page-locked host memory")
    assert mem["kv_device_mib"] == round(2 * 64 * 2 * cfg.n_head_kv * cfg.head_dim * 4 / 2**20, 3)  # a layer and the slot, fp32
    assert mem["kv_host_mib"] == round(64 * 2 * cfg.n_head_kv * cfg.head_dim * 2 / 2**20, 3)        # one layer, f16
    assert out["phases_ms"] is None and out["kernel_families"] is None and out["passes"] == 2
    assert_keys_documented(out, bench.prefill)
