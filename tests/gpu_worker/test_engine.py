"""The GPU prefill engine (`--engine gpu`) against the numpy reference, on the host
emulation (and on a CUDA device with `-m gpu`): whole prompts and passes of a few
tokens, snapshot boundaries, expert streaming under every schedule, and the state
it hands to the CPU engine."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_worker.engine import GPUEngine
from gpu_worker.plan import MARGIN, make_plan
from shared.engine import Engine, ReferenceEngine
from shared.errors import FermoeError
from shared.generate import generate
from shared.model import Model
from shared.sampling import SamplingParams
from tests.support.bench_keys import assert_keys_documented
from tests.support.gpu_device import DEVICES, assert_close, open_test_device
from tests.support.serving_harness import fermoe

# fp32 kernels against the fp32 numpy reference (the GPU computes activations in
# fp32, not W4A8): summation order and the hardware exp only, of the logit scale
# (seen: 8e-6 in the emulation). Tight enough to tell an f16 KV cache from an f32 one.
GPU_RTOL = 3e-5
HF_RTOL = 1e-4           # against Hugging Face: the reference's own bound (test_hf_oracle)
PROMPT = np.random.default_rng(0).integers(3, 500, 80).tolist()


@pytest.fixture(scope="module", params=DEVICES)
def device_kind(request):
    open_test_device(request.param)          # skips where there is no such device
    return request.param


def gpu(model, kind, **kw) -> GPUEngine:
    from gpu_worker.emulator import EmulatedDevice
    device = EmulatedDevice(order=kw.pop("order", None)) if kind == "emulate" else open_test_device(kind)
    return GPUEngine(model, device=device, **kw)


def close(got, want, rtol=GPU_RTOL, floor=1.0):
    """Logits by default: a scale at or below 1 would mean they collapsed."""
    assert_close(got, want, rtol, floor)


@pytest.fixture(scope="module")
def reference_logits(tiny):
    ref = ReferenceEngine(tiny)
    return ref.forward(PROMPT, ref.new_state())


def test_the_engines_implement_one_interface(tiny):
    """Every engine has what the workers call, and its forward_batch gives each sequence
    the last logits forward() gives it alone."""
    from cpu_worker.native_engine import NativeEngine
    for engine in (ReferenceEngine(tiny), NativeEngine(tiny, threads=1), gpu(tiny, "emulate")):
        assert isinstance(engine, Engine), engine.name
        assert isinstance(engine.threads, int) and engine.threads >= 1
        assert isinstance(engine.max_batch, int) and engine.max_batch >= 1
        segments = [(PROMPT[:20], engine.new_state()), (PROMPT[20:27], engine.new_state())]
        alone = [engine.forward(t, engine.new_state(), all_logits=False)[0] for t, _ in segments]
        together = engine.forward_batch(segments)
        assert together.shape == (2, tiny.config.n_vocab) and [s.position for _, s in segments] == [20, 7]
        for got, want in zip(together, alone):
            close(got, want)
        with pytest.raises(FermoeError, match="distinct sequences"):
            engine.forward_batch([segments[0], segments[0]])
        engine.close()


@pytest.mark.parametrize("gdn", ["chunked", "recurrent"])
def test_tiny_model_logits_match_the_reference(tiny, reference_logits, device_kind, gdn):
    engine = gpu(tiny, device_kind, gdn=gdn)
    state = engine.new_state()
    close(engine.forward(PROMPT, state), reference_logits)
    assert state.position == len(PROMPT)
    close(state.logits, reference_logits[-1])


@pytest.mark.parametrize("model_fixture, kv", [("tiny_path", "f32"), ("tiny_path", "f16")])
def test_q8_0_model_and_kv_dtypes(model_fixture, kv, request, device_kind):
    model = Model(request.getfixturevalue(model_fixture))
    ref = ReferenceEngine(model, kv_cache_dtype=kv)
    engine = gpu(model, device_kind, kv_cache_dtype=kv)
    state = engine.new_state()
    got = engine.forward(PROMPT, state)
    close(got, ref.forward(PROMPT, ref.new_state()))
    other = ReferenceEngine(model, kv_cache_dtype="f32" if kv == "f16" else "f16")
    with pytest.raises(AssertionError, match="max"):        # the two dtypes are told apart
        close(got, other.forward(PROMPT, other.new_state()), 2 * GPU_RTOL)
    ref_state = ref.new_state()
    ref.forward(PROMPT, ref_state)
    for a in range(len(model.config.attention_layers)):      # the KV handed over, in the state's dtype
        for got, want in zip(state.kv.view(a), ref_state.kv.view(a)):
            assert state.kv.dtype_name == kv
            close(got, want, 2e-3 if kv == "f16" else GPU_RTOL, floor=0.1)   # f16: a rounding may flip an ulp


HF_SHAPES = [("qwen3next-b", "q8_0"), ("qwen35moe-b", "q4_0"), ("qwen3next-a", "f32")]


@pytest.mark.oracle
@pytest.mark.parametrize("shape, out_type", HF_SHAPES)
def test_hugging_face_shapes(shape, out_type, tmp_path, device_kind):
    """Qwen3-Next (value heads in HF order, fused beta/alpha) and Qwen3.5 shapes with odd
    head counts, through `fermoe convert`: the GPU engine's logits are Hugging Face's."""
    from modeltools.convert import convert
    from tests.support.hf_oracle import build_hf_model, hf_logits, round_trip_weights, save_checkpoint
    from shared.ggml_types import GGMLType
    hf = build_hf_model(shape, seed=3)
    if out_type != "f32":
        round_trip_weights(hf, GGMLType.Q8_0 if out_type == "q8_0" else GGMLType.Q4_0)
    path = tmp_path / "m.gguf"
    convert(save_checkpoint(hf, tmp_path / "hf"), path, out_type, progress=False)
    ids = np.random.default_rng(3).integers(0, 400, 80).tolist()
    engine = gpu(Model(path), device_kind, kv_cache_dtype="f32")
    close(engine.forward(ids, engine.new_state()), hf_logits(hf, ids), HF_RTOL)


def _reference_state(model, tokens, kv="f16"):
    ref = ReferenceEngine(model, kv_cache_dtype=kv)
    state = ref.new_state()
    ref.forward(tokens, state)
    return state


@pytest.mark.parametrize("pass_tokens, boundaries, gdn", [(24, [8, 16, 40, 64, 80], "auto"),
                                                          (None, [5, 33, 70], "chunked"),
                                                          (None, [5, 33, 70], "recurrent")])
def test_passes_and_snapshot_boundaries(tiny, reference_logits, device_kind, pass_tokens, boundaries, gdn):
    """A prompt in passes of a few tokens gives the logits of one pass, and the states at
    the snapshot boundaries are the reference's states at those positions."""
    engine = gpu(tiny, device_kind, max_pass_tokens=pass_tokens, gdn=gdn)
    state = engine.new_state()
    logits, snaps = engine.prefill(PROMPT, state, snapshot_at=boundaries + [0, 500], all_logits=True)
    close(logits, reference_logits)
    assert sorted(snaps) == boundaries                 # positions outside the prompt are ignored
    for p, snap in snaps.items():
        want = _reference_state(tiny, PROMPT[:p])
        assert snap.position == p and snap.logits_valid
        close(snap.ssm, want.ssm, floor=0.1)
        close(snap.conv, want.conv, floor=0.1)
        close(snap.logits, want.logits)
        for a in range(len(tiny.config.attention_layers)):
            assert len(snap.kv.view(a)[0]) == p
            close(snap.kv.view(a)[0], want.kv.view(a)[0], 2e-3, floor=0.1)


