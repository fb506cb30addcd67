"""The vision tower on the GPU: shared/vision/reference.py's forward with native/cuda's
kernels (vision.cu for the tower's own steps, gemm.cu's GEMMs for every matrix product,
on the mmproj's weights in their stored type). The same interface as the CPU's
VisionEngine (cpu_worker/vision_engine.py): `encode(pixels, grid)` -> merged tokens.

One image, n patches (rows in merge-block order), d wide:

    x = pos + b_patch                     host: the resampled table, once per grid
    x += pixels Wp^T                      the Conv3d's two 2-D kernels as one [d, 3*2*p*p] matrix
    per block:  h = LN1(x);  qkv = h Wqkv^T;  bias + rotary (vis_qkv_rope)
                h = attention(qkv);  x += h Wo^T + bo
                h = LN2(x);  u = gelu_tanh(h Wup^T + bup);  x += u Wdown^T + bdown
    h = post_ln(x), read as [n/4, 4d];  y = gelu_erf(h W0^T + b0);  out = y W2^T + b2

Memory: the weights once (as stored: 0.9 GB for the real tower in f16), a workspace
per image (n x (2d + max(3d, ff, patch values) + head_dim) + n/4 x projection floats:
112 MiB for a 1024x1024 image of the real tower). `reserve_patches` keeps one of that
many patches allocated, so a GPU worker plans its prefill memory around it; a larger
image gets its own for the time of its pass.
"""
from __future__ import annotations

import math

import numpy as np

from shared.errors import FermoeError
from shared.vision.reference import check_grid, merge_order, position_embedding, rotary_cos_sin

from .buffers import DeviceArray
from .kernels import LaunchError
from .ops import SPLIT_K_FLOATS, Ops
from .weights import GpuWeight, upload_weight

ROW_GRID = 4096              # blocks of the row kernels (each loops over rows past the grid)
MAX_HEAD_DIM = 128           # vision.cu's FM_VIS_MAX_HD
ATTN_ROWS = 64               # vision.cu's FM_VQ
GELU_TANH, GELU_ERF = 1, 2   # vis_bias_act's act
RESERVE_PATCHES = 4096       # a 1024x1024 image: the workspace a GPU worker keeps
BLOCK_TENSORS = ("ln1.weight", "ln1.bias", "attn_qkv.weight", "attn_qkv.bias", "attn_out.weight", "attn_out.bias",
                 "ln2.weight", "ln2.bias", "ffn_up.weight", "ffn_up.bias", "ffn_down.weight", "ffn_down.bias")
MERGER_TENSORS = ("v.post_ln.weight", "v.post_ln.bias", "mm.0.weight", "mm.0.bias", "mm.2.weight", "mm.2.bias")


def workspace_floats(cfg, n: int) -> int:
    """Floats of an image's workspace of n patches (VisionWorkspace's buffers)."""
    return sum(int(np.prod(shape)) for shape in VisionWorkspace.spec(cfg, n).values())


