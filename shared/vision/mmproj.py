"""An mmproj GGUF (llama.cpp's file for the vision tower) bound to its config, shapes checked.

Tensor names and layout are llama.cpp's for `qwen3vl_merger` (numpy-order shapes):

    v.patch_embd.weight, v.patch_embd.weight.1   [n_embd, 3, p, p]   the Conv3d's two frames
    v.patch_embd.bias                            [n_embd]
    v.position_embd.weight                       [n_pos, n_embd]     a pos_side x pos_side grid, row-major
    v.blk.N.ln1 / ln2 .{weight,bias}             [n_embd]            LayerNorm
    v.blk.N.attn_qkv.{weight,bias}               [3 n_embd, n_embd]  rows Q | K | V, head-major
    v.blk.N.attn_out.{weight,bias}               [n_embd, n_embd]
    v.blk.N.ffn_up.{weight,bias}                 [n_ff, n_embd]
    v.blk.N.ffn_down.{weight,bias}               [n_embd, n_ff]
    v.post_ln.{weight,bias}                      [n_embd]            HF's merger.norm (before the 2x2 merge)
    mm.0.{weight,bias}                           [4 n_embd, 4 n_embd]
    mm.2.{weight,bias}                           [projection_dim, 4 n_embd]

Weights stay in the mapped file; float32 copies are made once, on first use.
"""
from __future__ import annotations

import numpy as np

from ..errors import GGUFError
from ..gguf_file import GGUFFile
from ..model import Weight
from ..quants import DEQUANTIZABLE
from .config import VisionConfig

BLOCK_TENSORS = ("ln1", "ln2", "attn_qkv", "attn_out", "ffn_up", "ffn_down")


def expected_tensors(cfg: VisionConfig) -> dict[str, tuple]:
    """Every tensor of the tower with its numpy-order shape, in llama.cpp's file order."""
    d, p = cfg.n_embd, cfg.patch_size
    shapes = {
        "v.patch_embd.weight": (d, 3, p, p), "v.patch_embd.weight.1": (d, 3, p, p), "v.patch_embd.bias": (d,),
        "v.position_embd.weight": (cfg.n_pos, d),
    }
    for i in range(cfg.n_layer):
        b = f"v.blk.{i}."
        shapes.update({
            b + "ln1.weight": (d,), b + "ln1.bias": (d,),
            b + "attn_qkv.weight": (3 * d, d), b + "attn_qkv.bias": (3 * d,),
            b + "attn_out.weight": (d, d), b + "attn_out.bias": (d,),
            b + "ln2.weight": (d,), b + "ln2.bias": (d,),
            b + "ffn_up.weight": (cfg.n_ff, d), b + "ffn_up.bias": (cfg.n_ff,),
            b + "ffn_down.weight": (d, cfg.n_ff), b + "ffn_down.bias": (d,),
        })
    m = cfg.merged_dim
    shapes.update({
        "v.post_ln.weight": (d,), "v.post_ln.bias": (d,),
        "mm.0.weight": (m, m), "mm.0.bias": (m,),
        "mm.2.weight": (cfg.projection_dim, m), "mm.2.bias": (cfg.projection_dim,),
    })
    return shapes


class Mmproj:
    """A loaded vision tower: `config`, and `weights` by GGUF name (f32(name) gives float32)."""

    def __init__(self, path):
        self.path = str(path)
        self.file = GGUFFile(path)
        try:
            self.config = VisionConfig.from_metadata(self.file.metadata, self.path)
            self.weights = {name: self._weight(name, shape) for name, shape in expected_tensors(self.config).items()}
        except BaseException:
            self.file.close()
            raise

    @property
    def fingerprint(self) -> str:
        return self.file.fingerprint

    def f32(self, name: str) -> np.ndarray:
        return self.weights[name].f32()

    def check_text_model(self, n_embd: int, model_path: str) -> None:
        """The tower's output replaces token embeddings: its width must be the text model's."""
        if self.config.projection_dim != n_embd:
            raise GGUFError(self.path, f"clip.vision.projection_dim is {self.config.projection_dim}, but the text "
                                       f"model {model_path} has embedding_length {n_embd}: not its vision tower")

    def close(self) -> None:
        self.file.close()

    def _weight(self, name: str, shape: tuple) -> Weight:
        info = self.file.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, f"missing tensor {name}")
        got = tuple(info.shape)
        while len(got) > len(shape) and got[0] == 1:     # llama.cpp drops trailing 1-sized ggml dims
            got = got[1:]
        if got != tuple(shape):
            raise GGUFError(self.path, f"tensor {name} has shape {list(info.shape)}, but the metadata implies "
                                       f"{list(shape)}")
        if info.qtype not in DEQUANTIZABLE:
            raise GGUFError(self.path, f"tensor {name}: cannot read ggml type {info.qtype.name}")
        return Weight(name, info.qtype, tuple(shape), self.file.raw(name))
