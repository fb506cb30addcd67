"""The CUDA sources of native/cuda, put together for one of the three toolchains.

Each .cu file includes "prelude.cuh" and what else it needs with quoted includes;
`compose` inlines them (each file once, in the order first met), so that

- nvcc (pycuda) gets one text with no include directive: pycuda's disk cache then
  hashes the source itself rather than running nvcc's preprocessor every time;
- clang-14 (the sm_20 check) and g++ (the host emulation) get the same text, with
  the prelude picking their branch.
"""
from __future__ import annotations

import re
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent.parent / "native" / "cuda"
TARGETS = ("nvcc", "clang", "emulate")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_ANY_INCLUDE = re.compile(r"^\s*#\s*include\b.*$", re.M)


def kernel_files() -> list[Path]:
    """Every .cu file of the kernel folder, in name order."""
    return sorted(CUDA_DIR.glob("*.cu"))


def _inline(path: Path, seen: set[Path]) -> str:
    path = path.resolve()
    if path in seen:
        return ""
    seen.add(path)
    text = path.read_text()
    return _INCLUDE.sub(lambda m: _inline(path.parent / m.group(1), seen), text)


def compose(target: str, files: list[Path] | None = None) -> str:
    """One source for `target` from the given .cu files (default: all of them)."""
    if target not in TARGETS:
        raise ValueError(f"unknown CUDA target {target!r}")
    seen: set[Path] = set()
    parts = [f"#define FM_EMULATE 1\n" if target == "emulate" else ""]
    for path in files or kernel_files():
        parts.append(_inline(Path(path), seen))
    source = "".join(parts)
    if target == "nvcc":
        source = _ANY_INCLUDE.sub("", source)      # only the other branches' headers are left
        assert "#include" not in source, "pycuda would run nvcc's preprocessor on every build"
    elif target == "clang":
        source = re.sub(r"^\s*#\s*include\s+<stdint\.h>\s*$", "", source, flags=re.M)   # the prelude's typedefs
    return source
