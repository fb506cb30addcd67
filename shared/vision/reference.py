"""The numpy reference forward of the vision tower: the spec the faster paths are tested against.

Float64 throughout (weights read as float32), one small function per op, the block
reading as Hugging Face's Qwen3_5MoeVisionBlock:

    x = patch_embed(pixels) + bilinear(pos_table)            patches in merge-block order
    27 x:  x += attn_out(attention(rope(qkv(LN1(x)))))        full attention within the image
           x += ffn_down(gelu_tanh(ffn_up(LN2(x))))
    y = mm.2(gelu_erf(mm.0(merge_2x2(post_ln(x)))))           one token per 2x2 patches

Patches come in merge-block order: (block row, block column, row in block, column in
block), so 4 consecutive rows are one 2x2 block and the merge is a reshape. One image
is encoded at a time (images never attend to each other).
"""
from __future__ import annotations

import math

import numpy as np

from .config import ROPE_THETA, VisionConfig

F64 = np.float64


# ---- positions -----------------------------------------------------------
def merge_order(gh: int, gw: int, m: int) -> np.ndarray:
    """Raster index (row * gw + col) of each patch, in merge-block order."""
    return np.arange(gh * gw).reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)


def interpolation_taps(n: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear, align_corners=True, from `side` table entries to `n`: (tap0, tap1, their weights).
    The weights are float32 values computed as HF computes them, so float64 runs agree exactly."""
    f32 = np.float32
    src = (np.arange(n, dtype=f32) * f32(side - 1)) / f32(max(n - 1, 1))
    floor = np.floor(src)
    lo = floor.astype(np.int64)
    hi = np.minimum(lo + 1, side - 1)
    w1 = f32(1) - np.abs(src - floor - f32(1))          # HF's 1 - |src - tap|, tap = floor + 1
    w0 = f32(1) - np.abs(src - floor)
    return lo, hi, w0, w1


def position_embedding(table: np.ndarray, side: int, gh: int, gw: int, order: np.ndarray) -> np.ndarray:
    """The learned side x side position table resampled to gh x gw, rows in `order`."""
    t = table.astype(F64).reshape(side, side, -1)
    r0, r1, wr0, wr1 = interpolation_taps(gh, side)
    c0, c1, wc0, wc1 = interpolation_taps(gw, side)
    grid = 0
    for rows, wr in ((r0, wr0), (r1, wr1)):            # the 2-D weight is a float32 product, as in HF
        for cols, wc in ((c0, wc0), (c1, wc1)):
            weight = (wr[:, None] * wc[None, :]).astype(F64)
            grid = grid + t[rows][:, cols] * weight[:, :, None]
    return grid.reshape(gh * gw, -1)[order]


def rotary_cos_sin(gh: int, gw: int, order: np.ndarray, head_dim: int, theta: float = ROPE_THETA):
    """2-D rotary: pair (k, k + head_dim/2) turns by row * f_k for the first quarter of k,
    by col * f_(k - head_dim/4) for the second (HF's axial rope, llama.cpp's VISION mode)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (np.arange(quarter, dtype=F64) * 2 / (head_dim // 2))
    row, col = order // gw, order % gw
    angles = np.concatenate([np.outer(row, inv_freq), np.outer(col, inv_freq)], axis=1)   # [N, head_dim/2]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles), np.sin(angles)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [N, heads, head_dim], NeoX pairing (k, k + head_dim/2)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rotated * sin[:, None]


# ---- ops -----------------------------------------------------------------
def linear(x, w, b):
    return x @ w.astype(F64).T + b


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    return 0.5 * x * (1 + np.vectorize(math.erf, otypes=[F64])(x / math.sqrt(2)))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def patch_embed(pixels: np.ndarray, w0: np.ndarray, w1: np.ndarray, b: np.ndarray) -> np.ndarray:
    """pixels [N, 3*2*p*p] (c, t, py, px) -> [N, d]: the Conv3d as one 2-D kernel per frame."""
    n, d = len(pixels), len(w0)
    x = pixels.astype(F64).reshape(n, 3, 2, -1)
    frame = lambda t: x[:, :, t].reshape(n, -1)
    return frame(0) @ w0.astype(F64).reshape(d, -1).T + frame(1) @ w1.astype(F64).reshape(d, -1).T + b


def attention(x, w_qkv, b_qkv, n_head, cos, sin):
    n, d = x.shape
    qkv = linear(x, w_qkv, b_qkv).reshape(n, 3, n_head, d // n_head)
    q, k, v = rope(qkv[:, 0], cos, sin), rope(qkv[:, 1], cos, sin), qkv[:, 2]
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d // n_head)
    return np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(n, d)


# ---- the tower -------------------------------------------------------------
def block(x, tower, i: int, cfg: VisionConfig, cos, sin):
    w = lambda name: tower.f32(f"v.blk.{i}.{name}")
    h = layer_norm(x, w("ln1.weight"), w("ln1.bias"), cfg.eps)
    x = x + linear(attention(h, w("attn_qkv.weight"), w("attn_qkv.bias"), cfg.n_head, cos, sin),
                   w("attn_out.weight"), w("attn_out.bias"))
    h = layer_norm(x, w("ln2.weight"), w("ln2.bias"), cfg.eps)
    return x + linear(gelu_tanh(linear(h, w("ffn_up.weight"), w("ffn_up.bias"))),
                      w("ffn_down.weight"), w("ffn_down.bias"))


def encode_image(tower, pixels: np.ndarray, grid: tuple[int, int], hidden: list | None = None) -> np.ndarray:
    """One image's merged tokens [gh*gw/4, projection_dim] (row-major over the merged grid).
    `tower`: anything with `config` and `f32(name)` (an Mmproj). hidden, if a list, receives
    the input of block 0 and each block's output (HF's hidden_states), in merge-block order."""
    cfg, (gh, gw) = tower.config, grid
    check_grid(cfg, pixels, gh, gw)
    order = merge_order(gh, gw, cfg.n_merge)
    x = patch_embed(pixels, tower.f32("v.patch_embd.weight"), tower.f32("v.patch_embd.weight.1"),
                    tower.f32("v.patch_embd.bias"))
    x = x + position_embedding(tower.f32("v.position_embd.weight"), cfg.pos_side, gh, gw, order)
    cos, sin = rotary_cos_sin(gh, gw, order, cfg.head_dim)
    for i in range(cfg.n_layer):
        if hidden is not None:
            hidden.append(x)
        x = block(x, tower, i, cfg, cos, sin)
    if hidden is not None:
        hidden.append(x)
    x = layer_norm(x, tower.f32("v.post_ln.weight"), tower.f32("v.post_ln.bias"), cfg.eps)
    x = x.reshape(-1, cfg.merged_dim)
    x = gelu_erf(linear(x, tower.f32("mm.0.weight"), tower.f32("mm.0.bias")))
    return linear(x, tower.f32("mm.2.weight"), tower.f32("mm.2.bias"))


def check_grid(cfg: VisionConfig, pixels: np.ndarray, gh: int, gw: int) -> None:
    """A grid the merge can take, and pixel rows that match it (a programming error otherwise)."""
    if gh <= 0 or gw <= 0 or gh % cfg.n_merge or gw % cfg.n_merge:
        raise ValueError(f"patch grid {gh}x{gw} is not a positive multiple of the merge size {cfg.n_merge}")
    if pixels.shape != (gh * gw, cfg.patch_dim):
        raise ValueError(f"pixels have shape {pixels.shape}; a {gh}x{gw} grid needs {(gh * gw, cfg.patch_dim)}")
