"""The native CPU kernels (native/*.c) against the numpy spec, on every ISA (the
`isa` fixture of conftest.py: one this CPU lacks is a reported skip).

Reference: dequantise with shared.quants (exact: d * q fits a float32) and multiply
in float64. Each kernel's per-block integer dot is exact; only the float scaling
and the order of the float sums differ, so results are compared with a tolerance
relative to sum_i |w_i x_i| (the size of what is being summed), never to the
result itself, which may cancel to ~0.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import native
from shared import quants
from tests.support.bench_keys import assert_keys_documented

# |kernel - float64 reference| <= SUM_RTOL * sum_i |w_i x_i|: float32 rounding of each
# scaled partial sum (2^-24) plus float32 summation of up to ~10^4 of them in any order.
SUM_RTOL = 1e-5
# Two ISAs each within SUM_RTOL of the truth are within 2 * SUM_RTOL of each other.
ISA_RTOL = 2 * SUM_RTOL

SUPPORTED = native.supported_isas()
RNG = np.random.default_rng(20260)
QK = 32


# ---------------------------------------------------------------- helpers

def rand_f32(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def q4(Wf):
    return quants.quantize_q4_0(Wf)


def q8(Wf):
    return quants.quantize_q8_0(Wf)


def deq(raw, kind):
    return {"q4_0": quants.dequantize_q4_0, "q8_0": quants.dequantize_q8_0}[kind](raw)


def reference(Wd: np.ndarray, Xd: np.ndarray):
    """(float64 result, sum_i |w_i x_i|) for W [rows, n] and X [n] or [B, n].

    The scale is taken over elements: SIMD kernels scale and sum partial sums of a
    few elements, which can be larger than the block's total."""
    Wd, Xd = Wd.astype(np.float64), Xd.astype(np.float64)
    X2 = np.atleast_2d(Xd)
    ref, scale = (Wd @ X2.T).T, np.abs(X2) @ np.abs(Wd).T  # [B, rows]
    return (ref[0], scale[0]) if Xd.ndim == 1 else (ref, scale)


def assert_close(got, ref, scale, rtol=SUM_RTOL, what=""):
    err = np.abs(got.astype(np.float64) - ref)
    bound = rtol * scale + 1e-30
    bad = err > bound
    if not bad.any():
        return
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert not bad.any(), (f"{what}: {bad.sum()} of {err.size} values off; worst err {err[worst]:.3g} "
                           f"vs bound {bound[worst]:.3g} at {worst}")


def make_weights(kind, rows, cols):
    Wf = rand_f32(rows, cols)
    if kind == "q4_0":
        return q4(Wf)
    if kind == "q8_0":
        return q8(Wf)
    if kind == "f32":
        return Wf
    return Wf.astype(np.float16)


def weights_as_float(W, kind):
    return deq(W, kind) if kind in ("q4_0", "q8_0") else W.astype(np.float32)


def make_acts(kind, cols, B=None):
    Xf = rand_f32(cols) if B is None else rand_f32(B, cols)
    if kind in ("q4_0", "q8_0"):
        Xq = q8(Xf)
        return Xq, quants.dequantize_q8_0(Xq)
    return Xf, Xf


# ---------------------------------------------------------------- ISA selection

def test_build_compiles_every_source_and_depends_on_every_header():
    """Every C file of native/ is compiled, and every header (the templates the x86 files
    include among them) is a dependency, so editing one rebuilds the extension."""
    from native import build_native
    assert sorted(p.name for p in build_native.HERE.glob("*.c")) == sorted(build_native.SOURCES)
    assert sorted(p.name for p in build_native.HERE.glob("*.h")) == sorted(build_native.HEADERS)


def test_isa_selection():
    assert native.ISAS == ("scalar", "ssse3", "avx2", "avx512vnni")
    assert "scalar" in SUPPORTED and native.best_isa() == SUPPORTED[-1]
    assert native.get_isa() == (os.environ.get("FERMOE_ISA") or native.best_isa())
    with pytest.raises(native.ISAError, match="not one of"):
        native.set_isa("sse9")
    for name in set(native.ISAS) - set(SUPPORTED):
        with pytest.raises(native.ISAError, match=f"lacks {name}"):
            native.set_isa(name)
        assert native.lib.fm_set_isa(native.ISAS.index(name)) == -1
    with native.use_isa("scalar"):
        assert native.get_isa() == "scalar"


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code: str, isa_env: str, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, FERMOE_ISA=isa_env, **env)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)


