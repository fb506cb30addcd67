"""The vision tower on the CPU: the reference's forward (shared/vision/reference.py) in
float32, with every matrix product in numpy's BLAS (OpenBLAS, its threads set to ours)
and the elementwise work (softmax, GELU, LayerNorm) split over a pool of the same size.

Memory: the weights as float32 (1.8 GB for the real tower, made once); per image the
activations plus one head's scores at a time ([N, N] float32: 64 MiB at 1024x1024).
"""
from __future__ import annotations

import ctypes
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from shared.errors import FermoeError
from shared.topology import default_cpus
from shared.vision.reference import check_grid, merge_order, position_embedding, rotary_cos_sin

F32 = np.float32
_SQRT_2_OVER_PI = F32(math.sqrt(2 / math.pi))


def _blas_threads(n: int) -> bool:
    """Set the thread count of the OpenBLAS numpy is linked with; False where none is found."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1].lower()}
    except OSError:
        return False
    for path in paths:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(ctypes.c_int(n))
                return True
    return False


def erf(x: np.ndarray) -> np.ndarray:
    """float32 erf, |error| < 1.5e-7 (Abramowitz & Stegun 7.1.26): numpy has none."""
    a = np.abs(x)
    t = F32(1) / (F32(1) + F32(0.3275911) * a)
    poly = t * (F32(0.254829592) + t * (F32(-0.284496736) + t * (F32(1.421413741)
                                                                  + t * (F32(-1.453152027) + t * F32(1.061405429)))))
    return np.copysign(F32(1) - poly * np.exp(-a * a), x)


class VisionEngine:
    """Encodes images with a tower (an Mmproj, or anything with `config` and `f32(name)`)."""

    def __init__(self, tower, threads: int | None = None):
        self.config = cfg = tower.config
        threads = threads or len(default_cpus())
        if not 1 <= threads <= (os.cpu_count() or 1):
            raise FermoeError(f"--threads {threads}: must be between 1 and the {os.cpu_count()} CPUs of this machine")
        self.threads, self.blas_threads_set = threads, _blas_threads(threads)
        self._pool = ThreadPoolExecutor(threads) if threads > 1 else None
        w = lambda name: np.ascontiguousarray(tower.f32(name), F32)
        d = cfg.n_embd
        # the two frames' kernels side by side match a pixel row's (c, t, py, px) layout
        self.patch_w = np.stack([w("v.patch_embd.weight"), w("v.patch_embd.weight.1")], axis=2).reshape(d, -1)
        self.patch_b = w("v.patch_embd.bias")
        self.pos_table = w("v.position_embd.weight")
        names = ("ln1.weight", "ln1.bias", "attn_qkv.weight", "attn_qkv.bias", "attn_out.weight", "attn_out.bias",
                 "ln2.weight", "ln2.bias", "ffn_up.weight", "ffn_up.bias", "ffn_down.weight", "ffn_down.bias")
        self.blocks = [{n: w(f"v.blk.{i}.{n}") for n in names} for i in range(cfg.n_layer)]
        self.merger = {n: w(n) for n in ("v.post_ln.weight", "v.post_ln.bias", "mm.0.weight", "mm.0.bias",
                                         "mm.2.weight", "mm.2.bias")}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # ---- elementwise work over row chunks, in parallel ----------------------
    def _rows(self, fn, x: np.ndarray) -> None:
        """fn(x[a:b]) in place for row chunks of x, spread over the pool."""
        self._ranges(lambda a, b: fn(x[a:b]), len(x))

    def _ranges(self, fn, n: int) -> None:
        if self._pool is None or n < 2 * self.threads:
            fn(0, n)
            return
        bounds = np.linspace(0, n, self.threads + 1).astype(int)
        list(self._pool.map(lambda ab: fn(*ab), zip(bounds[:-1], bounds[1:])))

    def _layer_norm(self, x, w, b):
        out = np.empty_like(x)
        eps, width = F32(self.config.eps), F32(x.shape[1])

        def norm(a, b_):
            o = out[a:b_]
            np.subtract(x[a:b_], x[a:b_].mean(-1, keepdims=True), out=o)
            o *= F32(1) / np.sqrt(np.einsum("ij,ij->i", o, o)[:, None] / width + eps)
            o *= w
            o += b
        self._ranges(norm, len(x))
        return out

    @staticmethod
    def _softmax(s):
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(-1, keepdims=True)

    @staticmethod
    def _gelu_tanh(x):
        inner = x * x
        inner *= F32(0.044715)
        inner += F32(1)
        inner *= x
        inner *= _SQRT_2_OVER_PI
        np.tanh(inner, out=inner)
        inner += F32(1)
        x *= inner
        x *= F32(0.5)

    @staticmethod
    def _gelu_erf(x):
        x *= (F32(1) + erf(x * F32(1 / math.sqrt(2)))) * F32(0.5)

    # ---- the forward ----------------------------------------------------------
    def _attention(self, h, blk, cos, sin):
        n, d = h.shape
        nh, hd = self.config.n_head, self.config.head_dim
        qkv = h @ blk["attn_qkv.weight"].T
        qkv += blk["attn_qkv.bias"]
        qkv = qkv.reshape(n, 3, nh, hd)
        half = hd // 2

        def rope(x):                                         # [n, nh, hd] -> rotated copy
            rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            return x * cos[:, None] + rotated * sin[:, None]
        q, k = rope(qkv[:, 0]) * F32(1 / math.sqrt(hd)), rope(qkv[:, 1])
        out = np.empty((n, nh, hd), F32)
        for head in range(nh):
            s = q[:, head] @ k[:, head].T
            self._rows(self._softmax, s)
            out[:, head] = s @ qkv[:, 2, head]
        return out.reshape(n, d)

    def _block(self, x, blk, cos, sin):
        h = self._layer_norm(x, blk["ln1.weight"], blk["ln1.bias"])
        a = self._attention(h, blk, cos, sin) @ blk["attn_out.weight"].T
        a += blk["attn_out.bias"]
        x += a
        h = self._layer_norm(x, blk["ln2.weight"], blk["ln2.bias"])
        u = h @ blk["ffn_up.weight"].T
        u += blk["ffn_up.bias"]
        self._rows(self._gelu_tanh, u)
        y = u @ blk["ffn_down.weight"].T
        y += blk["ffn_down.bias"]
        x += y
        return x

    def encode(self, pixels: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
        """One image's merged tokens, float32 [gh*gw/4, projection_dim]."""
        cfg, (gh, gw) = self.config, grid
        check_grid(cfg, pixels, gh, gw)
        order = merge_order(gh, gw, cfg.n_merge)
        x = np.ascontiguousarray(pixels, F32) @ self.patch_w.T
        x += self.patch_b
        x += position_embedding(self.pos_table, cfg.pos_side, gh, gw, order).astype(F32)
        cos, sin = (a.astype(F32) for a in rotary_cos_sin(gh, gw, order, cfg.head_dim))
        for blk in self.blocks:
            x = self._block(x, blk, cos, sin)
        m = self.merger
        x = self._layer_norm(x, m["v.post_ln.weight"], m["v.post_ln.bias"]).reshape(-1, cfg.merged_dim)
        y = x @ m["mm.0.weight"].T
        y += m["mm.0.bias"]
        self._rows(self._gelu_erf, y)
        out = y @ m["mm.2.weight"].T
        out += m["mm.2.bias"]
        return out


def image_encoder(mmproj: str, model, threads: int):
    """A worker's ImageEncoder (image bytes -> the tower's merged tokens): the tower of
    file `mmproj`, checked against the text model, run here on `threads` CPUs."""
    from shared.vision.mmproj import Mmproj
    from shared.vision.prompt import ImageEncoder
    tower = Mmproj(mmproj)
    tower.check_text_model(model.config.n_embd, model.path)
    return ImageEncoder(tower.config, VisionEngine(tower, threads).encode)
