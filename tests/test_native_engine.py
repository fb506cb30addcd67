"""The native CPU engine against the numpy reference on the same quantised weights:
whole prompts, chunked prompts, prompt-then-decode, every ISA, and states handed
between engines."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from shared.generate import generate
from shared.model import Model
from shared.sampling import SamplingParams
from shared.state import SequenceState
from shared.synth import synth

native_engine = pytest.importorskip("cpu_worker.native_engine")
native = pytest.importorskip("native", reason="native extension not built")

# The oracle for Q4_0/Q8_0 files is the reference with activations rounded through
# Q8_0 as the kernels do; what remains is summation order (and a Q8_0 rounding
# that falls the other way now and then). F32 weights take no such rounding.
W4A8_RTOL = 2e-2
F32_RTOL = 1e-4
SPLIT_RTOL = 1e-5
PROMPT = [3, 17, 250, 9, 77, 100, 4, 5, 300, 31, 42, 8, 16, 23, 99, 101, 102, 7, 0, 64, 65, 66, 67]
GREEDY = SamplingParams(temperature=0.0)


def _rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.fixture(scope="module")
def tiny_f32_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("native") / "tiny-f32.gguf"
    synth(path, "tiny", out_type="f32", progress=False)
    return path


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("fixture, rtol", [("tiny_q4_path", W4A8_RTOL), ("tiny_path", W4A8_RTOL),
                                           ("tiny_f32_path", F32_RTOL)])
def test_native_matches_reference(request, fixture, rtol, kv):
    model = Model(request.getfixturevalue(fixture))
    ref = ReferenceEngine(model, activations_q8=True, kv_cache_dtype=kv)
    cpu = native_engine.NativeEngine(model, threads=2, kv_cache_dtype=kv)
    want = ref.forward(PROMPT, ref.new_state())
    got = cpu.forward(PROMPT, cpu.new_state())
    assert got.shape == want.shape
    assert _rel(got, want) <= rtol
    assert list(generate(cpu, PROMPT, 16, GREEDY)) == list(generate(ref, PROMPT, 16, GREEDY))


@pytest.mark.parametrize("isa", native.supported_isas())
@pytest.mark.parametrize("fixture, kv", [("tiny_q4_path", "f16"), ("tiny_path", "f16"),   # Q4_0 and Q8_0 weights
                                         ("tiny_q4_path", "f32")])
def test_chunked_prompt_and_decode_equal_whole_prompt(request, fixture, kv, isa):
    model = Model(request.getfixturevalue(fixture))
    with native.use_isa(isa):
        whole = native_engine.NativeEngine(model, threads=2).forward(PROMPT, _state(model, kv))
        small = native_engine.NativeEngine(model, threads=1, max_batch=5)
        state = _state(model, kv)
        parts = [small.forward(PROMPT[:11], state)] + [small.forward([t], state) for t in PROMPT[11:]]
    # Bitwise: every token's products are summed the same way whatever the batch, so
    # a served request (chunked at snapshot boundaries, replayed after a worker
    # death) samples exactly what `fermoe generate --engine cpu` samples.
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert state.position == len(PROMPT)


@pytest.mark.parametrize("max_batch", [64, 2])
def test_batched_decode_equals_each_sequence_alone(tiny_q4_path, max_batch):
    """Several sequences at different positions, one token each per pass: every
    logit and every state is bitwise what decoding them one by one gives."""
    model = Model(tiny_q4_path)
    cpu = native_engine.NativeEngine(model, threads=2, max_batch=max_batch)
    prompts = [PROMPT[:6], PROMPT[2:17], PROMPT[:39]]    # each crosses a KV page while decoding
    alone, batched = [], []
    for p in prompts:
        s = SequenceState(model.config, model.fingerprint, kv_block=8)   # decoding crosses KV pages
        cpu.forward(p, s, all_logits=False)
        alone.append(s)
        batched.append(s.copy())
    steps = [[7, 99, 3], [250, 1, 42], [5, 5, 5]]
    for tokens in steps:
        want = np.concatenate([cpu.forward([t], s, all_logits=False) for t, s in zip(tokens, alone)])
        got = cpu.decode_batch(tokens, batched)
        np.testing.assert_array_equal(got, want)
    for a, b in zip(alone, batched):
        assert a.position == b.position
        np.testing.assert_array_equal(a.ssm, b.ssm)
        np.testing.assert_array_equal(a.conv, b.conv)
        for slot in range(len(model.config.attention_layers)):
            for x, y in zip(a.kv.view(slot), b.kv.view(slot)):
                np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a.logits, b.logits)


def test_batched_decode_refuses_a_sequence_twice(tiny_q4_path):
    cpu = native_engine.NativeEngine(Model(tiny_q4_path), threads=1)
    s = cpu.new_state()
    cpu.forward(PROMPT[:4], s)
    with pytest.raises(FermoeError, match="distinct"):
        cpu.decode_batch([1, 2], [s, s])


def _state(model, kv="f16"):
    return ReferenceEngine(model, kv_cache_dtype=kv).new_state()


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_state_moves_between_engines(tiny_f32_path, kv):
    """Prefill in one engine, decode in the other: the same SequenceState."""
    model = Model(tiny_f32_path)
    ref = ReferenceEngine(model, kv_cache_dtype=kv)
    cpu = native_engine.NativeEngine(model, threads=2, kv_cache_dtype=kv)
    a = ref.new_state()
    ref.forward(PROMPT[:15], a)
    b = a.copy()
    ref_next = ref.forward(PROMPT[15:], a)
    cpu_next = cpu.forward(PROMPT[15:], b)
    assert _rel(cpu_next, ref_next) <= F32_RTOL
    c = cpu.new_state()
    cpu.forward(PROMPT[:15], c)
    assert _rel(ref.forward(PROMPT[15:], c), ref_next) <= F32_RTOL


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_native_kv_pages_hold_what_the_reference_writes(tiny_f32_path, kv):
    """K and V as stored, in the state's dtype: the native engine rounds to fp16 as
    numpy does, so both engines' pages agree up to the float noise before rounding."""
    model = Model(tiny_f32_path)
    ref = ReferenceEngine(model, kv_cache_dtype=kv)
    cpu = native_engine.NativeEngine(model, threads=2, kv_cache_dtype=kv)
    a, b = ref.new_state(), cpu.new_state()
    ref.forward(PROMPT, a)
    cpu.forward(PROMPT, b)
    tol = 2e-3 if kv == "f16" else F32_RTOL
    for slot in range(len(model.config.attention_layers)):
        assert b.kv.k_pages[slot][0].dtype == np.dtype(kv.replace("f", "float"))
        for got, want in zip(b.kv.view(slot), a.kv.view(slot)):
            assert got.shape == want.shape and np.abs(want).max() > 0
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


