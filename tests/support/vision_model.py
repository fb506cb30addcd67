"""What the image serving tests share: a small text model with a vision tower (the files),
and a chat message holding images."""
from __future__ import annotations

from pathlib import Path

from modeltools.synth import synth
from modeltools.vision.synth import preset_config, synth_mmproj

TEXT = "What is in this picture?"


def vision_model(folder: Path) -> tuple[Path, Path]:
    """(a 2-layer tiny model, its mmproj) written into folder: a template that places images."""
    cfg = synth(folder / "m.gguf", "tiny", layers=2, out_type="q8_0", seed=0, progress=False)
    synth_mmproj(folder / "mmproj.gguf", preset_config("tiny", projection_dim=cfg.n_embd), "f32", seed=1)
    return folder / "m.gguf", folder / "mmproj.gguf"


def chat(*images: bytes, text: str = TEXT) -> list[dict]:
    """One user message: the images, then the text."""
    return [{"role": "user", "content": [{"type": "image", "data": d} for d in images] + [{"type": "text",
                                                                                          "text": text}]}]