def test_fermoe_isa_env_override():
    for name in SUPPORTED:
        r = run_python("import native; print(native.get_isa())", name)
        assert r.returncode == 0 and r.stdout.strip() == name, r.stderr
    r = run_python("import native", "sse9")
    assert r.returncode != 0 and "FERMOE_ISA='sse9' is not one of" in r.stderr
    for name in set(native.ISAS) - set(SUPPORTED):  # an ISA this CPU lacks: refused by name
        r = run_python("import native", name)
        assert r.returncode != 0 and f"FERMOE_ISA={name}: this CPU lacks {name}" in r.stderr
    r = run_python("import native", "", FERMOE_MAX_ISA="sse9")
    assert r.returncode != 0 and "FERMOE_MAX_ISA='sse9' is not one of" in r.stderr


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_best_isa_follows_the_cpu_flags():
    """Detection (CPUID, and the OS saving the AVX state) against what the kernel
    says of the CPU in /proc/cpuinfo (Linux drops the AVX flags where it does not
    save that state), each level needing the features its kernels use."""
    flags = _cpu_flags()
    if "fpu" not in flags:
        pytest.skip("no x86 flags in /proc/cpuinfo")
    want = "scalar"
    if "ssse3" in flags:
        want = "ssse3"
        if {"avx2", "fma", "f16c"} <= flags:
            want = "avx2"
            if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
                want = "avx512vnni"
    cap = os.environ.get("FERMOE_MAX_ISA")
    if cap:
        want = native.ISAS[min(native.ISAS.index(want), native.ISAS.index(cap))]
    assert native.best_isa() == want and SUPPORTED == list(native.ISAS[:native.ISAS.index(want) + 1])


def test_an_isa_this_cpu_lacks_is_a_reported_skip():
    """What an AVX2-only machine runs, shown here with FERMOE_MAX_ISA=avx2 hiding the
    levels above it: each of their cases is a skip whose reason names the ISA, the
    refusals of those ISAs (set_isa, FERMOE_ISA) hold, and the summary's last line
    says which ISAs ran and which were skipped, and why."""
    cap = "avx2"
    if cap not in SUPPORTED:
        pytest.skip(f"this CPU lacks {cap}: nothing to hide above it")
    ran = list(native.ISAS[:native.ISAS.index(cap) + 1])
    hidden = [n for n in native.ISAS if n not in ran]
    me = os.path.relpath(os.path.abspath(__file__), ROOT)
    tests = [f"{me}::{t}" for t in ("test_isa_selection", "test_fermoe_isa_env_override",
                                    "test_best_isa_follows_the_cpu_flags", "test_all_zero_blocks")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests],
                       env=dict(os.environ, FERMOE_MAX_ISA=cap), capture_output=True, text=True, cwd=ROOT)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert f"{3 + len(ran)} passed, {len(hidden)} skipped" in out, out
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    for name in hidden:
        assert sum(f"this CPU lacks {name}" in line for line in skips) == 1, out
    summary = [line for line in out.splitlines() if line.startswith("ISAs: ")]
    assert len(summary) == 1, out
    assert summary[0].startswith("ISAs: ran " + ", ".join(f"{n} (1 test)" for n in ran) + "; skipped "), summary
    for name in hidden:
        assert f"{name} (1 test: isa={name}: this CPU lacks {name}" in summary[0], summary


# ---------------------------------------------------------------- fp16 and quantisation

def test_fp16_conversions_match_numpy():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = np.array([native.lib.fm_fp16_to_fp32(int(v)) for v in h[::7]], np.float32)
    theirs = h[::7].view(np.float16).astype(np.float32)
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))
    f = np.concatenate([rand_f32(3000, scale=s) for s in (1e-7, 1e-5, 1.0, 3e4)] + [np.array(
        [0.0, -0.0, 65504, 65519.99, 65520, 1e9, -np.inf, np.inf, 2.0 ** -24, 2.0 ** -25,
         2.0 ** -25 * 1.0000001, 2.0 ** -14, 6.1e-5, 5.96e-8, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11],
        np.float32)])
    ours = np.array([native.lib.fm_fp32_to_fp16(float(v)) for v in f], np.uint16)
    with np.errstate(over="ignore"):
        assert np.array_equal(ours, f.astype(np.float16).view(np.uint16))


