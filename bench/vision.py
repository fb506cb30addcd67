"""`fermoe bench vision`: images through the vision tower on the CPU and the GPU, as JSON.

By default the full-size tower (27 blocks, 1152 wide, random weights made in memory)
encodes a 448x448 and a 1024x1024 image (PNG bytes, through the image processor). Each
image reports the processor's and the tower's time, the tower's FLOPs and GFLOP/s, next
to a float32 GEMM measured in the same run (the ceiling of a BLAS-backed forward).

With a GPU (`--gpu auto`, the default: CUDA device 0 when pycuda and a driver are there;
FERMOE_GPU=emulate: the host emulation) the same images go through the GPU tower
(gpu_worker/vision.py): the best of --repeat passes (pixels up, tokens down included),
the time by kernel family (and the copies) of one more pass, the device's fp32 FMA rate
measured in the same run and the share of it the pass reaches, and how far the tokens
are from the CPU engine's. Without one, "gpu" says why nothing was measured.

JSON keys:
  tower                   the mmproj path, or the preset of the random tower
  blocks                  the tower's blocks
  width                   its hidden size
  engine                  what the CPU engine is (numpy float32, BLAS products)
  threads                 the CPU engine's threads (-t)
  blas_threads_set        bool: whether the BLAS library's thread count could be set to it
  weights_load_s          s: making the CPU engine (weights to float32)
  gemm_gflops             GFLOP/s: the best of 3 float32 1024^3 products through numpy's BLAS
  images[]                one object an image, on the CPU engine
  images[].size           WIDTHxHEIGHT of the image
  images[].grid           [rows, columns] of patches after the processor's resize
  images[].patches        rows x columns
  images[].tokens         the tower's output tokens (a 2x2 merge of patches)
  images[].preprocess_ms  ms: PNG bytes to pixels (decode, resize, normalise)
  images[].encode_s       s: the tower's forward
  images[].gflop          GFLOP (2 a multiply-add) of the forward (tower_flops)
  images[].gflops         GFLOP/s: gflop over encode_s
  images[].of_gemm        gflops over gemm_gflops
  gpu                     "not measured: ..." (why), or the GPU tower's figures:
  gpu.device              the GPU's name ("host emulation" under FERMOE_GPU=emulate)
  gpu.weights_upload_s    s: making the GPU engine (weights up)
  gpu.resident_mib        MiB: its device memory, the weights and the split-K scratch
  gpu.matrix_types        the weight types of its matrices
  gpu.fp32_fma_tflops     TFLOP/s: the device's FMA probe, measured in the same run
  gpu.images[]            one object an image, in the order of images[]
  gpu.images[].size       WIDTHxHEIGHT
  gpu.images[].encode_s   s: the best of --repeat passes after a first (pixels up, tokens down included)
  gpu.images[].gflops     GFLOP/s: the forward's FLOPs over encode_s
  gpu.images[].of_fma_peak  gflops over gpu.fp32_fma_tflops
  gpu.images[].kernel_ms.<family>  ms by kernel family of one more pass (gemm, attention, ...; upload
                          and download: the copies), costliest first
  gpu.images[].max_diff_vs_cpu  the largest difference from the CPU engine's tokens, over their largest
                          magnitude
"""
from __future__ import annotations

import io
import json
import sys
import time

import numpy as np


def tower_flops(cfg, gh: int, gw: int) -> float:
    """Multiply-adds x 2 of one image: patch embedding, the blocks (attention scores and
    values too) and the merger."""
    n, d, ff = gh * gw, cfg.n_embd, cfg.n_ff
    block = 2 * n * (3 * d * d + d * d + 2 * d * ff) + 4 * n * n * d
    merger = 2 * (n // 4) * (cfg.merged_dim ** 2 + cfg.merged_dim * cfg.projection_dim)
    return 2 * n * cfg.patch_dim * d + cfg.n_layer * block + merger


def gemm_gflops(n: int = 1024, repeat: int = 3) -> float:
    """float32 n x n x n products through numpy's BLAS: the best of `repeat`."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    best = min(_timed(lambda: a @ a) for _ in range(repeat))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _png(h: int, w: int) -> bytes:
    from PIL import Image
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([127 + 120 * np.sin(yy / (9 + c) + xx / (13 - c)) for c in range(3)], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--sizes {text!r}: expected WIDTHxHEIGHT, e.g. 448x448") from None
    if w < 1 or h < 1:
        raise ValueError(f"--sizes {text!r}: sides must be positive")
    return h, w


def _family(kernel: str) -> str:
    return "gemm" if kernel.startswith("gemm") else kernel.removeprefix("vis_")


def open_gpu(choice: str):
    """(device, None) for --gpu, or (None, why not)."""
    if choice == "off":
        return None, "not measured: --gpu off"
    from gpu_worker.cuda import open_device
    from shared.errors import FermoeError
    try:
        return open_device(0 if choice == "auto" else int(choice)), None
    except FermoeError as e:
        return None, f"not measured: no GPU here ({e})"


def gpu_run(tower, device, images, cpu_tokens, repeat: int) -> dict:
    """The GPU tower on `images` [(size, pixels, grid)]; cpu_tokens: the CPU engine's output of each."""
    from bench.gpu_kernels import fma_tflops
    from gpu_worker.vision import GPUVisionEngine

    t0 = time.perf_counter()
    engine = GPUVisionEngine(tower, device)
    out = {"device": device.name, "weights_upload_s": round(time.perf_counter() - t0, 2),
           "resident_mib": round(engine.weights_nbytes / 2 ** 20)}          # the weights and split-K scratch
    try:
        types = {w.wtype for blk in engine.blocks for w in blk.values() if len(w.shape) == 2}
        peak = fma_tflops(device, engine.ops.k, engine.ops.stream)
        out.update(matrix_types=sorted(types), fp32_fma_tflops=round(peak, 2))
        out["images"] = [gpu_image(engine, device, peak, size, pixels, grid, want, repeat)
                         for (size, pixels, grid), want in zip(images, cpu_tokens)]
    finally:
        engine.close()
    return out


def gpu_image(engine, device, peak: float, size: str, pixels, grid, want, repeat: int) -> dict:
    """One image through the GPU tower: the best of `repeat` passes, then one timed by kernel."""
    from gpu_worker.profile import PhaseTimer
    got = engine.encode(pixels, grid)                  # the first pass: allocations, caches
    best = min(_timed(lambda: engine.encode(pixels, grid)) for _ in range(repeat))
    timer = engine.ops.k.timer = PhaseTimer(device, engine.ops.stream)
    engine.encode(pixels, grid)                        # marks "upload", each launch, "download"
    timer.mark("end")
    engine.ops.k.timer = None
    by_kernel: dict[str, float] = {}
    for phase, ms in timer.milliseconds().items():
        by_kernel[_family(phase)] = by_kernel.get(_family(phase), 0.0) + ms
    flops = tower_flops(engine.config, *grid)
    entry = {"size": size, "encode_s": round(best, 4), "gflops": round(flops / best / 1e9, 1),
             "of_fma_peak": round(flops / best / 1e12 / peak, 3),
             "kernel_ms": {k: round(v, 2) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])}}
    if want is not None:
        entry["max_diff_vs_cpu"] = float(f"{np.abs(got - want).max() / np.abs(want).max():.3g}")
    return entry