@pytest.mark.parametrize("pass_tokens, gdn", [(None, "auto"), (40, "chunked"), (None, "recurrent")])
def test_several_prompts_in_one_batch_each_get_their_own_results(tiny, device_kind, pass_tokens, gdn):
    """Three prompts prefilled together (one resumed from a state made elsewhere, with
    snapshots; passes that cut a prompt in two) give each prompt the logits, final
    state and snapshots of the reference run on that prompt alone."""
    from gpu_worker.engine import PrefillJob
    engine = gpu(tiny, device_kind, max_pass_tokens=pass_tokens, gdn=gdn)
    prompts = [PROMPT[:50], PROMPT[10:80][::-1], PROMPT]
    resumed = _reference_state(tiny, PROMPT[:30])
    jobs = [PrefillJob(prompts[0], engine.new_state(), snapshot_at=[20]),
            PrefillJob(prompts[1], engine.new_state()),
            PrefillJob(PROMPT[30:], resumed, snapshot_at=[31, 64, 80])]
    results = engine.prefill_batch(jobs, all_logits=True)
    for tokens, job, (logits, snaps) in zip(prompts, jobs, results):
        want = ReferenceEngine(tiny).forward(tokens, ReferenceEngine(tiny).new_state())
        close(logits, want[len(tokens) - len(logits):])
        end = _reference_state(tiny, tokens)
        assert job.state.position == len(tokens)
        close(job.state.ssm, end.ssm, floor=0.1)
        close(job.state.conv, end.conv, floor=0.1)
        for p, snap in snaps.items():
            at = _reference_state(tiny, tokens[:p])
            assert snap.position == p
            close(snap.ssm, at.ssm, floor=0.1)
            close(snap.logits, at.logits)
        assert sorted(snaps) == sorted(job.snapshot_at)