def special_rows() -> np.ndarray:
    """Blocks at the corners of Q8_0 quantisation (ties, extremes, non-finite, tiny)."""
    base = rand_f32(32)
    rows = [np.zeros(32, np.float32), base, -base, base * np.float32(1e-38), base * np.float32(3e37),
            base * np.float32(1e6), np.full(32, -2.5, np.float32)]
    rows.append(np.array([127, -127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5] * 4, np.float32))
    rows.append(np.array([np.nextafter(np.float32(0.5), np.float32(0))] * 31 + [127], np.float32))
    for bad in (np.inf, -np.inf, np.nan):
        b = base.copy()
        b[5] = bad
        rows.append(b)
    for d in (1 + 2.0 ** -11, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25):  # fp16 rounding edges of d
        b = base / np.abs(base).max() * np.float32(127 * d)
        rows.append(b.astype(np.float32))
    return np.stack(rows)


def test_quantize_row_q8_0_bit_exact(isa):
    for x in (rand_f32(32), rand_f32(7 * 32), rand_f32(5, 33 * 32, scale=10.0), special_rows()):
        with np.errstate(all="ignore"):
            want = quants.quantize_q8_0(x)
        got = native.quantize_row_q8_0(x)
        assert got.shape == want.shape and np.array_equal(got, want), isa


# ---------------------------------------------------------------- dot products

@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
@pytest.mark.parametrize("nblocks", [1, 2, 3, 7, 8, 9, 16, 17, 33, 300])
def test_vec_dot(isa, kind, nblocks):
    W = make_weights(kind, 1, nblocks * QK)
    xq, xd = make_acts(kind, nblocks * QK)
    ref, scale = reference(weights_as_float(W, kind), xd)
    got = native.vec_dot(W[0], xq, kind)
    assert_close(np.array([got]), ref, scale, what=f"{isa} {kind} dot, {nblocks} blocks")


# ---------------------------------------------------------------- matrix-vector

@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "f32", "f16"])
@pytest.mark.parametrize("rows,nblocks", [(1, 1), (2, 2), (3, 3), (5, 7), (13, 9), (7, 17), (9, 48), (6, 300)])
def test_matvec(isa, kind, rows, nblocks):
    W = make_weights(kind, rows, nblocks * QK)
    x, xd = make_acts(kind, nblocks * QK)
    ref, scale = reference(weights_as_float(W, kind), xd)
    assert_close(native.matvec(W, x, kind), ref, scale, what=f"{isa} {kind} matvec")


@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "f32", "f16"])
def test_matvec_row_ranges(isa, kind):
    rows, cols = 11, 19 * QK
    W = make_weights(kind, rows, cols)
    x, xd = make_acts(kind, cols)
    ref, scale = reference(weights_as_float(W, kind), xd)
    for r0, r1 in [(0, 1), (3, 10), (4, 5), (10, 11), (6, 6), (0, 11)]:
        out = np.full(rows, 12345.0, np.float32)
        native.matvec(W, x, kind, r0, r1, out=out)
        assert_close(out[r0:r1], ref[r0:r1], scale[r0:r1], what=f"{isa} {kind} rows [{r0},{r1})")
        assert (np.delete(out, range(r0, r1)) == 12345.0).all(), "rows outside the range were written"


def test_matvec_large(isa):
    """A matrix larger than one activation chunk (256 blocks) and the caches' lines."""
    rows, cols = 37, 16384 + 5 * QK
    W = make_weights("q4_0", rows, cols)
    x, xd = make_acts("q4_0", cols)
    ref, scale = reference(weights_as_float(W, "q4_0"), xd)
    assert_close(native.matvec(W, x, "q4_0"), ref, scale, what=f"{isa} large q4_0")


