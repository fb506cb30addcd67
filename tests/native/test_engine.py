"""The native CPU engine against the numpy reference on the same weights: Qwen3.5
and Qwen3-Next models in F32, F16, Q8_0 and Q4_0, whole prompts, chunked prompts,
prompt-then-decode, every ISA, and states handed between engines."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from modeltools import synth as synth_module
from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from shared.generate import generate
from shared.ggml_types import GGMLType
from shared.model import Model
from shared.sampling import SamplingParams
from shared.state import DEFAULT_KV_DTYPE, SequenceState
from modeltools.synth import synth
from tests.support.native_tolerance import PROMPT_RTOL, rel_error

native_engine = pytest.importorskip("cpu_worker.native_engine")
native = pytest.importorskip("native", reason="native extension not built", exc_type=ImportError)

# Q4_0/Q8_0 weights: the kernels compute W4A8, so the reference rounds its activations
# through Q8_0 alike (activations_q8) and each step starts from the same state (a whole
# prompt would carry one rounding that fell the other way into every later position).
# The integer block sums are exact: measured 2.6e-7 (f32 KV) and 2.8e-7 (f16 KV), the
# median 1.4e-7, over every ISA; the bound is twice that, the same for both (the step's
# own K and V are the only KV it rounds).
STEP_RTOL = {"f32": 6e-7, "f16": 6e-7}
# ... but now and then (9 steps of 736 measured, never 2 of one prompt's 23) an
# activation lies within float noise of a Q8_0 rounding tie and the two engines round
# it apart: one quantisation step of one element, up to 1e-2 of the logits measured.
MAX_ROUNDING_SPLIT_STEPS, ROUNDING_SPLIT_RTOL = 3, 2e-2
# The pages as stored: f32 the same noise as the logits; f16 within one fp16 ulp
# (2^-10 of the value at most) where the noise moved a value across a rounding tie.
KV_PAGE_RTOL = {"f32": PROMPT_RTOL["f32"], "f16": 2.0 ** -10}
SPLIT_RTOL = 1e-5
PROMPT = [3, 17, 250, 9, 77, 100, 4, 5, 300, 31, 42, 8, 16, 23, 99, 101, 102, 7, 0, 64, 65, 66, 67]
GREEDY = SamplingParams(temperature=0.0)
# Qwen3-Next as llama.cpp writes it: value heads in Hugging Face's grouped order (head
# h reads key head h // 2 here, where Qwen3.5's tiled order reads h % 2), beta and
# alpha fused into one ssm_ba tensor.
TINY_NEXT = dataclasses.replace(synth_module.PRESETS["tiny"], arch="qwen3next")


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory, tiny_f32_path):
    """(arch, type) -> the tiny preset as that architecture in that type, made once."""
    root, made = tmp_path_factory.mktemp("native"), {("qwen35moe", "f32"): tiny_f32_path}

    def get(arch: str, out_type: str):
        if (arch, out_type) not in made:
            path = root / f"tiny-{arch}-{out_type}.gguf"
            if out_type == "bf16":
                _bf16_copy(get(arch, "f16"), path)
            else:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setitem(synth_module.PRESETS, "tiny-next", TINY_NEXT)
                    synth(path, {"qwen35moe": "tiny", "qwen3next": "tiny-next"}[arch], out_type=out_type,
                          progress=False)
            made[arch, out_type] = path
        return made[arch, out_type]
    return get


def _bf16_copy(f16_path, dst) -> None:
    """The F16 file with its F16 tensors stored as BF16 (synth writes no BF16)."""
    from shared.gguf_file import GGUFFile
    from shared.quants import dequantize, quantize
    from tests.support.gguf_edit import rewrite_gguf
    with GGUFFile(f16_path) as f:
        changed = {name: (info.shape, GGMLType.BF16, quantize(dequantize(f.raw(name), info.qtype, tuple(info.shape)),
                                                              GGMLType.BF16).reshape(-1))
                   for name, info in f.tensors.items() if info.qtype == GGMLType.F16}
    rewrite_gguf(f16_path, dst, tensors=changed)


def _check_model(model: Model, arch: str, out_type: str) -> None:
    """The file is what the test says it runs: a Qwen3-Next with grouped value heads
    and a fused ssm_ba, and matrices stored in out_type."""
    cfg = model.config
    assert cfg.arch == arch
    if arch == "qwen3next":
        assert not cfg.v_heads_tiled and cfg.ssm_v_heads > cfg.ssm_k_heads > 1
        assert "blk.0.ssm_ba.weight" in model.file.tensors and "blk.0.ssm_beta.weight" not in model.file.tensors
    gdn = model.layers[cfg.gdn_layers[0]]
    assert gdn.attn_qkv.qtype == GGMLType[out_type.upper()] and gdn.ssm_beta.qtype == GGMLType[out_type.upper()]


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
@pytest.mark.parametrize("out_type", ["f32", "f16", "bf16"])
def test_native_matches_reference_on_float_weights(synth_model, out_type, arch, kv):
    model = Model(synth_model(arch, out_type))
    _check_model(model, arch, out_type)
    ref = ReferenceEngine(model, kv_cache_dtype=kv)
    cpu = native_engine.NativeEngine(model, threads=2, kv_cache_dtype=kv)
    want = ref.forward(PROMPT, ref.new_state())
    got = cpu.forward(PROMPT, cpu.new_state())
    assert got.shape == want.shape
    assert rel_error(got, want) <= PROMPT_RTOL[kv]
    _assert_greedy_agrees(cpu, ref, PROMPT_RTOL[kv])


def _assert_greedy_agrees(cpu, ref, rtol: float) -> None:
    """The native engine's greedy continuation (its own states all along), each token
    the reference's argmax given the same tokens before it, or within what the two
    engines' logits may differ by (rtol of the logit scale each): a near-tie may go
    either way (the reference's float sums are numpy's BLAS's, which differ by
    machine), a wrong step cannot."""
    tokens = list(generate(cpu, PROMPT, 16, GREEDY))
    assert len(tokens) == 16
    logits = ref.forward(PROMPT + tokens[:-1], ref.new_state())[len(PROMPT) - 1:]
    for i, (token, row) in enumerate(zip(tokens, logits)):
        assert row[token] >= row.max() - 2 * rtol * np.abs(row).max(), (i, token, int(row.argmax()))


def _step_errors(model: Model, kv: str, prompt=PROMPT) -> np.ndarray:
    """Each prompt token run by both engines from the same state (the reference's,
    token by token): the native logits' error at each step, in rel_error units."""
    ref = ReferenceEngine(model, activations_q8=True, kv_cache_dtype=kv)
    cpu = native_engine.NativeEngine(model, threads=2, kv_cache_dtype=kv)
    state, errors = ref.new_state(), []
    for token in prompt:
        theirs = state.copy()
        want = ref.forward([token], state)
        errors.append(rel_error(cpu.forward([token], theirs), want))
    return np.array(errors)


