"""The Fermi check: every kernel source compiles to `.target sm_20` PTX with
clang-14's NVPTX back end (which refuses later intrinsics: warp shuffles, votes,
__ldg...) and no entry point declares more than 48 KB of shared memory (clang does
not refuse an oversized __shared__ array: the PTX's .shared declarations are
summed per entry). Needs no GPU: `python -m gpu_worker.fermi_check`."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cuda_source import compose, kernel_files

SHARED_LIMIT = 48 * 1024
CLANG = "clang-14"
FLAGS = ["-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_20", "-nocudainc", "-nocudalib", "-O2",
         "-std=c++17", "-S", "-Wno-unknown-cuda-version"]


def find_clang() -> str | None:
    return shutil.which(CLANG)


def compile_ptx(path: Path) -> str:
    """The sm_20 PTX of one .cu file (composed as clang sees it); raises with clang's errors."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / path.name, Path(tmp) / (path.stem + ".ptx")
        src.write_text(compose("clang", [path]))
        run = subprocess.run([CLANG, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{path.name} does not compile for sm_20:\n{run.stderr}")
        return out.read_text()


_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.M)
_SHARED = re.compile(r"\.shared \.align \d+ \.b8 (\w+)\[(\d+)\]")


def shared_bytes_per_entry(ptx: str) -> dict[str, int]:
    """Static shared memory of each entry point: the .shared arrays it references.
    clang emits them as module-level globals named after the function that owns
    them, so an entry's are those its body (and its inlined callees) mention."""
    arrays = {name: int(size) for name, size in _SHARED.findall(ptx)}
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)] + [(len(ptx), None)]
    out = {}
    for (start, name), (end, _) in zip(starts, starts[1:]):
        body = ptx[start:end]
        out[name] = sum(size for arr, size in arrays.items() if re.search(rf"\b{arr}\b", body))
    return out


def check_all() -> dict[str, dict[str, int]]:
    """{file: {entry: shared bytes}} for every .cu; raises on the first failure."""
    report = {}
    files = kernel_files()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:   # one clang process a file
        ptxs = list(pool.map(compile_ptx, files))
    for path, ptx in zip(files, ptxs):
        if ".target sm_20" not in ptx:
            raise RuntimeError(f"{path.name}: the PTX does not target sm_20")
        shared = shared_bytes_per_entry(ptx)
        over = {k: v for k, v in shared.items() if v > SHARED_LIMIT}
        if over:
            raise RuntimeError(f"{path.name}: more than 48 KB of shared memory in {over}")
        report[path.name] = shared
    return report


def main() -> int:
    if find_clang() is None:
        print(f"fermi_check: {CLANG} not found (apt-get install clang-14)", file=sys.stderr)
        return 1
    try:
        report = check_all()
    except RuntimeError as e:
        print(f"fermi_check: {e}", file=sys.stderr)
        return 1
    for name, entries in report.items():
        print(f"{name}: {len(entries)} entries, max shared {max(entries.values(), default=0)} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
