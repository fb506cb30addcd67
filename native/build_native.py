"""cffi (API mode) build script of native._fermoe_native.

`pip install -e .` runs it through setup.py's cffi_modules; `python native/build_native.py`
builds the module in place by hand (handy on a machine without pip access).
Flags: portable x86-64 code (no -march=native): the SIMD versions carry their own
__attribute__((target(...))) and dispatch.c picks one at run time.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sysconfig
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ["kernels_scalar.c", "kernels_ssse3.c", "kernels_avx2.c", "kernels_avx512vnni.c", "kernel_scratch.c",
           "dispatch.c", "membench.c",
           "threadpool.c", "bandwidth.c", "linear.c", "forward.c", "gdn.c", "attention.c", "moe.c"]
HEADERS = ["fermoe_blocks.h", "kernels.h", "x86.h", "tiled_matmul_template.h", "group_matvec_template.h", "membench.h",
           "threadpool.h", "model.h", "linear.h", "forward.h", "ctx.h", "ops.h"]
# -ffp-contract=off: no silent a*b+c fusing, so the scalar reference rounds as written.
# -fno-trapping-math: nothing here reads floating-point exception flags; without it gcc
# keeps the clamps of fm_expf as branches, and no SiLU or softmax loop vectorises.
# It changes no result (no reassociation: that would need -fassociative-math).
CFLAGS = ["-O3", "-std=c11", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-trapping-math"]

# Block structs and the fp16 helpers are spelled out (cffi's API mode checks the
# struct layout against fermoe_blocks.h when it compiles); the kernel API is read
# from kernels.h itself, between these two markers, so it cannot drift.
CDEF = """
typedef struct { uint16_t d; uint8_t qs[16]; } block_q4_0;
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;
float fm_fp16_to_fp32(uint16_t h);
uint16_t fm_fp32_to_fp16(float f);
"""
KERNEL_API = ("enum { FM_ISA_SCALAR", "/* ---- the per-ISA implementations ----")


# The forward's headers (and the read probe's) are plain declarations: cffi reads them as
# they are (less the preprocessor lines), so the Python view of the structs can never
# drift from C.
FORWARD_HEADERS = ["model.h", "threadpool.h", "membench.h", "linear.h", "forward.h"]


def _header_cdef(name: str, section: tuple[str, str] | None = None) -> str:
    text = (HERE / name).read_text()
    if section:
        start, end = text.index(section[0]), text.index(section[1])
        text = text[start:end]
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


NO_COMPILER = ("fermoe: no C compiler found (looked for {cc!r}); the native kernels need one: "
               "install gcc (e.g. apt-get install gcc) or set CC, then run pip install -e . again")


def _check_compiler() -> None:
    """Fail with one readable line, not a distutils traceback, when there is no compiler."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "gcc"
    exe = shlex.split(cc)[0] if cc.strip() else "gcc"
    if shutil.which(exe) is None:
        raise SystemExit(NO_COMPILER.format(cc=exe))


def make_builder(absolute: bool = False) -> FFI:
    """The cffi builder. setuptools wants source paths relative to the project root
    (its working directory during a build); ffi.compile() needs absolute ones."""
    root = HERE.parent
    sources = [str(HERE / s) if absolute else os.path.relpath(HERE / s, root) for s in SOURCES]
    builder = FFI()
    builder.cdef(CDEF + _header_cdef("kernels.h", KERNEL_API) + "".join(_header_cdef(h) for h in FORWARD_HEADERS))
    builder.set_source(
        "native._fermoe_native",
        '#include "kernels.h"\n#include "membench.h"\n#include "linear.h"\n#include "forward.h"',
        sources=sources,
        include_dirs=[str(HERE)],
        depends=[str(HERE / h) for h in HEADERS],
        extra_compile_args=CFLAGS,
        extra_link_args=["-pthread"],
    )
    return builder


_check_compiler()
ffibuilder = make_builder()

if __name__ == "__main__":
    # Manual build: compile in a temporary folder, leave the .so inside native/.
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        so = make_builder(absolute=True).compile(tmpdir=tmp, verbose=False)
        dest = HERE / Path(so).name
        # a new file renamed over the old one: a running process keeps the library it mapped
        # (copied over in place, its pages change under it: SIGBUS)
        staged = dest.with_name(dest.name + f".{os.getpid()}.tmp")
        shutil.copy(so, staged)
        os.replace(staged, dest)
        print(dest)