def _assert_steps_match(errors: np.ndarray, kv: str) -> None:
    split = errors > STEP_RTOL[kv]
    assert split.sum() <= MAX_ROUNDING_SPLIT_STEPS and errors.max() <= ROUNDING_SPLIT_RTOL, errors


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
@pytest.mark.parametrize("out_type", ["q4_0", "q8_0"])
def test_native_steps_match_reference_on_quantised_weights(synth_model, out_type, arch, kv):
    model = Model(synth_model(arch, out_type))
    _check_model(model, arch, out_type)
    _assert_steps_match(_step_errors(model, kv), kv)
    ref = ReferenceEngine(model, activations_q8=True, kv_cache_dtype=kv)
    cpu = native_engine.NativeEngine(model, threads=2, kv_cache_dtype=kv)
    _assert_greedy_agrees(cpu, ref, ROUNDING_SPLIT_RTOL)     # a split rounding carries over to later tokens


@pytest.mark.parametrize("arch, out_type, kv", [("qwen35moe", "q4_0", "f16"), ("qwen35moe", "q8_0", "f16"),
                                                ("qwen35moe", "q4_0", "f32"), ("qwen3next", "q4_0", "f16")])
def test_chunked_prompt_and_decode_equal_whole_prompt(synth_model, arch, out_type, kv, isa):
    model = Model(synth_model(arch, out_type))
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
    assert rel_error(cpu_next, ref_next) <= PROMPT_RTOL[kv]
    c = cpu.new_state()
    cpu.forward(PROMPT[:15], c)
    assert rel_error(ref.forward(PROMPT[15:], c), ref_next) <= PROMPT_RTOL[kv]


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
    tol = KV_PAGE_RTOL[kv]
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
    assert rel_error(got[1024:], want[1024:]) <= PROMPT_RTOL[DEFAULT_KV_DTYPE]


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


