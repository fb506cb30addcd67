"""Random weights for the kernel benchmarks (bench/kernels.py on the CPU, bench/gpu_kernels.py
on the GPU): the bytes of a matrix of the engine's formats, of sane values, made fast."""
from __future__ import annotations

import numpy as np


def random_q4_0(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_0 bytes [rows, cols/32*18] with sane fp16 scales (no inf/NaN)."""
    rng = np.random.default_rng(seed)
    nb = cols // 32
    W = rng.integers(0, 256, (rows, nb * 18), dtype=np.uint8)
    d = rng.uniform(1e-3, 2e-2, (rows, nb)).astype(np.float16)
    W.reshape(rows, nb, 18)[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    return W


def random_weights(rows: int, cols: int, wtype: str, rng) -> np.ndarray:
    """Raw bytes of a [rows, cols] weight in `wtype` (q4_0 or f32), values of O(1/sqrt(cols))."""
    if wtype == "q4_0":
        return random_q4_0(rows, cols, seed=int(rng.integers(1 << 30))).reshape(-1)
    return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32).view(np.uint8).reshape(-1)
