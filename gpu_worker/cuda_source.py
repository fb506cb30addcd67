"""The CUDA sources of native/cuda, put together for one of the three toolchains.

Each .cu file includes "prelude.cuh" and what else it needs with quoted includes;
`compose` inlines them (each file once, in the order first met), so that

- nvcc (pycuda) gets one text with no include directive: pycuda's disk cache then
  hashes the source itself rather than running nvcc's preprocessor every time;
- clang-14 (the sm_20 check) and g++ (the host emulation) get the same text, with
  the prelude picking their branch.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

from shared.errors import FermoeError

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
    parts = ["#define FM_EMULATE 1\n" if target == "emulate" else ""]
    for path in files or kernel_files():
        parts.append(_inline(Path(path), seen))
    source = "".join(parts)
    if target == "nvcc":
        source = _ANY_INCLUDE.sub("", source)      # only the other branches' headers are left
        assert "#include" not in source, "pycuda would run nvcc's preprocessor on every build"
    elif target == "clang":
        source = re.sub(r"^\s*#\s*include\s+<stdint\.h>\s*$", "", source, flags=re.M)   # the prelude's typedefs
    return source


# ---- the entry points' signatures, read from their declarations --------------------------
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)\s*\(([^)]*)\)')
_SCALARS = {"int": "i", "int32_t": "i", "unsigned": "I", "unsigned int": "I", "uint32_t": "I", "float": "f",
            "long long": "q", "int64_t": "q"}


def _preprocessed(source: str, *flags: str) -> str:
    """`source` through the C preprocessor (which expands the macros that make families of
    entry points, such as gemm.cu's FM_GEMM_ENTRIES); the one the native build uses."""
    cc = os.environ.get("CC", "cc")
    try:
        run = subprocess.run([cc, "-E", "-P", *flags, "-x", "c", "-"], input=source, capture_output=True, text=True)
    except FileNotFoundError:
        raise FermoeError(f"{cc} not found: the CUDA kernels' signatures and constants are read through the C "
                          f"preprocessor (install gcc or set CC)") from None
    if run.returncode != 0:
        raise FermoeError(f"{cc} -E failed on the CUDA sources:\n{run.stderr[-2000:]}")
    return run.stdout


def _kind(param: str, entry: str) -> str:
    """A parameter's letter in pycuda's `prepare` signature: P pointer, i int, I unsigned,
    f float, q int64."""
    if "*" in param:
        return "P"
    words = [w for w in param.replace("const", " ").split() if w not in ("__restrict__", "__restrict")]
    base = " ".join(words[:-1])                     # the last word is the parameter's name
    if base not in _SCALARS:
        raise FermoeError(f"{entry}: parameter {param.strip()!r} has a type the launcher cannot pass")
    return _SCALARS[base]


@functools.lru_cache(maxsize=None)
def _signatures_of(source: str) -> dict[str, str]:
    found = {}
    for name, params in _ENTRY.findall(_preprocessed(source)):
        params = [p for p in params.split(",") if p.strip() and p.strip() != "void"]
        found[name] = "".join(_kind(p, name) for p in params)
    return found


def kernel_signatures(files: list[Path] | None = None) -> dict[str, str]:
    """Every entry point (FM_KERNEL) of the sources and its pycuda signature, taken from its
    declaration, so a kernel is declared in one place: its .cu file."""
    return dict(_signatures_of(compose("nvcc", files)))


_DEFINE = re.compile(r"^#define (FM_\w+) \(?(-?\d+)\)?$", re.M)


@functools.lru_cache(maxsize=None)
def kernel_constants() -> dict[str, int]:
    """The integer FM_ constants the sources #define (tile sizes, limits, flags), so the
    launchers read them rather than copy them."""
    return {name: int(value) for name, value in _DEFINE.findall(_preprocessed(compose("nvcc"), "-dM"))}