def test_token_blocks_attend_as_the_tokens_alone(tiny_q4_path):
    """A long pass attends in blocks of consecutive tokens that share each K/V chunk:
    blocks off a multiple of 16 (one across position 1024, where a second segment
    begins), a partial last block, and two sequences in one pass (blocks end at a
    sequence's end) give bitwise the logits and KV pages of the tokens run one a pass."""
    model = Model(tiny_q4_path)
    big = native_engine.NativeEngine(model, threads=2, max_batch=1200)
    small = native_engine.NativeEngine(model, threads=2, max_batch=1)
    a, b = _state(model), _state(model)
    small.forward(LONG[:7], a)
    a2, b2 = a.copy(), b.copy()
    got = big.forward_batch([(LONG[7:1100], a), (LONG[100:161], b)])
    want = [small.forward(LONG[7:1100], a2, all_logits=False), small.forward(LONG[100:161], b2, all_logits=False)]
    np.testing.assert_array_equal(got, np.concatenate(want))
    for x, y in ((a, a2), (b, b2)):
        for slot in range(len(model.config.attention_layers)):
            for u, v in zip(x.kv.view(slot), y.kv.view(slot)):
                np.testing.assert_array_equal(u, v)


def test_weights_are_read_in_place_from_the_mapped_file(synth_model):
    """Q4_0, Q8_0 and F32 matrices are computed where the GGUF is mapped, never copied
    (so every worker of a machine shares one copy through the page cache); F16 and
    BF16 ones from F32 copies made at load, value for value; new states keep fp16 KV."""
    from shared.model import Weight
    for out_type in ("q4_0", "q8_0", "f16", "bf16"):
        model = Model(synth_model("qwen35moe", out_type))
        cpu = native_engine.NativeEngine(model, threads=1)
        assert cpu.new_state().kv.dtype_name == "f16" == DEFAULT_KV_DTYPE
        mapped = model.file.data()
        lo = mapped.__array_interface__["data"][0]
        bound = [(cpu._model.token_embd, model.token_embd), (cpu._model.output, model.output)]
        for i, layer in enumerate(model.layers):
            bound += [(getattr(cpu._model.layers[i], name), w) for name, w in vars(layer).items()
                      if isinstance(w, Weight) and len(w.shape) > 1]
        kinds = set()
        for t, w in bound:
            offset = int(cpu.ffi.cast("uintptr_t", t.data)) - lo
            kinds.add(w.qtype)
            if w.qtype in (GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.F32):
                assert t.type == w.qtype and 0 <= offset < mapped.nbytes, w.name
                continue
            assert w.qtype in (GGMLType.F16, GGMLType.BF16) and t.type == GGMLType.F32, w.name
            assert not 0 <= offset < mapped.nbytes, w.name
            copy = np.frombuffer(cpu.ffi.buffer(t.data, w.f32().nbytes), np.float32)
            np.testing.assert_array_equal(copy, w.f32().reshape(-1), err_msg=w.name)
        assert GGMLType[out_type.upper()] in kinds and GGMLType.F32 in kinds      # routers and conv stay F32
        cpu.close()


def test_last_logits_only(tiny_q4_path):
    cpu = native_engine.NativeEngine(Model(tiny_q4_path), threads=2, max_batch=8)
    all_rows = cpu.forward(PROMPT, cpu.new_state())
    last = cpu.forward(PROMPT, cpu.new_state(), all_logits=False)
    assert last.shape == (1, all_rows.shape[1])
    np.testing.assert_allclose(last[0], all_rows[-1], rtol=0, atol=SPLIT_RTOL * np.abs(last).max())


@pytest.mark.parametrize("isa", native.ISAS[1:], indirect=True)
def test_every_isa_gives_the_same_tokens(tiny_q4_path, isa):
    # The ISAs sum in different orders (1e-7 apart); over a long enough greedy run a
    # near-tie eventually decides differently, so the horizon is the issue's "same
    # tokens" on a continuation of 16, not forever.
    cpu = native_engine.NativeEngine(Model(tiny_q4_path), threads=2)
    assert cpu.isa == isa
    tokens = list(generate(cpu, PROMPT, 16, GREEDY))
    with native.use_isa("scalar"):
        assert tokens == list(generate(cpu, PROMPT, 16, GREEDY))


def test_a_second_engine_gets_every_cpu_too(tiny_q4_path):
    """A pool pins the thread that creates it to its first CPU while it lives: an
    engine made after it from the same thread must still default to every core."""
    from shared.topology import default_cpus
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
    (one task per token there), and each step the reference's."""
    import dataclasses
    from modeltools import synth as synth_module
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
    _assert_steps_match(_step_errors(model, DEFAULT_KV_DTYPE), DEFAULT_KV_DTYPE)


