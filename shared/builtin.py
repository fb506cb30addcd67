"""The built-in models: GGUF files that ship inside the package (shared/data/).

`tiny` is a small Qwen3.5-MoE trained by tools/train_tiny.py on the standard library's
docstrings and on agent episodes that call a pydoc tool (shared/pydoc_tool.py; docs/models.md,
"The built-in model"), stored Q8_0. The random models of
`fermoe synth` are made on demand by whoever needs exact shapes (the tests)."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import FermoeError

DATA_DIR = Path(__file__).parent / "data"
BUILTIN = {"tiny": DATA_DIR / "tiny-q8_0.gguf"}


def cache_dir() -> Path:
    """Where fermoe keeps what it builds at run time (the GPU emulation's kernels)."""
    root = os.environ.get("FERMOE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fermoe"
    return Path(root)


def resolve_model(name_or_path: str) -> str:
    """A GGUF path as given, or the packaged file of a built-in model."""
    path = BUILTIN.get(name_or_path)
    if path is None:
        return name_or_path
    if not path.exists():
        raise FermoeError(f"the built-in model {name_or_path!r} is missing from this installation ({path})")
    return str(path)
