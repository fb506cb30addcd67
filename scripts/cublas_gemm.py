"""cuBLAS's fp32 SGEMM (tensor cores off) beside fermoe's GEMM kernels, on the same
shapes, in one run: the yardstick of the GEMM kernel family.

    python scripts/cublas_gemm.py [--prompts 947,8192] [--reps 5] > gemm_vs_cublas.json

Outside the package: it needs torch with CUDA (the GPU machine has it). First
`fermoe bench kernels --gpu` runs in a child process (its own CUDA context), then
torch times the same shapes: C = A W^T with fp32 W already dequantised, through
torch.matmul with TF32 disabled (allow_tf32 = False, matmul precision "highest"), so
cuBLAS runs its SIMT SGEMM; the routed experts as one batched product of the
128 experts at the mean rows an expert (torch.bmm), as a vendor library would
run them. Prints one JSON: fermoe's report, cuBLAS's TFLOP/s by shape, and
fermoe's Q4_0 and fp32-weight rates as fractions of cuBLAS's.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def fermoe_report(prompts: str, reps: int) -> dict:
    run = subprocess.run([sys.executable, "-m", "bench.kernels", "--gpu", "--gpu-prompts", prompts,
                          "--reps", str(reps)], cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"fermoe bench kernels --gpu failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout)


def cublas_ms(torch, fn, reps: int, batch: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / batch)
    return best


def cublas_rates(report: dict, reps: int) -> dict:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda")
    out = {}
    for T, parts in report["prompts"].items():
        rows = out[T] = {}
        for s in parts["dense"]:
            M, N, K = s["M"], s["N"], s["K"]
            A = torch.randn(M, K, device=dev)
            W = torch.randn(N, K, device=dev) / K ** 0.5
            C = torch.empty(M, N, device=dev)
            ms = cublas_ms(torch, lambda: torch.matmul(A, W.t(), out=C), reps)
            rows[s["name"]] = round(2.0 * M * N * K / (ms / 1000) / 1e12, 2)
        for s in parts["experts"]:
            E, N, K = s["experts"], s["N"], s["K"]
            m = max(1, round(s["M"] / E))
            A = torch.randn(E, m, K, device=dev)
            W = torch.randn(E, N, K, device=dev) / K ** 0.5
            C = torch.empty(E, m, N, device=dev)
            ms = cublas_ms(torch, lambda: torch.bmm(A, W.transpose(1, 2), out=C), reps)
            rows[s["name"]] = round(2.0 * E * m * N * K / (ms / 1000) / 1e12, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="947,8192")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    report = fermoe_report(args.prompts, args.reps)
    cublas = cublas_rates(report, args.reps)
    table = {}
    for T, parts in report["prompts"].items():
        for s in parts["dense"] + parts["experts"]:
            c = cublas[T][s["name"]]
            table[f"{T}:{s['name']}"] = {
                "fermoe_q4_0_tflops": s["q4_0"]["tflops"], "fermoe_f32_tflops": s["f32"]["tflops"],
                "cublas_sgemm_tflops": c,
                "q4_0_vs_cublas": round(s["q4_0"]["tflops"] / c, 3), "f32_vs_cublas": round(s["f32"]["tflops"] / c, 3),
                "tile_rows": s["tile_rows"], "k_splits": s.get("k_splits", 1)}
    print(json.dumps({"fp32_fma_tflops": report["fp32_fma_tflops"], "device": report["device"],
                      "vs_cublas": table, "cublas_tflops": cublas, "fermoe": report}, indent=2))


if __name__ == "__main__":
    main()