def test_fp16_rows_convert_as_numpy(isa):
    """The KV cache's conversions, bit for bit: every half to float, and floats of
    every magnitude (subnormal halves, ties, overflow to inf, inf, NaN) to half.
    Signalling NaNs are left out: F16C quiets them, and no K or V is one."""
    from native import ffi, lib
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    halves = halves[((halves & 0x7c00) != 0x7c00) | ((halves & 0x03ff) == 0) | ((halves & 0x0200) != 0)]
    out = np.empty(halves.size, np.float32)
    lib.fm_fp16_to_fp32_row(ffi.cast("uint16_t *", ffi.from_buffer(halves)), ffi.cast("float *", ffi.from_buffer(out)),
                            halves.size)
    np.testing.assert_array_equal(out.view(np.uint32), halves.view(np.float16).astype(np.float32).view(np.uint32))
    finite = np.arange(0x7c00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = (finite[:-1] + finite[1:]) / 2                                   # exact in float32
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(50_000) * np.exp2(rng.integers(-30, 20, 50_000)), ties, -ties,
                        [0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, np.inf, -np.inf, np.nan]]).astype(np.float32)
    got = np.empty(x.size, np.uint16)
    lib.fm_fp32_to_fp16_row(ffi.cast("float *", ffi.from_buffer(x)), ffi.cast("uint16_t *", ffi.from_buffer(got)),
                            x.size)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(np.float16).view(np.uint16))


ATTN_RTOL = 1e-5             # float sums in another order than numpy's


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("G, hd, n", [(8, 256, 64), (8, 256, 5), (2, 32, 17), (9, 64, 3), (3, 36, 7), (1, 8, 1)])
def test_attention_kernels(isa, kv, G, hd, n):
    """fm_attn_scores / fm_attn_accumulate against numpy, rows scattered as KV pages are."""
    from native import ffi, lib
    rng = np.random.default_rng(G * 1000 + hd + n)
    dtype = np.float16 if kv == "f16" else np.float32
    pages = [rng.standard_normal((2, hd)).astype(dtype) for _ in range(n)]   # row 1 of each: another head
    rows = ffi.new("void *[]", [ffi.cast("void *", ffi.from_buffer(pg[1:])) for pg in pages])
    K = np.stack([pg[1] for pg in pages]).astype(np.float32)
    q = rng.standard_normal((G, 2 * hd)).astype(np.float32)                 # [query | gate], as attention.c
    s = np.full((G, 70), np.nan, np.float32)
    lib.fm_attn_scores(ffi.cast("float *", ffi.from_buffer(q)), 2 * hd, G, rows, int(kv == "f16"), n, hd,
                       ffi.cast("float *", ffi.from_buffer(s)), 70)
    want = q[:, :hd].astype(np.float64) @ K.T.astype(np.float64)
    np.testing.assert_allclose(s[:, :n], want, rtol=0, atol=ATTN_RTOL * np.abs(want).max())
    assert np.isnan(s[:, n:]).all()
    p = rng.random((G, 70)).astype(np.float32)
    acc = rng.standard_normal((G, hd)).astype(np.float32)
    want = acc.astype(np.float64) + p[:, :n].astype(np.float64) @ K.astype(np.float64)
    lib.fm_attn_accumulate(ffi.cast("float *", ffi.from_buffer(p)), 70, G, rows, int(kv == "f16"), n, hd,
                           ffi.cast("float *", ffi.from_buffer(acc)))
    np.testing.assert_allclose(acc, want, rtol=0, atol=ATTN_RTOL * np.abs(want).max())