LONG = np.random.default_rng(7).integers(0, 512, 2300).tolist()   # 3 attention segments of 1024


def test_long_context_matches_reference(tiny_f32_path):
    """Past 1024 positions a token's attention splits into segments (one task each)
    whose softmax states are folded: the result is still the reference's."""
    model = Model(tiny_f32_path)
    ref, cpu = ReferenceEngine(model), native_engine.NativeEngine(model, threads=2)
    want = ref.forward(LONG, ref.new_state())
    got = cpu.forward(LONG, cpu.new_state())
    assert _rel(got[1024:], want[1024:]) <= F32_RTOL


def test_long_prompt_chunked_batched_and_decoded_alike(tiny_q4_path):
    """Split attention is bitwise independent of how positions are grouped: chunks of
    64 tokens (more segment tasks than one region takes), of 37, single tokens, and a
    batched step mixing split and unsplit sequences."""
    model = Model(tiny_q4_path)
    whole = native_engine.NativeEngine(model, threads=2).forward(LONG, _state(model))
    small = native_engine.NativeEngine(model, threads=2, max_batch=37)
    state = _state(model)
    parts = [small.forward(LONG[:2290], state)] + [small.forward([t], state) for t in LONG[2290:]]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    cpu = native_engine.NativeEngine(model, threads=2)
    prompts = [LONG[:10], LONG[:1500], LONG[:30], LONG[:1030]]   # unsplit, split, unsplit, split
    states = []
    for p in prompts:
        st = _state(model)
        cpu.forward(p, st, all_logits=False)
        states.append(st)
    copies = [st.copy() for st in states]
    tokens = [1, 2, 3, 4]
    alone = np.concatenate([cpu.forward([t], st, all_logits=False) for t, st in zip(tokens, copies)])
    np.testing.assert_array_equal(cpu.decode_batch(tokens, states), alone)


