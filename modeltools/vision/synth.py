"""Random vision towers of the real structure: `fermoe synth --mmproj`, and the benchmark's
full-size tower (made in memory, never written, when no file is given).

Values are scaled so activations stay O(1) through every block: matrices by
1/sqrt(fan_in), LayerNorm weights near 1, small biases.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..convert import OUT_TYPES, Item
from shared.errors import ModelError
from shared.model import RANDOM_WEIGHTS_KEY
from shared.vision.config import VisionConfig
from shared.vision.mmproj import expected_tensors
from .writer import write_mmproj



def preset_config(preset: str, projection_dim: int | None = None) -> VisionConfig:
    """The tower of a `fermoe synth` preset; projection_dim: the text model's width."""
    if preset == "qwen3.6-35b-a3b":
        return VisionConfig(n_embd=1152, n_ff=4304, n_layer=27, n_head=16, patch_size=16, image_size=768,
                            n_merge=2, projection_dim=projection_dim or 2048)
    if preset == "tiny":
        return VisionConfig(n_embd=64, n_ff=128, n_layer=2, n_head=4, patch_size=16, image_size=768,
                            n_merge=2, projection_dim=projection_dim or 256)
    raise ModelError(f"unknown vision preset {preset!r}; choose tiny or qwen3.6-35b-a3b")


def random_tensor(name: str, shape: tuple, seed: int) -> np.ndarray:
    """One tensor's values; one generator per tensor, so values do not depend on order."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith(".bias"):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if ".ln" in name or name.startswith("v.post_ln"):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "v.position_embd.weight":
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = int(np.prod(shape[1:])) * (2 if name.startswith("v.patch_embd") else 1)
    return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float32)


class RandomTower:
    """The weights of a random tower in memory, read as an Mmproj is (`config`, `f32(name)`)."""

    def __init__(self, cfg: VisionConfig, seed: int = 0):
        self.config, self.seed = cfg, seed
        self._shapes = expected_tensors(cfg)
        self._cache: dict[str, np.ndarray] = {}

    def f32(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = random_tensor(name, self._shapes[name], self.seed)
        return self._cache[name]


def synth_mmproj(out_path, cfg: VisionConfig, out_type: str = "f16", seed: int = 0, progress: bool = False) -> None:
    """Write a random tower of `cfg` to `out_path` as an mmproj GGUF."""
    if out_type not in OUT_TYPES:
        raise ModelError(f"--type {out_type!r}: expected one of {', '.join(OUT_TYPES)}")
    items = [Item(name, shape, lambda n=name, s=shape: random_tensor(n, s, seed))
             for name, shape in expected_tensors(cfg).items()]
    meta = cfg.to_metadata()
    meta["general.name"] = "fermoe-synth-vision"
    meta["general.description"] = "random weights written by fermoe synth: its output is noise"
    meta[RANDOM_WEIGHTS_KEY] = True
    write_mmproj(out_path, meta, items, OUT_TYPES[out_type], progress)