def test_pool_matvec_covers_every_row_once(isa):
    """The benchmark's pooled product (rows cut into ~4 MB tasks over pinned
    threads) computes exactly what one call does, rows past a task edge included."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    rows, cols = 8192 + 37, 1024            # 4.7 MB: a 4 MB task and a ragged one
    W = make_weights("q4_0", rows, cols)
    x, _ = make_acts("q4_0", cols)
    y = np.full(rows, np.nan, np.float32)
    with native.Pool(cpus * 2) as pool:     # more threads than CPUs: still correct
        assert pool.matvec_q4_0_seconds(W, x, out=y) > 0
        assert pool.read_gbps(np.ones(1 << 20, np.uint8), reps=1) > 0
        assert pool.read_seconds(np.ones(1 << 20, np.uint8)) > 0
        assert pool.read_seconds(np.ones(1 << 20, np.uint8), prefetched=True) > 0
    np.testing.assert_array_equal(y, native.matvec(W, x, "q4_0"))


def test_pool_caller_sleeps_through_a_slow_worker_and_wakes():
    """A region whose worker outlasts the caller's spin (~50 us): the caller sleeps and
    the last worker wakes it, every time (no wake-up lost to the race between the two)."""
    import threading
    import time
    from native import ffi, lib
    cpus = sorted(os.sched_getaffinity(0))[:2]
    ran, ran_delay, took = [], [0.02], []

    @ffi.callback("void(void *, int, int)")
    def task(ctx, w, worker):
        if w == 1:
            time.sleep(ran_delay[0])
        ran.append(w)

    pool = native.Pool(cpus * (2 // len(cpus)))

    def regions():
        t0 = time.perf_counter()
        lib.fm_pool_run_each(pool._pool, task, ffi.NULL)
        took.append(time.perf_counter() - t0)
        for i in range(300):               # waits on both sides of the spin, most asleep
            ran_delay[0] = (i % 5) * 40e-6
            lib.fm_pool_run_each(pool._pool, task, ffi.NULL)

    t = threading.Thread(target=regions, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the caller was never woken"    # (the pool is left to the hung thread)
    pool.close()
    assert took[0] >= 0.02                   # it waited for the slow worker
    assert sorted(ran) == [0] * 301 + [1] * 301


_FM_TYPES = {"f32": 0, "q4_0": 2, "q8_0": 8}


def _tensor(W, kind, rows, cols, mat_stride=0):
    t = native.ffi.new("fm_tensor *")
    t.data, t.type, t.rows, t.cols, t.mat_stride = native.ffi.from_buffer(W), _FM_TYPES[kind], rows, cols, mat_stride
    return t


def test_job_regions_compute_each_row_once(isa):
    """fm_run_jobs (the forward's parallel products) over jobs of every weight type,
    one token and several, a 3-D tensor's matrix and gated pairs: as many threads as
    twice the CPUs claim runs of rows across job edges, and each result is the
    single call's, bit for bit; a pair's y is silu(gate) * up and its Q8_0 copy is
    y's exact quantisation."""
    ffi, lib = native.ffi, native.lib
    keep, jobs, checks = [], [], []

    def add(kind, rows, cols, B, mats=1, mat=0, up=False, quantised=False):
        Ws = [make_weights(kind, rows * mats, cols) for _ in range(2 if up else 1)]
        row_bytes = Ws[0].nbytes // (rows * mats)
        ts = [_tensor(W, kind, rows, cols, rows * row_bytes) for W in Ws]
        X, _ = make_acts(kind, cols, B)
        X = np.ascontiguousarray(X)
        Ys = [np.full((B, rows), np.nan, np.float32) for _ in Ws]
        hq = np.zeros((B, rows // QK * 34), np.uint8) if quantised else None
        fp = lambda a: ffi.cast("float *", ffi.from_buffer(a))
        xq = ffi.cast("block_q8_0 *", ffi.from_buffer(X)) if kind != "f32" else ffi.NULL
        jobs.append((ts[0], mat, fp(X) if kind == "f32" else ffi.NULL, xq, B, fp(Ys[0]), rows,
                     ts[1] if up else ffi.NULL, fp(Ys[1]) if up else ffi.NULL,
                     ffi.cast("block_q8_0 *", ffi.from_buffer(hq)) if quantised else ffi.NULL))
        keep.extend([Ws, ts, X, Ys, hq])
        mine = [W[mat * rows:(mat + 1) * rows] for W in Ws]
        want = [native.matvec(W, X[0], kind)[None] if B == 1 else native.matmul(W, X, kind) for W in mine]
        checks.append((kind, B, up, Ys, want, hq))

    add("q4_0", 8192 + 37, 1024, 1)             # 4.7 MB: many units, a ragged last one
    add("q8_0", 300, 256, 3)
    add("f32", 70, 96, 1)
    add("f32", 45, 64, 2)
    add("q4_0", 200, 512, 1, mats=3, mat=2)     # an expert of a 3-D tensor
    add("q4_0", 544, 512, 1, up=True, quantised=True)
    add("q8_0", 96, 256, 3, up=True, quantised=True)
    add("f32", 64, 64, 2, up=True)
    cjobs = ffi.new("fm_job[]", len(jobs))
    for j, fields in zip(cjobs, jobs):
        j.w, j.mat, j.x, j.xq, j.B, j.y, j.ldy, j.w_up, j.y_up, j.hq = fields
    cpus = sorted(os.sched_getaffinity(0))[:2]
    pool = lib.fm_pool_create(2 * len(cpus), ffi.new("int[]", cpus * 2))
    try:
        lib.fm_run_jobs(pool, cjobs, len(jobs))
    finally:
        lib.fm_pool_destroy(pool)
    for kind, B, up, Ys, want, hq in checks:
        if not up:
            np.testing.assert_array_equal(Ys[0], want[0], err_msg=f"{kind} B={B}")
            continue
        np.testing.assert_array_equal(Ys[1], want[1], err_msg=f"{kind} B={B} up")
        g = want[0].astype(np.float64)
        np.testing.assert_allclose(Ys[0], g / (1 + np.exp(-g)) * want[1], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{kind} B={B} silu(gate) * up")
        if hq is not None:
            np.testing.assert_array_equal(hq, native.quantize_row_q8_0(Ys[0]), err_msg=f"{kind} B={B} hq")


@pytest.mark.parametrize("prefetched", [False, True])
def test_read_sum_adds_the_whole_lines(prefetched):
    """The read probes sum every 64-bit word of the whole 128-byte lines, and no more."""
    buf = np.random.default_rng(7).integers(0, 256, 5 * 4096 + 200, dtype=np.uint8)
    whole = buf[:buf.nbytes // 128 * 128].view(np.uint64)
    want = int(whole.sum(dtype=np.uint64))
    assert native.read_sum(buf, prefetched=prefetched) == want


def test_bench_pairs_alternate_read_and_product_passes():
    from bench.kernels import paired_passes
    W = make_weights("q4_0", 256, 1024)
    x, _ = make_acts("q4_0", 1024)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    reads, prefetched, products = paired_passes(cpus, W, x, pairs=4)
    assert len(reads) == len(prefetched) == len(products) == 4 and min(reads + prefetched + products) > 0


def test_bench_kernels_reports_each_isa_against_bandwidth():
    import bench.kernels
    from bench.kernels import run
    if "ssse3" not in SUPPORTED:
        pytest.skip("this CPU lacks ssse3")
    out = run(matrix_mb=2, threads=2, reps=1, isas=["scalar", "ssse3"], batch_sizes=(4,),
              small_rows=64, pairs=3, decode_preset="tiny")
    assert out["setup"]["cpus"] and set(out["q4_0"]) == {"scalar", "ssse3"}
    for isa in ("scalar", "ssse3"):
        got = out["q4_0"][isa]
        for nt in ("1", "2"):
            low, high = got["fraction_of_read_bw_range"][nt]
            assert 0 < low <= got["fraction_of_read_bw"][nt] <= high
            assert got["matvec_gbps"][nt] > 0 and got["read_gbps"][nt] > 0 and got["prefetched_read_gbps"][nt] > 0
            assert got["fraction_of_prefetched_read_bw"][nt] > 0 and got["prefetched_read_fraction_of_read_bw"][nt] > 0
    assert out["ratios"]["ssse3_vs_scalar_matvec_1t"] > 1
    shaped = out["decode_shaped"]          # the same bytes in decode's regions of small matrices
    assert {"gdn_in", "gdn_out", "experts_gate_up", "experts_down"} <= set(shaped)
    for kind in ("gdn_in", "gdn_out", "experts_gate_up", "experts_down"):
        assert shaped[kind]["gbps"] > 0 and shaped[kind]["fraction_of_read_bw"] > 0
        assert shaped[kind]["regions_a_pass"] >= 1
        foreign, quiet = shaped[kind]["foreign_cpu_fraction"], shaped[kind]["quiet_pairs"]
        assert (foreign is None or 0 <= foreign <= 1) and 0 <= quiet <= 3
        assert (shaped[kind]["fraction_of_read_bw_quiet"] is None) == (quiet == 0)
    assert shaped["experts_gate_up"]["matrices"] == 2 * 2 + 2        # the tiny preset: 2 experts of 8, gate and up
    assert_keys_documented(out, bench.kernels)


def test_bench_kernels_matmul_sweep_times_each_shape_threads_and_batch():
    import bench.kernels
    out = bench.kernels.run_sweep(threads=2, reps=1, isas=["scalar"], shapes=((64, 256),), batch_sizes=(1, 2))
    by_b = out["matmul_q4_0"]["scalar"]["64x256"]
    assert set(by_b) == {"1t", "2t"} and set(by_b["2t"]) == {"1", "2", "matvec"}
    assert all(r["gmac_s"] > 0 and r["tokens_s"] > 0 and r["us"] > 0 for t in by_b.values() for r in t.values())
    assert_keys_documented(out, bench.kernels)


def test_decode_regions_are_the_forwards_at_real_sizes():
    from bench.kernels import decode_regions
    regions = decode_regions()
    assert regions["gdn_in"] == [(8192, 2048), (4096, 2048), (32, 2048), (32, 2048)]
    assert regions["experts_gate_up"][:16] == [(512, 2048)] * 16 and regions["experts_down"][:8] == [(2048, 512)] * 8
    assert sum(r * c // 32 * 18 for r, c in regions["experts_down"][:8]) == 8 * 589824     # 0.59 MB an expert matrix


# ---------------------------------------------------------------- batched

@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "f32"])
@pytest.mark.parametrize("B", range(1, 10))
def test_matmul(isa, kind, B):
    rows, nblocks = 7, [1, 17, 48][B % 3]
    W = make_weights(kind, rows, nblocks * QK)
    X, Xd = make_acts(kind, nblocks * QK, B)
    ref, scale = reference(weights_as_float(W, kind), Xd)
    out = np.full((B, rows + 3), 777.0, np.float32)  # ldy > rows
    native.matmul(W, X, kind, 1, rows, out=out)
    assert_close(out[:, 1:rows], ref[:, 1:], scale[:, 1:], what=f"{isa} {kind} matmul B={B}")
    assert (out[:, 0] == 777.0).all() and (out[:, rows:] == 777.0).all()


# Shapes of the tiled batched kernels (Q4_0/Q8_0: groups of 4 blocks on SSSE3, 8 on
# AVX2, 16 on AVX-512, tiles of up to 64 rows and 128 blocks; F32: 2 rows x 4 tokens,
# tiles of ~96 KB of rows): one group exactly, no whole group, a few groups with tail
# blocks, several column chunks with tail blocks, rows over several tiles; odd row
# ranges inside them.
TILED_SHAPES = [  # (nblocks, rows, row_begin, row_end)
    (8, 9, 0, 9),
    (7, 5, 1, 4),
    (16, 70, 5, 70),
    (75, 37, 3, 36),
    (16 * 9 + 3, 13, 2, 11),
]


@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "f32"])
@pytest.mark.parametrize("B", list(range(1, 14)) + [64])
def test_matmul_batches_and_tiles(isa, kind, B):
    """Every batch size 1..13 and 64 (token pairs or quads plus the rest) on every tile shape."""
    for nblocks, rows, r0, r1 in TILED_SHAPES:
        W = make_weights(kind, rows, nblocks * QK)
        X, Xd = make_acts(kind, nblocks * QK, B)
        ref, scale = reference(weights_as_float(W, kind), Xd)
        out = np.full((B, rows + 5), 777.0, np.float32)  # ldy > rows
        native.matmul(W, X, kind, r0, r1, out=out)
        what = f"{isa} {kind} matmul B={B} {nblocks} blocks rows [{r0},{r1}) of {rows}"
        assert_close(out[:, r0:r1], ref[:, r0:r1], scale[:, r0:r1], what=what)
        assert (out[:, :r0] == 777.0).all() and (out[:, r1:] == 777.0).all(), what + ": wrote outside"


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
@pytest.mark.parametrize("cols", [512, 2048 + 3 * QK, 4096, 8192 + 5 * QK])
@pytest.mark.parametrize("B", [2, 3, 4, 11])
def test_matmul_rows_are_matvec_bit_for_bit(isa, kind, cols, B):
    """Each row of a batched product is exactly the matrix-vector product, whatever
    the row or token falls in (2x2 tiles, odd rows and tokens, k-chunks, tail
    blocks, the few-token path): so a prompt gives the same bits run whole, chunked
    or token by token, and a sequence decoded alone or beside others."""
    rows = 19
    W = make_weights(kind, rows, cols)
    X, _ = make_acts(kind, cols, B)
    got = native.matmul(W, X, kind)
    want = np.stack([native.matvec(W, X[b], kind) for b in range(B)])
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- edge blocks

def q4_block_bytes(d: float, nibbles: np.ndarray) -> np.ndarray:
    """Raw Q4_0 blocks: fp16 d and 32 nibble values 0..15 (element j, j+16 share byte j)."""
    nb = nibbles.shape[0]
    out = np.empty((nb, 18), np.uint8)
    out[:, :2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    out[:, 2:] = (nibbles[:, :16] | (nibbles[:, 16:] << 4)).astype(np.uint8)
    return out.reshape(-1)


def q8_block_bytes(d: float, ints: np.ndarray) -> np.ndarray:
    nb = ints.shape[0]
    out = np.empty((nb, 34), np.uint8)
    out[:, :2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    out[:, 2:] = ints.astype(np.int8).view(np.uint8)
    return out.reshape(-1)


def test_all_zero_blocks(isa):
    nb = 35
    Wq4 = np.zeros((3, nb * 18), np.uint8)   # d = 0 and nibbles 0: every weight 0
    Wq8 = np.zeros((3, nb * 34), np.uint8)
    xq = q8(np.zeros(nb * QK, np.float32))
    assert (native.matvec(Wq4, xq, "q4_0") == 0).all()
    assert (native.matvec(Wq8, xq, "q8_0") == 0).all()
    xq = q8(rand_f32(nb * QK))
    assert (native.matvec(Wq4, xq, "q4_0") == 0).all()
    assert (native.matmul(Wq8, np.stack([xq, xq]), "q8_0") == 0).all()


@pytest.mark.parametrize("nb", [1, 9, 48])
def test_extreme_values(isa, nb):
    """Largest |w * x| everywhere: int16 stages must not saturate, int32 sums stay exact."""
    sign = np.where(np.arange(nb * QK) % 3 == 0, -1, 1).reshape(nb, QK)
    x_ints = np.full((nb, QK), 127) * sign
    xq = q8_block_bytes(1.0, x_ints)
    xd = quants.dequantize_q8_0(xq)
    w4 = np.stack([q4_block_bytes(2.0, np.zeros((nb, QK), np.int64)),             # all -8
                   q4_block_bytes(2.0, np.full((nb, QK), 15)),                   # all +7
                   q4_block_bytes(65504.0, np.where(sign < 0, 0, 15))])          # fp16 max scale
    w8 = np.stack([q8_block_bytes(1.0, np.full((nb, QK), -128)),                  # -128 (never made by
                   q8_block_bytes(1.0, np.full((nb, QK), 127) * sign),           #  our quantiser, legal)
                   q8_block_bytes(65504.0, -np.full((nb, QK), 127) * sign)])
    for W, kind in ((w4, "q4_0"), (w8, "q8_0")):
        ref, scale = reference(deq(W, kind), xd)
        assert_close(native.matvec(W, xq, kind), ref, scale, what=f"{isa} extreme {kind}")
        got = native.matmul(W, np.stack([xq] * 3), kind)
        assert_close(got, np.stack([ref] * 3), np.stack([scale] * 3), what=f"{isa} extreme {kind} batched")


# ---------------------------------------------------------------- ISAs against the scalar reference

@pytest.mark.parametrize("isa", native.ISAS[1:], indirect=True)
@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "f32", "f16"])
def test_isas_agree_with_scalar(isa, kind):
    rows, cols, B = 29, 8192 + 9 * QK, 4
    W = make_weights(kind, rows, cols)
    x, xd = make_acts(kind, cols)
    X, Xd = make_acts(kind, cols, B)
    _, scale = reference(weights_as_float(W, kind), xd)
    _, scale_b = reference(weights_as_float(W, kind), Xd)
    with native.use_isa("scalar"):
        want = native.matvec(W, x, kind)
        want_b = native.matmul(W, X, kind) if kind != "f16" else None
    assert_close(native.matvec(W, x, kind), want, scale, ISA_RTOL, f"{isa} vs scalar {kind}")
    if kind != "f16":
        assert_close(native.matmul(W, X, kind), want_b, scale_b, ISA_RTOL, f"{isa} vs scalar {kind} batched")


def test_bench_matrix_outgrows_the_last_level_cache(tmp_path):
    """The default matrix is 4x the highest cache level (each shared instance once)."""
    from bench.kernels import default_matrix_mb, last_level_cache_bytes
    for cpu in range(4):
        for index, (level, size, shared) in enumerate([(1, "48K", f"{cpu}"), (2, "2048K", f"{cpu}"),
                                                       (3, "150M", "0-1" if cpu < 2 else "2-3")]):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "size").write_text(f"{size}\n")
            (d / "shared_cpu_list").write_text(f"{shared}\n")
    assert last_level_cache_bytes(str(tmp_path)) == 300 << 20
    assert default_matrix_mb(str(tmp_path)) == 1200
    assert last_level_cache_bytes(str(tmp_path / "none")) == 0 and default_matrix_mb(str(tmp_path / "none")) == 288
