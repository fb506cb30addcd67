"""Kernel benchmark: the CPU kernels' speed next to the memory read bandwidth, in one run.

    python -m bench.kernels [--matrix-mb M] [--threads 2] [--pairs 15] [--reps 5]
    python -m bench.kernels --matmul-sweep [--threads 2] [--reps 5] [--isa avx2]
    python -m bench.kernels --gpu [--gpu-prompts 947,8192] [--reps 5]   (bench/gpu_kernels.py)

prints JSON. Measured in the same process (these machines are noisy: their clock and
memory bandwidth drift within minutes, so only ratios measured together mean much):
  - for each ISA the CPU runs, with 1 and with N threads: --pairs passes of a plain C
    read loop (fm_read_sum) over a Q4_0 matrix far larger than the caches, alternated
    with as many Q4_0 x Q8_0 matrix-vector products over that same matrix (read first
    in even pairs, the product first in odd ones). The same pages on both sides: a
    buffer in 4 KB pages can read slower than one in huge pages, and which a buffer
    gets depends on the memory free at the time. Reported: the median
    read GB/s, the median product GB/s (weight bytes / time) and the fraction of the
    read bandwidth, the median of the pairs' ratios with their range. A pair shares
    the machine's state of the moment; the best of each side, taken apart, would not.
    Each pair also holds a pass of the read loop that prefetches ahead as the kernels
    do (fm_read_sum_prefetched): its GB/s, its fraction of the plain loop's (what the
    software prefetch alone costs a stream the hardware prefetchers would run), and
    the product's fraction of it;
  - for each ISA: the batched product (prefill) in tokens/s for B = 16 and 64, on a
    cache-sized matrix where it is compute-bound, and its speed-up over B matvecs
    (best of --reps);
  - ratios: SSSE3 (the paper's pmaddubsw kernel) over scalar C (the paper: 3x), and
    each ISA over SSSE3;
  - decode_shaped: the same bytes read the way a decode step reads its weights, in
    the parallel regions the forward runs (decode_regions: a GDN layer's input
    projections together, its output alone, the selected experts' gate and up
    together, then their downs), with the default ISA and N threads, alternated with
    read passes: each kind's GB/s and fraction of the read bandwidth, beside the one
    big matrix's above; and the share of the CPUs other processes took during the
    pairs (their median), with the fraction over the pairs where that share was
    under QUIET_FOREIGN_CPU: the regions meet at barriers, so a thread preempted by
    another process stalls them, where the read pass's tasks balance around it.
The read loop and the matrix-vector product both run on the engine's own thread
pool (native.Pool: threads pinned to the node's physical cores, rows cut into
~4 MB tasks), so the fraction compares like with like. The batched product runs
on a Python pool splitting the rows (the cffi calls release the GIL).

--matmul-sweep times only the batched Q4_0 product fm_matmul_q4_0 the way the
native forward calls it, at B in {1, 2, 4, 8, 12, 64}, on a 4096x2048 matrix (the
non-expert projections: B = the 64 tokens of a chunk) and a 512x2048 one (an
expert's gate/up: B = the few tokens routed to it), and a 2048x512 one (an
expert's down): GMAC/s and tokens/s per ISA, with 1 and N threads. Rows are cut
into tasks as native/linear.c cuts them (>= 64 rows, ~4 tasks a thread), each
task one kernel call; a thread loops over its tasks many times per timing, so
the Python overhead is amortised. B = 1 also times fm_matvec_q4_0 (what the
forward calls at B = 1) as "matvec".

--gpu prints bench/gpu_kernels.py's JSON instead: its keys are listed there.

JSON keys (of both outputs; <threads>: a thread count measured, 1 and --threads; <isa>: an ISA run):
  machine                 the CPU measured
  machine.cpu             its model name (/proc/cpuinfo)
  machine.logical_cpus    logical CPUs of the machine
  machine.isas            the kernel sets this CPU runs
  machine.default_isa     the one the engine runs (FERMOE_ISA or the best)
  setup                   what was measured, and how
  setup.matvec_matrix     the matrix-vector product's Q4_0 matrix, far larger than the caches
  setup.matvec_matrix.rows  its rows: as many as fill --matrix-mb MiB, a multiple of 64
  setup.matvec_matrix.cols  its columns (--cols)
  setup.matvec_matrix.bytes  bytes: its size
  setup.matmul_matrix     the batched product's cache-sized Q4_0 matrix
  setup.matmul_matrix.rows  its rows
  setup.matmul_matrix.cols  its columns (--cols)
  setup.matmul_matrix.bytes  bytes: its size
  setup.read_pass         text: what the read passes read
  setup.threads           the thread counts measured: 1 and --threads
  setup.reps              repetitions of each batched product timing; the best counts (--reps)
  setup.pairs             alternated read / product passes a median is taken over (--pairs)
  setup.cpus              the CPUs the native pool's threads are pinned to
  setup.threading         text: which pool runs which measurement
  setup.shapes            --matmul-sweep: the [rows, cols] of the Q4_0 matrices swept
  setup.batches           --matmul-sweep: the batch sizes B swept
  setup.tasks             --matmul-sweep, text: how the rows are cut into kernel calls
  read_bandwidth_gbps     GB/s: the plain read passes' median over all ISAs' pairs, by thread count
  read_bandwidth_gbps.<threads>  GB/s: with that many threads
  decode_shaped           the matvec matrix's bytes read in decode's parallel regions (decode_regions),
      alternated with read passes over the same bytes
  decode_shaped.isa       the ISA these ran with (the default)
  decode_shaped.threads   the threads they ran on (--threads)
  decode_shaped.model_shapes  the synth preset whose dimensions the regions have
  decode_shaped.gdn_in    a GDN layer's four input projections in one region
  decode_shaped.gdn_in.matrices  matrices a region reads
  decode_shaped.gdn_in.region_mb  MB a region reads
  decode_shaped.gdn_in.regions_a_pass  regions run one after the other in a timed pass
  decode_shaped.gdn_in.gbps  GB/s: the median over the pairs of the regions' pass
  decode_shaped.gdn_in.fraction_of_read_bw  the median of the pairs' region pass over read pass speed
  decode_shaped.gdn_in.foreign_cpu_fraction  0 to 1: other processes' share of the CPUs during a pair,
      the median over the pairs (null where there is no /proc/stat)
  decode_shaped.gdn_in.quiet_pairs  pairs whose foreign share was at most QUIET_FOREIGN_CPU
  decode_shaped.gdn_in.fraction_of_read_bw_quiet  fraction_of_read_bw's median over those pairs alone
      (null when there were none)
  decode_shaped.gdn_out   keys as decode_shaped.gdn_in: a GDN layer's output projection alone
  decode_shaped.experts_gate_up  keys as decode_shaped.gdn_in: the selected and shared experts'
      gate and up projections in one region
  decode_shaped.experts_down  keys as decode_shaped.gdn_in: their down projections in one region
  q4_0                    the Q4_0 x Q8_0 products, by ISA
  q4_0.<isa>              one ISA's figures
  q4_0.<isa>.matvec_gbps  GB/s: the matrix-vector product's median (weight bytes / time), by threads
  q4_0.<isa>.matvec_gbps.<threads>  GB/s: with that many threads
  q4_0.<isa>.read_gbps    GB/s: the plain read passes' median of this ISA's pairs, by threads
  q4_0.<isa>.read_gbps.<threads>  GB/s: with that many threads
  q4_0.<isa>.fraction_of_read_bw  the median of the pairs' product over read speed, by threads
  q4_0.<isa>.fraction_of_read_bw.<threads>  with that many threads
  q4_0.<isa>.fraction_of_read_bw_range  [lowest, highest] of those pairs' ratios, by threads
  q4_0.<isa>.fraction_of_read_bw_range.<threads>  with that many threads
  q4_0.<isa>.prefetched_read_gbps  GB/s: the read passes that prefetch as the kernels do, their median
  q4_0.<isa>.prefetched_read_gbps.<threads>  GB/s: with that many threads
  q4_0.<isa>.prefetched_read_fraction_of_read_bw  the median of the pairs' prefetching over plain read
      speed (what the software prefetch alone costs), by threads
  q4_0.<isa>.prefetched_read_fraction_of_read_bw.<threads>  with that many threads
  q4_0.<isa>.fraction_of_prefetched_read_bw  the median of the pairs' product over prefetching read
      speed, by threads
  q4_0.<isa>.fraction_of_prefetched_read_bw.<threads>  with that many threads
  q4_0.<isa>.matmul       the batched product on the cache-sized matrix with --threads threads, by B
  q4_0.<isa>.matmul.<B>   B tokens at once
  q4_0.<isa>.matmul.<B>.tokens_per_s  tokens/s: B over the best of --reps timings
  q4_0.<isa>.matmul.<B>.speedup_vs_matvec  B matrix-vector products' time over the batched one's
  ratios                  ratios of the figures above
  ratios.ssse3_vs_scalar_matvec_1t  SSSE3's matrix-vector GB/s over scalar C's, 1 thread (both run)
  ratios.paper_ssse3_vs_scalar  the paper's SSSE3 over scalar speed-up (3.0), to set beside it
  ratios.avx2_vs_ssse3_matvec_1t  AVX2's matrix-vector GB/s over SSSE3's, 1 thread (both run)
  ratios.avx512vnni_vs_ssse3_matvec_1t  AVX-512 VNNI's over SSSE3's, the same
  ratios.best_isa         the ISA with the fastest matrix-vector product at --threads threads
  ratios.best_fraction_of_read_bw  its fraction_of_read_bw, by threads
  ratios.best_fraction_of_read_bw.<threads>  with that many threads
  matmul_q4_0             --matmul-sweep: fm_matmul_q4_0's speed by ISA, shape, threads and B
  matmul_q4_0.<isa>.<shape>  a "ROWSxCOLS" matrix of setup.shapes
  matmul_q4_0.<isa>.<shape>.<nt>  "<threads>t": run on that many threads, by B
  matmul_q4_0.<isa>.<shape>.<nt>.<B>  B tokens at once, best of --reps timings
  matmul_q4_0.<isa>.<shape>.<nt>.<B>.gmac_s  GMAC/s: rows x cols x B multiply-adds over the time
  matmul_q4_0.<isa>.<shape>.<nt>.<B>.tokens_s  tokens/s: B over the time
  matmul_q4_0.<isa>.<shape>.<nt>.<B>.us  us: one full product (all rows, B tokens)
  matmul_q4_0.<isa>.<shape>.<nt>.matvec  keys as matmul_q4_0.<isa>.<shape>.<nt>.<B>: at B = 1,
      fm_matvec_q4_0 (what the forward calls at B = 1) instead
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import native

from .decode import ForeignCpu
from .weights import random_q4_0

MB = 1 << 20
QUIET_FOREIGN_CPU = 0.05    # decode_shaped pairs with other processes below this share of the CPUs


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _best_time(fn, reps: int) -> float:
    fn()  # warm-up: page faults, caches, thread start
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def _parallel(pool: ThreadPoolExecutor, nthreads: int, n: int, task) -> None:
    """task(begin, end) over nthreads slices of range(n); 1 thread runs inline."""
    if nthreads == 1:
        task(0, n)
        return
    for f in [pool.submit(task, b, e) for b, e in _split(n, nthreads)]:
        f.result()


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu") -> int:
    """Bytes of the highest cache level summed over its instances (sysfs; 0 if unknown)."""
    sizes, seen, best_level = {}, set(), 0
    for d in Path(root).glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level, shared = int((d / "level").read_text()), (d / "shared_cpu_list").read_text().strip()
            text = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if (level, shared) in seen or not text[:-1].isdigit():
            continue
        seen.add((level, shared))
        sizes[level] = sizes.get(level, 0) + int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        best_level = max(best_level, level)
    return sizes.get(best_level, 0)


def default_matrix_mb(root: str = "/sys/devices/system/cpu") -> int:
    """288 MiB, or four times the last-level cache where that is larger: the matrix
    must stream from memory, and the GPU machine's Xeon has a 300 MiB L3."""
    return max(288, -(-4 * last_level_cache_bytes(root) // MB))


def _bench_cpus(n: int) -> list[int]:
    """n CPUs to pin to, the way the engine picks them (physical cores of the node)."""
    from shared.topology import default_cpus
    cpus = default_cpus()
    return (cpus * n)[:n]


def paired_passes(cpus: list[int], W: np.ndarray, xq: np.ndarray,
                  pairs: int) -> tuple[list[float], list[float], list[float]]:
    """GB/s of `pairs` read passes over W, as many read passes that prefetch as the
    kernels do, and as many products W . xq, alternated on one pinned pool (each
    pair in a rotated order), after one untimed pass of each: (reads, prefetched
    reads, products)."""
    reads, prefetched, products = [], [], []
    with native.Pool(cpus) as pool:
        steps = [lambda: reads.append(W.nbytes / pool.read_seconds(W) / 1e9),
                 lambda: prefetched.append(W.nbytes / pool.read_seconds(W, prefetched=True) / 1e9),
                 lambda: products.append(W.nbytes / pool.matvec_q4_0_seconds(W, xq) / 1e9)]
        pool.read_seconds(W)
        pool.read_seconds(W, prefetched=True)
        pool.matvec_q4_0_seconds(W, xq)
        for i in range(pairs):
            for k in range(len(steps)):
                steps[(i + k) % len(steps)]()
    return reads, prefetched, products


def decode_regions(preset: str = "qwen3.6-35b-a3b") -> dict[str, list[tuple[int, int]]]:
    """The parallel regions of a decode step's weight reads, as (rows, cols) Q4_0
    matrices each, at the preset's real sizes, in the order the forward runs them: a GDN
    layer's four input projections in one region and its output alone; a MoE layer's
    selected experts' gate and up (and the shared expert's) in one region, then their
    down projections."""
    from modeltools.synth import preset_config
    cfg = preset_config(preset)
    d, k, ff, fs = cfg.n_embd, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp
    return {"gdn_in": [(cfg.conv_channels, d), (cfg.ssm_d_inner, d), (cfg.ssm_v_heads, d), (cfg.ssm_v_heads, d)],
            "gdn_out": [(d, cfg.ssm_d_inner)],
            "experts_gate_up": [(ff, d)] * (2 * k) + [(fs, d)] * 2,
            "experts_down": [(d, ff)] * k + [(d, fs)]}


def decode_shaped_passes(cpus: list[int], W: np.ndarray, pairs: int, preset: str = "qwen3.6-35b-a3b") -> dict:
    """GB/s of decode's kinds of region (decode_regions), each repeated through W (so
    every region reads memory, not cache: one after the other as a token's layers run),
    alternated with read passes over the same bytes on one pinned pool: each kind's
    median GB/s and fraction of the read bandwidth of its pair."""
    out = {}
    buf = W.reshape(-1)
    with native.Pool(cpus) as pool:
        for name, region in decode_regions(preset).items():
            region_bytes = sum(r * (c // 32) * 18 for r, c in region)
            if region_bytes > buf.nbytes:
                raise ValueError(f"a {name} region reads {region_bytes} bytes: more than the {buf.nbytes}-byte matrix")
            regions = [region] * (buf.nbytes // region_bytes)
            nbytes = region_bytes * len(regions)
            steps = (lambda: pool.regions_q4_0_seconds(buf, regions), lambda: pool.read_seconds(buf[:nbytes]))
            for step in steps:
                step()                              # untimed: pages, caches, the pool's threads
            speeds, ratios, foreign = [], [], []
            for i in range(pairs):                  # each pair in alternating order
                with ForeignCpu() as f:
                    t = {k: steps[k]() for k in ((0, 1) if i % 2 == 0 else (1, 0))}
                speeds.append(nbytes / t[0] / 1e9)
                ratios.append(t[1] / t[0])
                foreign.append(f.fraction)
            quiet = [r for r, f in zip(ratios, foreign) if f is not None and f <= QUIET_FOREIGN_CPU]
            out[name] = {"matrices": len(region), "region_mb": round(region_bytes / 1e6, 2),
                         "regions_a_pass": len(regions), "gbps": round(statistics.median(speeds), 2),
                         "fraction_of_read_bw": round(statistics.median(ratios), 3),
                         "foreign_cpu_fraction": (round(statistics.median(foreign), 3)
                                                  if None not in foreign else None),
                         "quiet_pairs": len(quiet),
                         "fraction_of_read_bw_quiet": round(statistics.median(quiet), 3) if quiet else None}
    return out


def matmul_seconds(pool, W, X, Y, nthreads: int, reps: int) -> float:
    task = lambda b, e: native.matmul(W, X, "q4_0", b, e, out=Y)  # noqa: E731
    return _best_time(lambda: _parallel(pool, nthreads, W.shape[0], task), reps)


def _bench_isa(pool, cpus, isa, big, small, threads, batch_sizes, reps, pairs) -> tuple[dict, dict]:
    """(the ISA's figures, its read passes by thread count)."""
    W, xq = big
    Ws, xqs, Xs = small
    out = {"matvec_gbps": {}, "read_gbps": {}, "fraction_of_read_bw": {}, "fraction_of_read_bw_range": {},
           "prefetched_read_gbps": {}, "prefetched_read_fraction_of_read_bw": {},
           "fraction_of_prefetched_read_bw": {}, "matmul": {}}
    reads_by_nt = {}
    with native.use_isa(isa):
        for nt in threads:
            reads, prefetched, products = paired_passes(cpus[:nt], W, xq, pairs)
            ratios = [p / r for p, r in zip(products, reads)]
            key = str(nt)
            reads_by_nt[key] = reads
            out["matvec_gbps"][key] = round(statistics.median(products), 2)
            out["read_gbps"][key] = round(statistics.median(reads), 2)
            out["fraction_of_read_bw"][key] = round(statistics.median(ratios), 3)
            out["fraction_of_read_bw_range"][key] = [round(min(ratios), 3), round(max(ratios), 3)]
            out["prefetched_read_gbps"][key] = round(statistics.median(prefetched), 2)
            out["prefetched_read_fraction_of_read_bw"][key] = round(
                statistics.median([f / r for f, r in zip(prefetched, reads)]), 3)
            out["fraction_of_prefetched_read_bw"][key] = round(
                statistics.median([p / f for p, f in zip(products, prefetched)]), 3)
        t_vec = matmul_seconds(pool, Ws, xqs[None, :], np.empty((1, Ws.shape[0]), np.float32),
                               threads[-1], reps)
        for B in batch_sizes:
            X = Xs[:B]
            t = matmul_seconds(pool, Ws, X, np.empty((B, Ws.shape[0]), np.float32), threads[-1], reps)
            out["matmul"][str(B)] = {"tokens_per_s": round(B / t, 1),
                                     "speedup_vs_matvec": round(B * t_vec / t, 2)}
    return out, reads_by_nt


def run(matrix_mb: int | None = None, threads: int = 2, reps: int = 5,
        isas: list[str] | None = None, cols: int = 2048, batch_sizes=(16, 64),
        small_rows: int = 4096, pairs: int = 15, decode_preset: str = "qwen3.6-35b-a3b") -> dict:
    """Measure everything once; returns the JSON-ready dict (see the module docstring)."""
    isas = isas or native.supported_isas()
    thread_counts = sorted({1, threads})
    cpus = _bench_cpus(max(thread_counts))
    nb_bytes = cols // 32 * 18
    rows = max(64, (matrix_mb or default_matrix_mb()) * MB // nb_bytes // 64 * 64)
    big_W = random_q4_0(rows, cols, seed=1)
    rng = np.random.default_rng(2)
    xq = native.quantize_row_q8_0(rng.standard_normal(cols).astype(np.float32))
    small_W = random_q4_0(small_rows, cols, seed=3)  # 9 MB: the batched product is compute-bound
    Xs = native.quantize_row_q8_0(rng.standard_normal((max(batch_sizes), cols)).astype(np.float32))

    result = {
        "machine": {"cpu": _cpu_name(), "logical_cpus": os.cpu_count(), "isas": native.supported_isas(),
                    "default_isa": native.get_isa()},
        "setup": {"matvec_matrix": {"rows": rows, "cols": cols, "bytes": int(big_W.nbytes)},
                  "matmul_matrix": {"rows": small_rows, "cols": cols, "bytes": int(small_W.nbytes)},
                  "read_pass": "the matvec matrix itself, plain and with the kernels' software prefetch",
                  "threads": thread_counts, "reps": reps, "pairs": pairs, "cpus": cpus[:max(thread_counts)],
                  "threading": "read and matvec: the engine's pinned native pool, alternated pass by pass; "
                               "matmul: a python pool splitting rows (cffi calls release the GIL)"},
    }
    by_isa, all_reads = {}, {str(nt): [] for nt in thread_counts}
    with ThreadPoolExecutor(max(thread_counts)) as pool:
        for isa in isas:
            by_isa[isa], reads = _bench_isa(pool, cpus, isa, (big_W, xq), (small_W, Xs[0], Xs),
                                            thread_counts, batch_sizes, reps, pairs)
            for nt, r in reads.items():
                all_reads[nt] += r
    result["read_bandwidth_gbps"] = {nt: round(statistics.median(r), 2) for nt, r in all_reads.items()}
    # the same bytes read as decode reads them: its regions of small matrices, not one big one
    result["decode_shaped"] = {"isa": native.get_isa(), "threads": thread_counts[-1],
                               "model_shapes": decode_preset,
                               **decode_shaped_passes(cpus[:thread_counts[-1]], big_W, pairs, decode_preset)}
    result["q4_0"] = by_isa
    result["ratios"] = _ratios(by_isa, thread_counts)
    return result


def _ratios(by_isa: dict, thread_counts: list[int]) -> dict:
    ratios = {}
    one, many = "1", str(thread_counts[-1])
    if "scalar" in by_isa and "ssse3" in by_isa:
        ratios["ssse3_vs_scalar_matvec_1t"] = round(
            by_isa["ssse3"]["matvec_gbps"][one] / by_isa["scalar"]["matvec_gbps"][one], 2)
        ratios["paper_ssse3_vs_scalar"] = 3.0
    if "ssse3" in by_isa:
        for isa in by_isa:
            if isa not in ("scalar", "ssse3"):
                ratios[f"{isa}_vs_ssse3_matvec_1t"] = round(
                    by_isa[isa]["matvec_gbps"][one] / by_isa["ssse3"]["matvec_gbps"][one], 2)
    best = max(by_isa, key=lambda i: by_isa[i]["matvec_gbps"][many])
    ratios["best_isa"] = best
    ratios["best_fraction_of_read_bw"] = by_isa[best]["fraction_of_read_bw"]
    return ratios


# ---------------------------------------------------------------- matmul sweep

SWEEP_SHAPES = ((4096, 2048), (512, 2048), (2048, 512))
SWEEP_BATCHES = (1, 2, 4, 8, 12, 64)


def _tasks_like_linear_c(rows: int, threads: int) -> list[tuple[int, int]]:
    """The row ranges native/linear.c gives one call each (rows_per_task there)."""
    per = -(-rows // (threads * 4))
    per = max(64, (per + 15) & ~15)
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


def _sweep_one(pool, W, X, B: int, nthreads: int, reps: int, kernel: str, min_s: float = 0.05) -> float:
    """Seconds per full product (all rows, B tokens), best of reps."""
    from native import ffi, lib
    rows, cols = W.shape[0], W.shape[1] // 18 * 32
    Y = np.zeros((B, rows), np.float32)
    wp = ffi.cast("block_q4_0 *", ffi.from_buffer(W))
    xp = ffi.cast("block_q8_0 *", ffi.from_buffer(X))
    yp = ffi.cast("float *", ffi.from_buffer(Y))
    tasks = _tasks_like_linear_c(rows, nthreads)
    mine = [tasks[i::nthreads] for i in range(nthreads)]  # static split: no claiming overhead
    if kernel == "matvec":
        calls = [[(lib.fm_matvec_q4_0, (wp, xp, yp, cols, b, e)) for b, e in m] for m in mine]
    else:
        calls = [[(lib.fm_matmul_q4_0, (wp, xp, yp, cols, B, rows, b, e)) for b, e in m] for m in mine]

    def work(i, n):
        for _ in range(n):
            for fn, args in calls[i]:
                fn(*args)

    def timed(n):
        t0 = time.perf_counter()
        if nthreads == 1:
            work(0, n)
        else:
            for f in [pool.submit(work, i, n) for i in range(nthreads)]:
                f.result()
        return time.perf_counter() - t0

    t1 = timed(1)
    inner = max(1, int(min_s / max(t1, 1e-6)))
    return min(timed(inner) / inner for _ in range(reps))


def run_sweep(threads: int = 2, reps: int = 5, isas: list[str] | None = None,
              shapes=SWEEP_SHAPES, batch_sizes=SWEEP_BATCHES) -> dict:
    isas = isas or native.supported_isas()
    thread_counts = sorted({1, threads})
    rng = np.random.default_rng(5)
    result = {"machine": {"cpu": _cpu_name(), "logical_cpus": os.cpu_count(), "isas": native.supported_isas(),
                          "default_isa": native.get_isa()},
              "setup": {"shapes": [list(s) for s in shapes], "batches": list(batch_sizes),
                        "threads": thread_counts, "reps": reps,
                        "tasks": "rows cut as native/linear.c cuts them, one kernel call each"},
              "matmul_q4_0": {}}
    with ThreadPoolExecutor(max(thread_counts)) as pool:
        for isa in isas:
            res = result["matmul_q4_0"][isa] = {}
            with native.use_isa(isa):
                for rows, cols in shapes:
                    W = random_q4_0(rows, cols, seed=rows + cols)
                    Xall = native.quantize_row_q8_0(rng.standard_normal((max(batch_sizes), cols)).astype(np.float32))
                    shape_res = res[f"{rows}x{cols}"] = {}
                    for nt in thread_counts:
                        by_b = shape_res[f"{nt}t"] = {}
                        for B in batch_sizes:
                            X = np.ascontiguousarray(Xall[:B])
                            t = _sweep_one(pool, W, X, B, nt, reps, "matmul")
                            by_b[str(B)] = {"gmac_s": round(rows * cols * B / t / 1e9, 2),
                                            "tokens_s": round(B / t, 1), "us": round(t * 1e6, 1)}
                            if B == 1:
                                t = _sweep_one(pool, W, X, 1, nt, reps, "matvec")
                                by_b["matvec"] = {"gmac_s": round(rows * cols / t / 1e9, 2),
                                                  "tokens_s": round(1 / t, 1), "us": round(t * 1e6, 1)}
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="fermoe bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix-mb", type=int, default=default_matrix_mb(),
                    help="Q4_0 matvec matrix size (MiB; default: 288 or 4x the last-level cache)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                    help="measure with 1 and with this many threads")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the batched products; the best one counts")
    ap.add_argument("--pairs", type=int, default=15, help="alternated read / matrix-vector passes (medians count)")
    ap.add_argument("--cols", type=int, default=2048, help="matrix columns (multiple of 32; 2048 = the hidden size)")
    ap.add_argument("--isa", action="append", choices=native.ISAS, help="only these ISAs (repeatable)")
    ap.add_argument("--matmul-sweep", action="store_true",
                    help="only time fm_matmul_q4_0 at several batch sizes and shapes (GMAC/s, tokens/s)")
    ap.add_argument("--gpu", action="store_true",
                    help="instead: the GPU GEMM kernels on a prefill's shapes, Q4_0 and fp32 weights, and the "
                         "FMA probe (TFLOP/s; bench/gpu_kernels.py)")
    ap.add_argument("--gpu-prompts", default="947,8192", help="--gpu: prompt lengths (the GEMMs' rows)")
    ap.add_argument("--gpu-preset", default="qwen3.6-35b-a3b", help="--gpu: the model dimensions (a synth preset)")
    ap.add_argument("--no-sweep", action="store_true", help="--gpu: only the tile height the engine picks")
    args = ap.parse_args(argv)
    if args.gpu:
        from bench.gpu_kernels import main as gpu_main
        gpu_main(args)
        return
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        ap.error(f"--threads {args.threads}: must be in [1, {os.cpu_count()}] (the CPUs of this machine)")
    if args.cols < 32 or args.cols % 32:
        ap.error(f"--cols {args.cols}: must be a positive multiple of 32 (the Q4_0 block)")
    if min(args.matrix_mb, args.reps) < 1:
        ap.error("--matrix-mb and --reps must be at least 1")
    if args.matmul_sweep:
        print(json.dumps(run_sweep(threads=args.threads, reps=args.reps, isas=args.isa), indent=2))
        return
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    res = run(matrix_mb=args.matrix_mb, threads=args.threads, reps=args.reps,
              isas=args.isa, cols=args.cols, pairs=args.pairs)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
