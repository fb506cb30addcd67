"""What keeps the CUDA kernels honest without a GPU: the Fermi (sm_20) check with
clang-14's NVPTX back end, the host emulation's execution model, and the memory
plan the engine allocates by."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from gpu_worker import fermi_check
from gpu_worker.cuda_source import CUDA_DIR, compose, kernel_files, kernel_signatures
from gpu_worker.emulator import EmulatedDevice, EmulationError, EmuModule, build_library
from gpu_worker.kernels import DENSE_BM, MOE_DOWN_TILES, MOE_GATEUP_TILES, Kernel, check_tiles, signatures
from shared.errors import FermoeError

PRELUDE = CUDA_DIR / "prelude.cuh"


@pytest.fixture(scope="module")
def clang():
    if fermi_check.find_clang() is None:
        if os.environ.get("CI"):
            pytest.fail("clang-14 is missing: .ci/run installs it (apt-get install clang-14)")
        pytest.skip("clang-14 not installed: the sm_20 check needs it (apt-get install clang-14)")


def test_every_kernel_compiles_for_sm_20_within_48_kb_of_shared_memory(clang):
    report = fermi_check.check_all()
    assert set(report) == {p.name for p in kernel_files()}
    entries = {name: shared for per_file in report.values() for name, shared in per_file.items()}
    assert set(entries) == set(signatures())           # every entry point has a launcher, and no more
    assert 0 < max(entries.values()) <= fermi_check.SHARED_LIMIT


def test_signatures_are_read_from_the_declarations(tmp_path):
    """Macro-made entries included; a parameter type the launcher cannot pass is refused by name."""
    probe = _cu(tmp_path, """