def _budget_for(model, resident_layers, ring_slots=2, tokens=len(PROMPT)):
    """A budget that keeps `resident_layers` expert layers resident for a `tokens` prompt."""
    ws = -(-tokens // 64) * 64
    full = make_plan(model, 1 << 40, ws, ring_slots, kv_positions=tokens, n_chunks=ws // 64)
    fixed = full.resident_weights + full.state + full.workspace + full.kv
    return fixed + MARGIN + (ring_slots + resident_layers) * full.layer_bytes + full.layer_bytes // 2


@pytest.mark.parametrize("order", ["copy-first", "compute-first"])
@pytest.mark.parametrize("options", [dict(resident=False), dict(resident=False, ring_slots=1),
                                     dict(resident=False, ring_slots=3), dict(resident=False, pinned=False),
                                     dict(resident=False, overlap=False), dict(resident=False, used_experts=1.01),
                                     dict(gpu_mem="one resident layer"), dict(resident=False, max_pass_tokens=24)])
def test_streamed_experts_give_the_logits_of_resident_ones(tiny, order, options):
    """A budget too small for every expert layer streams them through the ring: under the
    most hostile schedules of the host emulation (copies run as early, or compute as
    early, as the events allow), page-locked or not, overlapped or not, copying only the
    experts used: the same logits, bit for bit, as with every layer resident."""
    options = dict(options)
    if options.get("gpu_mem") == "one resident layer":
        options["gpu_mem"] = _budget_for(tiny, 1)
    resident = gpu(tiny, "emulate")
    want = resident.forward(PROMPT, resident.new_state())
    assert resident.plan.streamed_layers == 0
    engine = gpu(tiny, "emulate", order=order, **options)
    got = engine.forward(PROMPT, engine.new_state())
    assert engine.plan.streamed_layers == (3 if "gpu_mem" in options else 4)
    if "max_pass_tokens" in options:
        close(got, want)
    else:
        np.testing.assert_array_equal(got, want)


def test_streaming_on_the_device(tiny, device_kind):
    """On the device itself: pinned and pageable, overlapped and serial, chunked, all agree."""
    resident = gpu(tiny, device_kind)
    want = resident.forward(PROMPT, resident.new_state())
    for options in (dict(resident=False), dict(resident=False, pinned=False), dict(resident=False, overlap=False),
                    dict(resident=False, max_pass_tokens=24)):
        engine = gpu(tiny, device_kind, **options)
        close(engine.forward(PROMPT, engine.new_state()), want)


def test_the_handed_over_state_decodes_on_the_cpu_engine(tiny, device_kind):
    """Prefill on the GPU, decode on the CPU engine from the state it hands over: the
    greedy tokens of a CPU-only run."""
    from cpu_worker.native_engine import NativeEngine
    cpu = NativeEngine(tiny, threads=1)
    greedy = SamplingParams(temperature=0.0)
    alone = list(generate(cpu, PROMPT, 16, greedy))
    assert list(generate(cpu, PROMPT, 16, greedy, prefill=gpu(tiny, device_kind))) == alone
    cpu.close()


def test_resumes_from_a_state_made_elsewhere(tiny, reference_logits, device_kind):
    """A state prefilled by the reference (a snapshot, say) goes on on the GPU from its
    position: its KV and recurrent state go up, the rest of the prompt runs."""
    state = _reference_state(tiny, PROMPT[:30])
    engine = gpu(tiny, device_kind)
    close(engine.forward(PROMPT[30:], state), reference_logits[30:])
    close(engine.forward([7], state), _logits_after(tiny, PROMPT + [7]))


def _logits_after(model, tokens):
    ref = ReferenceEngine(model)
    return ref.forward(tokens, ref.new_state())[-1:]


def test_errors_name_the_problem(tiny):
    with pytest.raises(FermoeError, match="--gpu-mem 1 MiB is too small"):
        gpu(tiny, "emulate", gpu_mem=1 << 20)
    with pytest.raises(FermoeError, match="MiB free"):
        gpu(tiny, "emulate", gpu_mem=1 << 50)
    engine = gpu(tiny, "emulate")
    with pytest.raises(FermoeError, match=r"token ids must be in \[0, 512\)"):
        engine.forward([1, 512], engine.new_state())
    state = engine.new_state()
    state.position = tiny.config.n_ctx_train - 1
    with pytest.raises(FermoeError, match="exceed the model's context length"):
        engine.forward([1, 2], state)
    f32_state = ReferenceEngine(tiny, kv_cache_dtype="f32").new_state()
    with pytest.raises(FermoeError, match="keeps its KV in f32"):
        engine.forward([1, 2], f32_state)


# ---- the command line -----------------------------------------------------------------------
def test_logits_and_generate_with_engine_gpu(tiny_q4_path, tmp_path, reference_logits):
    out = tmp_path / "gpu.npy"
    run = fermoe("logits", tiny_q4_path, "--engine", "gpu", "--gpu-mem", "512MiB", "--tokens",
                 ",".join(map(str, PROMPT)), "--out", out, env={"FERMOE_GPU": "emulate"}, check=False)
    assert run.returncode == 0, run.stderr
    close(np.load(out), reference_logits)
    args = ("generate", tiny_q4_path, "-p", "The old GPU said", "-n", 12, "--temp", 0)
    on_gpu = fermoe(*args, "--engine", "gpu", env={"FERMOE_GPU": "emulate"}, check=False)
    assert on_gpu.returncode == 0, on_gpu.stderr
    assert on_gpu.stdout == fermoe(*args, "--engine", "cpu", check=False).stdout and on_gpu.stdout.strip()


@pytest.mark.parametrize("args, env, message", [
    (["--engine", "gpu"], {"FERMOE_GPU": "warp"}, "FERMOE_GPU='warp': expected emulate"),
    (["--engine", "gpu", "--gpu-mem", "lots"], {"FERMOE_GPU": "emulate"}, "size 'lots'"),
    (["--engine", "gpu", "--gpu-mem", "1MiB"], {"FERMOE_GPU": "emulate"}, "--gpu-mem 1 MiB is too small"),
    (["--engine", "gpu", "--gpu", "-1"], {"FERMOE_GPU": "emulate"}, "--gpu -1: must be >= 0"),
])
def test_gpu_options_are_refused_in_one_line(tiny_q4_path, tmp_path, args, env, message):
    run = fermoe("logits", tiny_q4_path, "--tokens", "1,2", "--out", tmp_path / "x.npy", *args, env=env, check=False)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith("fermoe: error:") and message in run.stderr, run.stderr


def test_engine_gpu_without_pycuda_says_so_in_one_line(tiny_q4_path, tmp_path):
    """Run everywhere: a pycuda package first on the path that fails to import, as a
    missing one does, hides an installed pycuda."""
    missing = tmp_path / "no-pycuda"
    (missing / "pycuda").mkdir(parents=True)
    (missing / "pycuda" / "__init__.py").write_text("raise ImportError(\"No module named 'pycuda'\")\n")
    path = os.pathsep.join(p for p in (str(missing), os.environ.get("PYTHONPATH")) if p)
    run = fermoe("logits", tiny_q4_path, "--engine", "gpu", "--tokens", "1,2", "--out", tmp_path / "x.npy",
                 env={"FERMOE_GPU": None, "PYTHONPATH": path}, check=False)
    assert run.returncode == 1 and run.stderr.count("\n") == 1
    assert "--engine gpu needs pycuda" in run.stderr and "FERMOE_GPU=emulate" in run.stderr


def test_a_long_prompt_takes_the_memory_of_resident_layers_and_gives_it_back(tiny):
    """Resident expert layers are a cache: a prompt whose attention KV needs their VRAM
    evicts them (they stream instead), a short one after it takes them back."""
    budget = _budget_for(tiny, 1, tokens=16)
    engine = gpu(tiny, "emulate", gpu_mem=budget, max_pass_tokens=16)
    engine.forward(PROMPT[:16], engine.new_state())
    assert engine.plan.resident_layers == 1
    long_prompt = np.random.default_rng(1).integers(3, 500, 110).tolist()   # its KV: about a layer more
    ref = ReferenceEngine(tiny)
    close(engine.forward(long_prompt, engine.new_state()), ref.forward(long_prompt, ref.new_state()))
    assert engine.plan.resident_layers == 0 and len(engine.experts.resident) == 0
    close(engine.forward(PROMPT[:16], engine.new_state()), reference_logits_of(tiny, PROMPT[:16]))
    assert len(engine.experts.resident) == 1


def reference_logits_of(model, tokens):
    ref = ReferenceEngine(model)
    return ref.forward(tokens, ref.new_state())


def test_bench_prefill_reports_its_floor_and_phases(tiny_q4_path, monkeypatch):
    """`fermoe bench prefill`, on the host emulation: each expert layer streamed once a
    pass, the floor the larger of copy and compute, the phases' time accounted."""
    from bench.prefill import run
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    out = run(str(tiny_q4_path), prompt_tokens=80, reps=1, chunk=32, resident=False)
    layer = out["memory"]["layer_mib"] * 2**20
    assert out["passes"] == 3 and out["memory"]["streamed_expert_layers"] == 4
    assert abs(out["streamed_gb"] * 1e9 - 3 * 4 * layer) <= 1e6       # 4 layers, each pass
    assert out["floor"]["floor_s"] == max(out["floor"]["copy_s"], out["floor"]["compute_s"]) > 0
    assert set(out["phases_ms"]) >= {"dense", "experts", "attention", "gdn", "copy_wait", "lm_head"}
    assert out["gflop_by_part"]["experts"] > 0 and out["prefill_s"] > 0
    families = out["kernel_families"]
    assert set(families) == {"dense", "experts", "attention", "gdn"}
    assert all(f["ms"] > 0 and f["fraction_of_fma"] > 0 for f in families.values())
    import bench.prefill
    assert_keys_documented(out, bench.prefill)


def test_bench_kernels_gpu_reports_every_shape():
    """`fermoe bench kernels --gpu` on the host emulation (the tiny preset's shapes):
    every dense projection and both grouped expert launches, Q4_0 and fp32 weights,
    the tile sweeps, the routed rows' share of the tiles, the chunked GDN's kernels."""
    from bench.gpu_kernels import dense_shapes, run
    from gpu_worker.emulator import EmulatedDevice
    out = run("tiny", (37,), reps=1, batch=1, device=EmulatedDevice(), probe_ms=1)
    part = out["prompts"]["37"]
    assert [d["name"] for d in part["dense"]] == [s["name"] for s in dense_shapes(tiny_config())]
    assert [e["name"] for e in part["experts"]] == ["experts_gate_up", "experts_down"]
    for row in part["dense"] + part["experts"]:
        assert row["q4_0"]["ms"] > 0 and row["f32"]["ms"] > 0
    assert all(set(d["tiles_q4_0"]) == {"32", "64", "128"} for d in part["dense"] if d["tile_rows"] != "narrow")
    for e in part["experts"]:
        assert e["M"] == 37 * 2 and 0 < e["useful_fraction"]["of_tiles"] <= e["useful_fraction"]["of_computed"] <= 1
        assert set(e["tiles_q4_0"]) == {"64", "128"}
        assert all(t["useful_fraction"]["tiles"] > 0 for t in e["tiles_q4_0"].values())
    gdn = part["gdn"]
    assert gdn["chunks"] == 1 and all(ms > 0 for ms in gdn["ms"].values())
    assert out["fp32_fma_tflops"] > 0
    import bench.gpu_kernels
    assert_keys_documented(out, bench.gpu_kernels)


def tiny_config():
    from modeltools.synth import preset_config
    return preset_config("tiny")


def test_host_expert_memory_is_interleaved_over_numa_nodes(tiny, monkeypatch):
    """Where there are several NUMA nodes, the streamed layers' page-locked copies are
    allocated and first touched under an interleave policy over all of them, and the
    policy is put back after (a recorded py-libnuma: this machine has one node)."""
    import sys
    import types
    calls = []
    info = types.SimpleNamespace(get_max_node=lambda: 1)
    memory = types.SimpleNamespace(set_interleave_nodes=lambda *n: calls.append(("interleave", n)),
                                   set_local_alloc=lambda: calls.append(("local",)))
    monkeypatch.setitem(sys.modules, "numa", types.SimpleNamespace(info=info, memory=memory))
    engine = gpu(tiny, "emulate", resident=False)
    engine.forward(PROMPT[:8], engine.new_state())
    assert engine.experts.host_bytes == 4 * engine.experts.layer_bytes
    assert calls == [("interleave", (0, 1)), ("local",)] * 4       # one streamed layer at a time


@pytest.mark.parametrize("order", ["copy-first", "compute-first"])
def test_a_short_prompt_copies_only_the_experts_it_uses(tiny, order):
    """Three tokens route to at most six of the eight experts a layer: only those cross
    (one copy each, packed in the slot), and the logits are those of all resident."""
    resident = gpu(tiny, "emulate")
    want = resident.forward(PROMPT[:3], resident.new_state())
    engine = gpu(tiny, "emulate", order=order, resident=False)
    got = engine.forward(PROMPT[:3], engine.new_state())
    np.testing.assert_array_equal(got, want)
    full = 4 * engine.experts.layer_bytes
    assert 0 < engine.experts.copied_bytes <= full * 6 // 8