def test_last_logits_only(tiny_q4_path):
    cpu = native_engine.NativeEngine(Model(tiny_q4_path), threads=2, max_batch=8)
    all_rows = cpu.forward(PROMPT, cpu.new_state())
    last = cpu.forward(PROMPT, cpu.new_state(), all_logits=False)
    assert last.shape == (1, all_rows.shape[1])
    np.testing.assert_allclose(last[0], all_rows[-1], rtol=0, atol=SPLIT_RTOL * np.abs(last).max())


def test_every_isa_gives_the_same_tokens(tiny_q4_path):
    # The ISAs sum in different orders (1e-7 apart); over a long enough greedy run a
    # near-tie eventually decides differently, so the horizon is the issue's "same
    # tokens" on a continuation of 16, not forever.
    code = ("import sys; from shared.model import Model; from shared.generate import generate;"
            "from shared.sampling import SamplingParams; from cpu_worker.native_engine import NativeEngine;"
            f"e = NativeEngine(Model(sys.argv[1]), threads=2);"
            f"print(list(generate(e, {PROMPT}, 16, SamplingParams(temperature=0.0))))")
    outputs = {}
    for isa in ("scalar", "ssse3", "avx2", "avx512vnni"):
        run = subprocess.run([sys.executable, "-c", code, str(tiny_q4_path)], capture_output=True, text=True,
                             env={**os.environ, "FERMOE_ISA": isa})
        if run.returncode != 0 and "lacks" in run.stderr:
            continue                                   # this CPU lacks the ISA
        assert run.returncode == 0, run.stderr
        outputs[isa] = run.stdout
    assert "scalar" in outputs and len(outputs) >= 2
    assert len(set(outputs.values())) == 1, outputs


def test_a_second_engine_gets_every_cpu_too(tiny_q4_path):
    """A pool pins the thread that creates it to its first CPU while it lives: an
    engine made after it from the same thread must still default to every core."""
    from cpu_worker.topology import default_cpus
    cpus = default_cpus()
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    model = Model(tiny_q4_path)
    first = native_engine.NativeEngine(model)
    second = native_engine.NativeEngine(model)
    try:
        assert first.cpus == second.cpus == cpus and second.threads == len(cpus)
        assert default_cpus() == cpus
    finally:
        second.close()
        first.close()


def test_read_bandwidth_probe(tiny_q4_path):
    cpu = native_engine.NativeEngine(Model(tiny_q4_path), threads=2)
    assert 1e8 < cpu.read_bandwidth(megabytes=64, reps=1) < 1e13
    assert 1e8 < cpu.read_bandwidth(megabytes=64, reps=1, weights=True) < 1e13   # the mapped file itself


def test_forward_exp_is_accurate_and_never_inf():
    """The branch-free e^x of the forward's SiLU and sigmoid against float64 exp."""
    from native import ffi, lib
    x = np.concatenate([np.linspace(-87.0, 88.0, 1_000_003, dtype=np.float32),
                        np.array([-1e4, -100.0, -87.5, 88.5, 100.0, 1e4], np.float32)])
    y = np.empty_like(x)
    lib.fm_exp_rows(ffi.cast("float *", ffi.from_buffer(x)), ffi.cast("float *", ffi.from_buffer(y)), x.size)
    inside = x[:-6]
    rel = np.abs(y[:-6].astype(np.float64) / np.exp(inside.astype(np.float64)) - 1.0)
    assert rel.max() < 2.5e-7                       # ~2 ulp
    tail = y[-6:]
    assert np.isfinite(tail).all() and (tail[:3] < 1e-37).all() and (tail[3:] > 1e38).all()


def test_decode_spreads_a_short_contexts_heads_over_the_threads(tmp_path, monkeypatch):
    """One KV head and two threads: a decode step's attention runs as one task per
    run of query heads, not one per KV head. Bitwise what the whole prompt gives
    (one task per token there), and the reference's within the W4A8 tolerance."""
    import dataclasses
    from shared import synth as synth_module
    monkeypatch.setitem(synth_module.PRESETS, "tiny-mqa",
                        dataclasses.replace(synth_module.PRESETS["tiny"], n_head_kv=1))
    path = tmp_path / "tiny-mqa.gguf"
    synth(path, "tiny-mqa", progress=False)
    model = Model(path)
    assert model.config.n_head // model.config.n_head_kv == 4
    cpu = native_engine.NativeEngine(model, threads=2)
    whole = cpu.forward(PROMPT, cpu.new_state())
    state = cpu.new_state()
    parts = [cpu.forward(PROMPT[:5], state)] + [cpu.forward([t], state) for t in PROMPT[5:]]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    ref = ReferenceEngine(model, activations_q8=True)
    assert _rel(whole, ref.forward(PROMPT, ref.new_state())) <= W4A8_RTOL