class VisionWorkspace:
    """An image's activations: x (the residual stream), h (norm and attention outputs),
    big (pixels, then qkv, the MLP's up rows, the merger's hidden rows: never two at
    once), cos / sin of the rotary, out (the merged tokens)."""

    @staticmethod
    def spec(cfg, n: int) -> dict[str, tuple]:
        """Buffer name -> shape (float32): what __init__ allocates, and workspace_floats counts."""
        d, half = cfg.n_embd, cfg.head_dim // 2
        return {"x": (n, d), "h": (n, d), "big": (n * max(3 * d, cfg.n_ff, cfg.patch_dim),), "cos": (n, half),
                "sin": (n, half), "out": (n // cfg.n_merge ** 2, cfg.projection_dim)}

    def __init__(self, device, cfg, n: int):
        self.n, self.arrays = n, []
        try:
            for name, shape in self.spec(cfg, n).items():
                setattr(self, name, DeviceArray(device, shape))
                self.arrays.append(getattr(self, name))
        except BaseException:               # what was taken before memory ran out is given back
            self.free()
            raise

    def free(self) -> None:
        for a in self.arrays:
            a.free()
        self.arrays = []


class GPUVisionEngine:
    """Encodes images with a tower (an Mmproj, or anything with `config` and `f32(name)`)
    on `device` (a CudaDevice or the host emulation)."""

    def __init__(self, tower, device, reserve_patches: int = 0):
        self.config = cfg = tower.config
        if cfg.head_dim > MAX_HEAD_DIM:
            raise FermoeError(f"vision head size {cfg.head_dim}: the GPU tower takes up to {MAX_HEAD_DIM}")
        self.device, self.tower = device, tower
        self.ops = Ops(device)
        self.threads = 1                    # the host thread that feeds the device
        self.arrays, self.ws = [], None
        self._grids: dict = {}              # (gh, gw) -> host inputs of that grid (positions, rotary)
        d = cfg.n_embd
        # the two frames' kernels side by side: a pixel row's (c, t, py, px) order
        patch = np.stack([tower.f32("v.patch_embd.weight"), tower.f32("v.patch_embd.weight.1")], axis=2)
        self.patch_b = np.asarray(tower.f32("v.patch_embd.bias"), np.float32)
        self.pos_table = np.asarray(tower.f32("v.position_embd.weight"), np.float32)
        try:
            self.patch_w = self._f32(patch.reshape(d, -1))
            self.blocks = [{n: self._weight(f"v.blk.{i}.{n}") for n in BLOCK_TENSORS} for i in range(cfg.n_layer)]
            self.merger = {n: self._weight(n) for n in MERGER_TENSORS}
            self.ops.split_scratch = self._keep(DeviceArray(device, (SPLIT_K_FLOATS,)))
        except Exception as e:              # pycuda's MemoryError, the emulation's EmulationError
            held = sum(a.nbytes for a in self.arrays)
            self.close()
            raise FermoeError(f"the vision tower does not fit the GPU: {held >> 20} MiB of its weights were "
                              f"uploaded when this failed ({e})") from None
        self.weights_nbytes = sum(a.nbytes for a in self.arrays)
        if reserve_patches > 0:
            try:
                self.ws = self._workspace(reserve_patches)
            except FermoeError:
                self.close()
                raise

    @property
    def nbytes(self) -> int:
        """Device memory held between images: the weights, the split-K scratch, the reserved workspace."""
        return self.weights_nbytes + (4 * workspace_floats(self.config, self.ws.n) if self.ws else 0)

    def _keep(self, a: DeviceArray) -> DeviceArray:
        self.arrays.append(a)
        return a

    def _f32(self, host: np.ndarray) -> GpuWeight:
        host = np.ascontiguousarray(host, np.float32)
        return GpuWeight(self._keep(DeviceArray.of(self.device, host)), "f32", host.shape)

    def _weight(self, name: str) -> GpuWeight:
        """A matrix in the type the file stores it (the GEMMs read f32, f16, q4_0, q8_0), a
        vector in f32; a tower without a file (random, a state dict) in f32."""
        stored = getattr(self.tower, "weights", {}).get(name)
        if stored is None:
            return self._f32(self.tower.f32(name))
        w = upload_weight(self.device, stored)
        stored.release()                    # upload_weight may have made a float32 copy
        self._keep(w.data)
        return w

    def close(self) -> None:
        if self.device is None:
            return
        self.device.synchronize()
        for a in self.arrays:
            a.free()
        if self.ws is not None:
            self.ws.free()
        self.arrays, self.ws, self.device = [], None, None

    # ---- host inputs of a grid ------------------------------------------------------------
    def _grid_inputs(self, gh: int, gw: int):
        """The patch bias plus the resampled position table [n, d], the rotary's cos and
        sin [n, head_dim / 2]: float32, computed once per grid (a few grids at most kept)."""
        key = (gh, gw)
        if key not in self._grids:
            cfg = self.config
            order = merge_order(gh, gw, cfg.n_merge)
            pos = position_embedding(self.pos_table, cfg.pos_side, gh, gw, order) + self.patch_b
            cos, sin = rotary_cos_sin(gh, gw, order, cfg.head_dim)
            half = cfg.head_dim // 2
            if len(self._grids) >= 8:
                self._grids.pop(next(iter(self._grids)))
            self._grids[key] = tuple(np.ascontiguousarray(a, np.float32) for a in (pos, cos[:, :half], sin[:, :half]))
        return self._grids[key]

    # ---- launches ---------------------------------------------------------------------------
    def _mark(self, phase: str) -> None:
        """A phase mark for the kernel timer (bench vision's breakdown), when one is set."""
        if self.ops.k.timer is not None:
            self.ops.k.timer.mark(phase)

    def _layernorm(self, y, x, w, b, rows: int):
        k, n = self.ops.k, self.config.n_embd
        k.vis_layernorm((min(rows, ROW_GRID),), (256,), self.ops.stream, y, x, w.data, b.data, rows, n,
                        self.config.eps)

    def _bias_act(self, x, b, rows: int, n: int, act: int = 0):
        self.ops.k.vis_bias_act((min(rows, ROW_GRID),), (256,), self.ops.stream, x, b.data, rows, n, act)

    def _gemm(self, C, A, w: GpuWeight, M: int, accumulate: bool = False):
        N, K = w.shape
        self.ops.gemm(C, A, w.data, M, N, K, w.wtype, accumulate=accumulate)

    def _block(self, ws: VisionWorkspace, blk: dict, n: int):
        cfg, k, s = self.config, self.ops.k, self.ops.stream
        d, nh, hd = cfg.n_embd, cfg.n_head, cfg.head_dim
        qkv, up = ws.big.view((n, 3 * d)), ws.big.view((n, cfg.n_ff))
        self._layernorm(ws.h, ws.x, blk["ln1.weight"], blk["ln1.bias"], n)
        self._gemm(qkv, ws.h, blk["attn_qkv.weight"], n)
        k.vis_qkv_rope((min(n, ROW_GRID),), (128,), s, qkv, blk["attn_qkv.bias"].data, ws.cos, ws.sin, n, nh, hd)
        if int(qkv) % 16:
            raise LaunchError("vis_attention: qkv must be 16-byte aligned (it reads 4 floats at once)")
        k.vis_attention((nh, -(-n // ATTN_ROWS)), (256,), s, ws.h, qkv, n, nh, hd, 1.0 / math.sqrt(hd))
        self._gemm(ws.x, ws.h, blk["attn_out.weight"], n, accumulate=True)
        self._bias_act(ws.x, blk["attn_out.bias"], n, d)
        self._layernorm(ws.h, ws.x, blk["ln2.weight"], blk["ln2.bias"], n)
        self._gemm(up, ws.h, blk["ffn_up.weight"], n)
        self._bias_act(up, blk["ffn_up.bias"], n, cfg.n_ff, GELU_TANH)
        self._gemm(ws.x, up, blk["ffn_down.weight"], n, accumulate=True)
        self._bias_act(ws.x, blk["ffn_down.bias"], n, d)

    def encode(self, pixels: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
        """One image's merged tokens, float32 [gh*gw/4, projection_dim]."""
        if self.device is None:
            raise FermoeError("the GPU vision engine is closed")
        cfg, (gh, gw) = self.config, grid
        check_grid(cfg, pixels, gh, gw)
        n, merged = gh * gw, gh * gw // cfg.n_merge ** 2
        pos, cos, sin = self._grid_inputs(gh, gw)
        own = self.ws is None or n > self.ws.n
        ws = self._workspace(n) if own else self.ws
        try:
            self._mark("upload")
            # synchronous uploads: the previous image's kernels are done with these buffers
            ws.x.rows(0, n).upload(pos)
            ws.cos.rows(0, n).upload(cos)
            ws.sin.rows(0, n).upload(sin)
            px = ws.big.view((n, cfg.patch_dim))
            px.upload(np.ascontiguousarray(pixels, np.float32))
            self._gemm(ws.x, px, self.patch_w, n, accumulate=True)
            for blk in self.blocks:
                self._block(ws, blk, n)
            m = self.merger
            self._layernorm(ws.h, ws.x, m["v.post_ln.weight"], m["v.post_ln.bias"], n)
            hidden = ws.big.view((merged, cfg.merged_dim))
            self._gemm(hidden, ws.h.view((merged, cfg.merged_dim)), m["mm.0.weight"], merged)
            self._bias_act(hidden, m["mm.0.bias"], merged, cfg.merged_dim, GELU_ERF)
            out = ws.out.rows(0, merged)
            self._gemm(out, hidden, m["mm.2.weight"], merged)
            self._bias_act(out, m["mm.2.bias"], merged, cfg.projection_dim)
            self._mark("download")
            return out.download()
        finally:
            if own:
                self.device.synchronize()
                ws.free()

    def _workspace(self, n: int) -> VisionWorkspace:
        try:
            return VisionWorkspace(self.device, self.config, n)
        except Exception as e:      # pycuda's MemoryError, the emulation's EmulationError
            free, _ = self.device.mem_get_info()
            raise FermoeError(f"an image of {n} patches needs {4 * workspace_floats(self.config, n) >> 20} MiB of GPU "
                              f"memory for the vision tower's activations; {free >> 20} MiB are free ({e})") from None


def open_tower(mmproj: str, model):
    """The Mmproj of file `mmproj`, checked against the text model."""
    from shared.vision.mmproj import Mmproj
    tower = Mmproj(mmproj)
    try:
        tower.check_text_model(model.config.n_embd, model.path)
    except BaseException:
        tower.close()
        raise
    return tower


def gpu_engines(model, tower, gpu_mem: int | None = None, gpu: int = 0, device=None,
                reserve_patches: int = RESERVE_PATCHES, **engine_options):
    """(GPUEngine, GPUVisionEngine) on one device, the tower first: its weights and a
    workspace for images of up to `reserve_patches` patches come out of `gpu_mem` (the
    whole budget; default: the device's free memory), the prefill engine plans with the
    rest. The prefill engine owns the device (closing it closes the device)."""
    from .cuda import open_device
    from .engine import GPUEngine
    own = device is None
    device = device if device is not None else open_device(gpu)
    vision = None
    try:
        vision = GPUVisionEngine(tower, device, reserve_patches)
        if gpu_mem is not None:
            if gpu_mem <= vision.nbytes:
                raise FermoeError(f"--gpu-mem {gpu_mem >> 20} MiB: the vision tower alone takes {vision.nbytes >> 20} "
                                  "MiB of it")
            gpu_mem -= vision.nbytes
        engine = GPUEngine(model, gpu_mem=gpu_mem, device=device, **engine_options)
    except BaseException:
        if vision is not None:
            vision.close()
        if own and hasattr(device, "close"):
            device.close()
        raise
    engine._owns_device = own
    return engine, vision


def image_encoder(tower, vision: GPUVisionEngine):
    """A worker's ImageEncoder (image bytes -> merged tokens) over the GPU tower."""
    from shared.vision.prompt import ImageEncoder
    return ImageEncoder(tower.config, vision.encode)

