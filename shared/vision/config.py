"""VisionConfig: the vision tower of a Qwen3.5/3.6 mmproj GGUF, built from its `clip.*` keys.

llama.cpp keeps the vision tower in a second GGUF (the "mmproj"), architecture
`clip`, projector type `qwen3vl_merger`. The keys are those its converter writes
(gguf-py constants); derived sizes are computed here and nowhere else.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ..config import metadata_value
from ..errors import GGUFError

PROJECTOR = "qwen3vl_merger"
ROPE_THETA = 10000.0           # the tower's 2-D rotary base; llama.cpp hard-codes it too, no key holds it


@dataclass(frozen=True)
class VisionConfig:
    n_embd: int                # clip.vision.embedding_length (1152)
    n_ff: int                  # clip.vision.feed_forward_length (4304)
    n_layer: int               # clip.vision.block_count (27)
    n_head: int                # clip.vision.attention.head_count (16)
    patch_size: int            # clip.vision.patch_size (16)
    image_size: int            # clip.vision.image_size (768): sqrt(positions) x patch_size
    n_merge: int               # clip.vision.spatial_merge_size (2)
    projection_dim: int        # clip.vision.projection_dim: the text model's hidden size
    eps: float = 1e-6          # clip.vision.attention.layer_norm_epsilon
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)

    def __post_init__(self):
        # GGUF stores eps as float32: round it here so a config equals itself read back
        object.__setattr__(self, "eps", float(struct.unpack("<f", struct.pack("<f", self.eps))[0]))

    # ---- derived sizes -------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def pos_side(self) -> int:
        """The learned position table is a pos_side x pos_side grid of patches."""
        return self.image_size // self.patch_size

    @property
    def n_pos(self) -> int:
        return self.pos_side ** 2

    @property
    def patch_dim(self) -> int:
        """Values of one row of pixel patches: 3 channels x 2 frames x patch x patch."""
        return 3 * 2 * self.patch_size ** 2

    @property
    def factor(self) -> int:
        """Image sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.n_merge

    @property
    def merged_dim(self) -> int:
        return self.n_embd * self.n_merge ** 2

    # ---- GGUF metadata, both ways ----------------------------------------
    def to_metadata(self) -> dict:
        """The keys llama.cpp's converter writes for this tower (its Qwen3VLVisionModel)."""
        v = "clip.vision."
        return {
            "general.architecture": "clip",
            "general.type": "mmproj",
            "clip.has_vision_encoder": True,
            "clip.projector_type": PROJECTOR,
            "clip.use_gelu": True,
            v + "projection_dim": self.projection_dim,
            v + "image_size": self.image_size,
            v + "patch_size": self.patch_size,
            v + "embedding_length": self.n_embd,
            v + "feed_forward_length": self.n_ff,
            v + "block_count": self.n_layer,
            v + "attention.head_count": self.n_head,
            v + "attention.layer_norm_epsilon": float(self.eps),
            v + "image_mean": [float(x) for x in self.image_mean],
            v + "image_std": [float(x) for x in self.image_std],
            v + "spatial_merge_size": self.n_merge,
            v + "is_deepstack_layers": [False] * self.n_layer,
        }

    @classmethod
    def from_metadata(cls, meta: dict, path: str = "<metadata>") -> "VisionConfig":
        arch = meta.get("general.architecture")
        if arch != "clip":
            raise GGUFError(path, f"general.architecture is {arch!r}, not 'clip': not an mmproj (vision) file")
        if not meta.get("clip.has_vision_encoder", False):
            raise GGUFError(path, "clip.has_vision_encoder is not true: this mmproj file has no vision tower")
        # a file with towers of two modalities names each one's projector under its own prefix
        key_name = "clip.vision.projector_type" if "clip.vision.projector_type" in meta else "clip.projector_type"
        projector = meta.get(key_name)
        if projector != PROJECTOR:
            raise GGUFError(path, f"{key_name} is {projector!r}; only {PROJECTOR!r} (Qwen3.5/3.6) is supported")

        def key(name, kind=int, default=None):
            return metadata_value(meta, path, "clip.vision." + name, kind, default)

        def triple(name):
            value = meta.get("clip.vision." + name, (0.5, 0.5, 0.5))
            if not isinstance(value, (list, tuple)) or len(value) != 3:
                raise GGUFError(path, f"metadata key clip.vision.{name} has value {value!r}, expected 3 numbers")
            return tuple(float(x) for x in value)

        deepstack = meta.get("clip.vision.is_deepstack_layers") or []
        if any(deepstack):
            raise GGUFError(path, "clip.vision.is_deepstack_layers marks deepstack layers (a Qwen3-VL tower); "
                                  "Qwen3.5/3.6 towers have none and fermoe does not run them")
        if not meta.get("clip.use_gelu", True):
            raise GGUFError(path, "clip.use_gelu is false; the qwen3vl_merger tower uses GELU")
        cfg = cls(
            n_embd=key("embedding_length"), n_ff=key("feed_forward_length"), n_layer=key("block_count"),
            n_head=key("attention.head_count"), patch_size=key("patch_size"), image_size=key("image_size"),
            n_merge=key("spatial_merge_size", default=2), projection_dim=key("projection_dim"),
            eps=key("attention.layer_norm_epsilon", float, 1e-6),
            image_mean=triple("image_mean"), image_std=triple("image_std"),
        )
        cfg.validate(path)
        return cfg

    def validate(self, path: str = "<config>") -> None:
        """Refuse towers that no weights could satisfy, naming the key."""
        for name in ("n_embd", "n_ff", "n_layer", "n_head", "patch_size", "image_size", "n_merge", "projection_dim"):
            if getattr(self, name) <= 0:
                raise GGUFError(path, f"metadata gives {name} = {getattr(self, name)}; it must be positive")
        checks = [
            (self.n_embd % self.n_head == 0, "clip.vision.embedding_length must be a multiple of attention.head_count"),
            (self.head_dim % 4 == 0, "the head size (embedding_length / head_count) must be a multiple of 4 "
                                     "(2-D rotary: half the pairs for rows, half for columns)"),
            (self.image_size % self.patch_size == 0, "clip.vision.image_size must be a multiple of patch_size"),
            (0 < self.eps < 1, f"clip.vision.attention.layer_norm_epsilon = {self.eps} is not in (0, 1)"),
            (all(s > 0 for s in self.image_std), "clip.vision.image_std must be positive"),
        ]
        for ok, problem in checks:
            if not ok:
                raise GGUFError(path, problem)
        if math.isqrt(self.n_pos) ** 2 != self.n_pos:
            raise GGUFError(path, "the position table must be square")