#define FM_PAIR(T) FM_KERNEL void twice_##T(T *y, const T *__restrict__ x, int n, long long stride, float a) {}
FM_PAIR(float)
FM_PAIR(int)
FM_KERNEL FM_BOUNDS(256, 2) void bounded(unsigned *flags, unsigned int n) {}
FM_DEVICE int helper(int a) { return a; }
""")
    assert kernel_signatures([probe]) == {"twice_float": "PPiqf", "twice_int": "PPiqf", "bounded": "PI"}
    bad = _cu(tmp_path, "FM_KERNEL void half(short h) {}")
    with pytest.raises(FermoeError, match=r"half: parameter 'short h' has a type the launcher cannot pass"):
        kernel_signatures([bad])


def test_the_launchers_tile_tables_are_the_sources():
    entries = signatures()
    check_tiles(entries)
    with pytest.raises(FermoeError, match="tile heights"):
        check_tiles({**entries, "gemm_m16_q4_0": "P"})
    gemm = (CUDA_DIR / "gemm.cu").read_text()
    for launch, tiles in (("GATEUP", MOE_GATEUP_TILES), ("DOWN", MOE_DOWN_TILES)):
        made = re.findall(rf"^\s*FM_GEMM_{launch}\(T, WT, (\d+), (\d+), \d+\)", gemm, re.M)
        assert {(int(bm), int(bn)) for bm, bn in made} == set(tiles.items())
    assert {int(bm) for bm in re.findall(r"^\s*FM_GEMM_DENSE\(T, WT, (\d+), \d+\)", gemm, re.M)} == set(DENSE_BM)


def _cu(tmp_path, body: str) -> Path:
    path = tmp_path / "probe.cu"
    path.write_text(f'#include "{PRELUDE}"\n{body}')
    return path


def test_the_check_refuses_what_fermi_lacks(clang, tmp_path):
    too_big = _cu(tmp_path, "FM_KERNEL void big(float *y) { __shared__ float s[12289]; s[threadIdx.x] = 1;"
                            " __syncthreads(); y[threadIdx.x] = s[threadIdx.x ^ 1]; }")
    shared = fermi_check.shared_bytes_per_entry(fermi_check.compile_ptx(too_big))
    assert shared["big"] == 12289 * 4 > fermi_check.SHARED_LIMIT
    shuffle = _cu(tmp_path, "FM_KERNEL void shfl(float *y) { y[0] = __nvvm_shfl_down_f32(y[0], 1, 31); }")
    with pytest.raises(RuntimeError, match="does not compile for sm_20"):
        fermi_check.compile_ptx(shuffle)


def test_nvcc_gets_a_source_without_include_directives():
    """pycuda's disk cache would run nvcc's preprocessor on every build otherwise."""
    source = compose("nvcc")
    assert "#include" not in source and "FM_GEMM_ENTRIES(q4_0, FM_W_Q4_0)" in source


# ---- the host emulation ---------------------------------------------------------------------------
def _module(tmp_path, body: str, signatures: dict[str, str]):
    device = EmulatedDevice()
    path, names = build_library(signatures, [_cu(tmp_path, body)])
    import ctypes
    return device, EmuModule(device, ctypes.CDLL(str(path)), names)


def _launch(device, module, name, sig, grid, block, *args):
    kernel = Kernel(module.get_function(name), name, sig, device, debug=False, owner=None)
    stream = device.stream("compute")
    kernel(grid, block, stream, *args)
    stream.synchronize()


def test_shared_memory_and_barriers_behave_as_on_a_gpu(tmp_path):
    """A block-wide reversal through shared memory: right only if every thread's write
    lands before any thread reads (the fibers switch at __syncthreads)."""
    body = ("FM_KERNEL void rev(float *y, const float *x, int n) { __shared__ float s[1024];"
            " int i = threadIdx.x + blockDim.x * threadIdx.y; s[i] = x[blockIdx.x * n + i]; __syncthreads();"
            " y[blockIdx.x * n + i] = s[n - 1 - i]; }")
    device, module = _module(tmp_path, body, {"rev": "PPi"})
    x = np.arange(3 * 600, dtype=np.float32)
    dx, dy = device.mem_alloc(x.nbytes), device.mem_alloc(x.nbytes)
    device.memcpy_htod(dx, x)
    _launch(device, module, "rev", "PPi", (3,), (200, 3), dy, dx, 600)
    y = np.empty_like(x)
    device.memcpy_dtoh(y, dy)
    np.testing.assert_array_equal(y.reshape(3, 600), x.reshape(3, 600)[:, ::-1])


@pytest.mark.parametrize("body, message", [
    ("FM_KERNEL void k(float *y) { if (threadIdx.x < 7) return; __syncthreads(); y[threadIdx.x] = 1; }",
     "some threads exited while others wait at __syncthreads"),
    ("FM_KERNEL void k(float *y) { if (threadIdx.x & 1) { __syncthreads(); } else {\n __syncthreads(); }"
     " y[threadIdx.x] = 1; }", "wait at different __syncthreads calls"),
])
def test_barrier_misuse_is_an_error(tmp_path, body, message):
    device, module = _module(tmp_path, body, {"k": "P"})
    y = device.mem_alloc(4 * 64)
    with pytest.raises(EmulationError, match=message):
        _launch(device, module, "k", "P", (2,), (64,), y)


def test_a_signature_that_does_not_match_the_kernel_does_not_build(tmp_path):
    with pytest.raises(EmulationError, match="do not match the signature"):
        _module(tmp_path, "FM_KERNEL void k(float *y, int n) { y[0] = n; }", {"k": "Pf"})


def test_the_device_refuses_host_pointers_and_deadlocks(tmp_path):
    device, module = _module(tmp_path, "FM_KERNEL void k(float *y) { y[threadIdx.x] = 1; }", {"k": "P"})
    host = np.zeros(64, np.float32)
    with pytest.raises(EmulationError, match="is not in device memory"):
        _launch(device, module, "k", "P", (1,), (64,), host.ctypes.data)
    a, b = device.stream("copy"), device.stream("compute")
    never = device.event()
    never.enqueued += 1                      # a record that nobody will run
    b.wait_for_event(never)
    with pytest.raises(EmulationError, match="deadlock"):
        device.synchronize()


def test_lazy_streams_run_only_when_the_host_waits():
    """copy-first: the copy stream runs at once, compute only at a synchronisation."""
    device = EmulatedDevice(order="copy-first")
    copy, compute = device.stream("copy"), device.stream("compute")
    buf = device.mem_alloc(4)
    device.memset_d8_async(buf, 1, 4, compute)
    assert not compute.is_done()
    device.memset_d8_async(buf, 2, 4, copy)
    out = np.zeros(4, np.uint8)
    device.memcpy_dtoh(out, buf)            # synchronises: compute's memset runs last
    assert out.tolist() == [1, 1, 1, 1]


# ---- the memory plan ------------------------------------------------------------------------------
def test_the_plan_counts_what_the_workspace_allocates(tiny_q4_path):
    from gpu_worker.workspace import Workspace, workspace_nbytes
    from shared.model import Model
    cfg = Model(tiny_q4_path).config
    for T in (1, 100, 1024):
        device = EmulatedDevice()
        Workspace(device, cfg, T)
        assert device.allocated == workspace_nbytes(cfg, T)


def test_resident_layers_fill_the_budget_and_spread_out(tiny_q4_path):
    from gpu_worker.experts import spread_resident
    from gpu_worker.plan import MARGIN, make_plan
    from shared.model import Model
    model = Model(tiny_q4_path)
    full = make_plan(model, 1 << 40, 256)
    assert full.resident_layers == 4 and full.ring == 0
    base = full.resident_weights + full.state + full.workspace + full.kv + MARGIN
    for resident in (0, 1):                  # (two resident and a ring of two: all four fit without the ring)
        plan = make_plan(model, base + (2 + resident) * full.layer_bytes + 10, 256)
        assert plan.resident_layers == resident and plan.ring == 2 * full.layer_bytes
        assert plan.total + MARGIN <= plan.budget
    assert len(spread_resident(40, 18)) == 18 and spread_resident(4, 0) == [] and spread_resident(4, 9) == [0, 1, 2, 3]
    for n in (4, 40):
        for r in range(n):                               # nested: one layer more keeps the others
            assert set(spread_resident(n, r)) < set(spread_resident(n, r + 1))
    gaps = np.diff(spread_resident(40, 20))
    assert gaps.max() <= 2 * 40 // 20                    # spread out, not bunched


def test_a_batch_runs_in_the_fewest_passes_that_fit(tiny_q4_path):
    """fit_passes: one pass when the budget holds it; else the fewest passes whose workspace
    fits beside the weights, a ring and the KV; a budget that holds no pass is refused."""
    from gpu_worker.plan import MARGIN, fit_passes, make_plan
    from shared.errors import FermoeError
    from shared.model import Model
    model = Model(tiny_q4_path)
    T = 1000
    one = fit_passes(model, 1 << 40, T, [T])
    assert (one.pass_tokens, one.ws_tokens, one.plan.resident_layers) == (T, 1024, 4)
    three = make_plan(model, 1 << 40, 384, 1, 0, kv_positions=T, n_chunks=6)     # passes of 334 tokens, no layer resident
    squeezed = fit_passes(model, three.total + MARGIN, T, [T], ring_slots=1, max_resident=0)
    assert squeezed.pass_tokens == 334 and -(-T // squeezed.pass_tokens) == 3
    assert squeezed.plan.total + MARGIN <= squeezed.plan.budget
    assert fit_passes(model, 1 << 40, T, [T], max_pass_tokens=100).pass_tokens == 100
    with pytest.raises(FermoeError, match="too small"):
        fit_passes(model, three.resident_weights, T, [T])