def test_region_stats_count_the_parallel_regions(tiny_q4_path):
    """The pool's statistics, checked by counts and by what holds however loaded the
    machine is (never one timing against another: other processes share these
    cores). Nothing while off; once on, every parallel region of a step (a 2-thread
    pool runs none inline but one-task ones), as many again for the same step; the
    workers' time inside tasks within the threads' time in the regions; each phase's
    regions within that phase's time; a reset that starts again; and the empty
    regions region_overhead times are regions the pool really starts."""
    model = Model(tiny_q4_path)
    cpu = native_engine.NativeEngine(model, threads=2)
    state = cpu.new_state()
    cpu.forward(PROMPT, state)
    assert cpu.region_stats()["regions"] == 0
    same = state.copy()
    cpu.region_stats(enable=True, reset=True)
    cpu.phase_seconds(reset=True)
    cpu.forward([5], state)
    phases = cpu.phase_seconds(reset=True)
    one = cpu.region_stats(reset=True)
    cpu.forward([5], same)
    assert cpu.region_stats(reset=True)["regions"] == one["regions"]
    cpu.forward([6, 7], state)
    two = cpu.region_stats(enable=False, reset=True)
    assert one["regions"] >= 3 * model.config.n_layer and two["regions"] >= one["regions"]
    for s in (one, two):
        assert s["seconds"] > 0 and 0 < s["busy_fraction"] <= 1
        by_phase = s["seconds_by_phase"]      # every region falls in one phase of the forward
        assert set(by_phase) == set(cpu.PHASES) and min(by_phase.values()) >= 0
        assert by_phase["gdn"] > 0 and by_phase["moe"] > 0 and by_phase["lm_head"] > 0
        assert sum(by_phase.values()) == pytest.approx(s["seconds"], rel=1e-9)
    for phase, seconds in one["seconds_by_phase"].items():
        assert seconds <= phases[phase] + 1e-12, phase
    cpu.forward([8], state)
    assert cpu.region_stats()["regions"] == 0
    cpu.region_stats(enable=True, reset=True)
    assert cpu.region_overhead(reps=100) > 0
    assert cpu.region_stats(enable=False, reset=True)["regions"] == 2 * 100   # 100 untimed first, as documented


def test_bench_decode_batch_and_context(tiny_q4_path):
    import bench.decode
    from bench.decode import bytes_per_token, kv_bytes_per_token, run
    from tests.support.bench_keys import assert_keys_documented
    model = Model(tiny_q4_path)
    out = run(str(tiny_q4_path), threads=1, prompt_tokens=8, decode_tokens=3, batch=3, context=40)
    assert_keys_documented(out, bench.decode)
    assert out["batch"] == 3 and out["context"] == 40
    cfg = model.config           # 8 tokens: 36 (query, position) pairs a head, 4 FLOPs a dim each
    hd, nh, nkv, d = cfg.head_dim, cfg.n_head, cfg.n_head_kv, cfg.n_embd
    weights = d * 2 * nh * hd + 2 * d * nkv * hd + nh * hd * d      # q|gate, k, v, output
    want = len(cfg.attention_layers) * (2 * 8 * weights + nh * hd * 4 * 36)
    assert out["prefill_attention_gflop"] == round(want / 1e9, 6) > 0
    assert out["decode_tok_s_aggregate"] == pytest.approx(3 * out["decode_tok_s"], rel=0.01)
    assert out["kv_mb_per_token"] == round(kv_bytes_per_token(model, 40) / 1e6, 1)
    assert out["weight_bytes_per_token"] == bytes_per_token(model) > 0
    state = native_engine.NativeEngine(model, threads=1).new_state()
    state_bytes = 2 * (state.ssm.nbytes + state.conv.nbytes)            # read and written a token
    assert out["state_mb_per_token"] == round(state_bytes / 1e6, 1)
    per_pass = out["weight_bytes_per_token"] + 3 * (state_bytes + kv_bytes_per_token(model, 40))
    assert out["floor_with_state_tok_s"] == pytest.approx(out["read_bandwidth_gb_s"] * 1e9 / per_pass, rel=0.01)
    assert out["floor_with_state_tok_s"] < out["floor_tok_s"]
    # (fractions printed to 3 decimals: on the tiny model, ~0.1, that alone can be 0.5% off)
    assert out["fraction_of_floor_with_state"] == pytest.approx(
        out["decode_tok_s"] / out["floor_with_state_tok_s"], rel=0.01, abs=6e-4)
    # the fraction is printed to 3 decimals: on the tiny model (~0.02) that alone can be 2.5% off
    assert out["fraction_of_weights_read_floor"] == pytest.approx(
        out["decode_tok_s"] * out["weight_bytes_per_token"] / (out["weights_read_gb_s"] * 1e9), rel=0.02, abs=6e-4)
    assert set(out["decode_breakdown"]) == set(native_engine.NativeEngine.PHASES)
    gdn = out["decode_breakdown"]["gdn"]         # its weights and 3 sequences' state, at its share of the bandwidth
    assert gdn["state_mb_per_token"] == round(3 * state_bytes / 1e6, 1)
    assert gdn["fraction_of_read_bw"] == pytest.approx(gdn["gb_s"] / out["read_bandwidth_gb_s"], rel=0.02, abs=1e-3)
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