def cpu_image(engine, h: int, w: int, gemm: float) -> tuple[dict, tuple, np.ndarray]:
    """One image through the processor and the CPU tower: its entry of images[], the
    (size, pixels, grid) the GPU tower takes, and the tokens."""
    from shared.vision.image import load
    cfg = engine.config
    data = _png(h, w)
    t = time.perf_counter()
    pixels, grid = load(data, cfg)
    pre = time.perf_counter() - t
    t = time.perf_counter()
    tokens = engine.encode(pixels, grid)
    enc = time.perf_counter() - t
    flops = tower_flops(cfg, *grid)
    entry = {"size": f"{w}x{h}", "grid": list(grid), "patches": grid[0] * grid[1], "tokens": len(tokens),
             "preprocess_ms": round(pre * 1e3, 1), "encode_s": round(enc, 3), "gflop": round(flops / 1e9, 1),
             "gflops": round(flops / enc / 1e9, 1), "of_gemm": round(flops / enc / 1e9 / gemm, 2)}
    return entry, (f"{w}x{h}", pixels, grid), tokens


def run(mmproj: str | None, preset: str, threads: int | None, sizes: list[tuple[int, int]], gpu: str = "auto",
        repeat: int = 2) -> dict:
    from cpu_worker.vision_engine import VisionEngine
    from shared.vision.mmproj import Mmproj
    from modeltools.vision.synth import RandomTower, preset_config

    tower = Mmproj(mmproj) if mmproj else RandomTower(preset_config(preset), seed=0)
    t0 = time.perf_counter()
    engine = VisionEngine(tower, threads=threads)
    load_s = time.perf_counter() - t0
    cfg = engine.config
    out = {"tower": mmproj or f"{preset} (random weights, in memory)", "blocks": cfg.n_layer, "width": cfg.n_embd,
           "engine": "cpu: numpy float32, BLAS matrix products", "threads": engine.threads,
           "blas_threads_set": engine.blas_threads_set, "weights_load_s": round(load_s, 2),
           "gemm_gflops": round(gemm_gflops(), 1), "images": []}
    images, cpu_out = [], []
    try:
        for h, w in sizes:
            entry, image, tokens = cpu_image(engine, h, w, out["gemm_gflops"])
            out["images"].append(entry)
            images.append(image)
            cpu_out.append(tokens)
    finally:
        engine.close()
    device, why = open_gpu(gpu)
    if device is None:
        out["gpu"] = why
        return out
    try:
        out["gpu"] = gpu_run(tower, device, images, cpu_out, repeat)
    finally:
        if hasattr(device, "close"):
            device.synchronize()
            device.close()
    return out


def main(argv=None) -> int:
    import argparse
    from shared.options import add_threads
    p = argparse.ArgumentParser(prog="fermoe bench vision", description=__doc__.split("\n\n")[0])
    p.add_argument("--mmproj", default=None, help="an mmproj GGUF (default: a random tower of --preset, in memory)")
    p.add_argument("--preset", default="qwen3.6-35b-a3b", choices=["tiny", "qwen3.6-35b-a3b"],
                   help="the random tower's shape (default: the real one)")
    add_threads(p)
    p.add_argument("--sizes", default="448x448,1024x1024", help="images, WIDTHxHEIGHT, comma-separated")
    p.add_argument("--gpu", default="auto",
                   help="auto (CUDA device 0 if there is one; FERMOE_GPU=emulate: the host emulation), a device "
                        "index, or off")
    p.add_argument("--repeat", type=int, default=2, help="GPU passes timed per image, the best reported (default 2)")
    args = p.parse_args(argv)
    if args.gpu not in ("auto", "off") and not args.gpu.isdigit():
        p.error(f"--gpu {args.gpu!r}: expected auto, off or a device index")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(run(args.mmproj, args.preset, args.threads, sizes, args.gpu, args.repeat), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