def test_region_stats_count_the_parallel_regions(tiny_q4_path):
    """The pool's statistics: nothing while off; once on, every parallel region of a
    step (a 2-thread pool runs none inline but one-task ones) with its time, the
    workers' share of it inside tasks in (0, 1], and a reset that starts again."""
    cpu = native_engine.NativeEngine(Model(tiny_q4_path), threads=2)
    state = cpu.new_state()
    cpu.forward(PROMPT, state)
    assert cpu.region_stats()["regions"] == 0
    cpu.region_stats(enable=True, reset=True)
    cpu.forward([5], state)
    one = cpu.region_stats(reset=True)
    cpu.forward([6, 7], state)
    two = cpu.region_stats(enable=False, reset=True)
    n_layers = Model(tiny_q4_path).config.n_layer
    assert one["regions"] >= 3 * n_layers and two["regions"] >= one["regions"]
    for s in (one, two):
        assert s["seconds"] > 0 and 0 < s["busy_fraction"] <= 1
        by_phase = s["seconds_by_phase"]      # every region falls in one phase of the forward
        assert set(by_phase) == set(cpu.PHASES) and min(by_phase.values()) >= 0
        assert by_phase["gdn"] > 0 and by_phase["moe"] > 0 and by_phase["lm_head"] > 0
        assert sum(by_phase.values()) == pytest.approx(s["seconds"], rel=1e-9)
    cpu.forward([8], state)
    assert cpu.region_stats()["regions"] == 0
    assert 0 < cpu.region_overhead(reps=100) < one["seconds"]   # an empty region: less than a step's


def test_bench_decode_batch_and_context(tiny_q4_path):
    from bench.decode import bytes_per_token, kv_bytes_per_token, run
    model = Model(tiny_q4_path)
    out = run(str(tiny_q4_path), threads=1, prompt_tokens=8, decode_tokens=3, batch=3, context=40)
    assert out["batch"] == 3 and out["context"] == 40
    assert out["decode_tok_s_aggregate"] == pytest.approx(3 * out["decode_tok_s"], rel=0.01)
    assert out["kv_mb_per_token"] == round(kv_bytes_per_token(model, 40) / 1e6, 1)
    assert out["weight_bytes_per_token"] == bytes_per_token(model) > 0
    state = native_engine.NativeEngine(model, threads=1).new_state()
    state_bytes = 2 * (state.ssm.nbytes + state.conv.nbytes)            # read and written a token
    assert out["state_mb_per_token"] == round(state_bytes / 1e6, 1)
    per_pass = out["weight_bytes_per_token"] + 3 * (state_bytes + kv_bytes_per_token(model, 40))
    assert out["floor_with_state_tok_s"] == pytest.approx(out["read_bandwidth_gb_s"] * 1e9 / per_pass, rel=0.01)
    assert out["fraction_of_floor_with_state"] > out["fraction_of_floor"]
    # the fraction is printed to 3 decimals: on the tiny model (~0.02) that alone can be 2.5% off
    assert out["fraction_of_weights_read_floor"] == pytest.approx(
        out["decode_tok_s"] * out["weight_bytes_per_token"] / (out["weights_read_gb_s"] * 1e9), rel=0.02, abs=6e-4)
    assert set(out["decode_breakdown"]) == set(native_engine.NativeEngine.PHASES)
    assert out["sampling_ms_per_token"] > 0
    regions = out["decode_parallel_regions"]
    assert regions["per_token"] == 0     # one thread: every region runs inline
    assert set(regions["outside_ms_by_phase"]) == set(native_engine.NativeEngine.PHASES)
    assert regions["outside_ms_by_phase"]["moe"] > 0 and regions["outside_forward_ms_per_token"] > 0
    # the time outside the regions is the phases' share of it plus the step's outside the forward
    assert sum(regions["outside_ms_by_phase"].values()) + regions["outside_forward_ms_per_token"] == pytest.approx(
        regions["outside_ms_per_token"], abs=0.02)
    with pytest.raises(ValueError, match="shorter than the prompt"):
        run(str(tiny_q4_path), threads=1, prompt_tokens=8, decode_tokens=1, context=4)
