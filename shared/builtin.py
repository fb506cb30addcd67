"""The built-in models: generated on first use into a cache directory."""
from __future__ import annotations

import os
from pathlib import Path

BUILTIN = {"tiny": dict(preset="tiny", out_type="q4_0", seed=0)}


def cache_dir() -> Path:
    root = os.environ.get("FERMOE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fermoe"
    return Path(root)


def resolve_model(name_or_path: str) -> str:
    """A GGUF path as given, or the cached file of a built-in model (made if missing)."""
    if name_or_path not in BUILTIN:
        return name_or_path
    from .synth import SYNTH_VERSION
    spec = BUILTIN[name_or_path]
    path = cache_dir() / f"{name_or_path}-{spec['out_type']}-seed{spec['seed']}-v{SYNTH_VERSION}.gguf"
    if not path.exists():
        from .synth import synth
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        synth(tmp, progress=False, **spec)
        os.replace(tmp, path)      # atomic: a concurrent first use never sees half a file
    return str(path)
