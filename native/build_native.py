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
SOURCES = ["kernels_scalar.c", "kernels_x86.c", "kernels_avx512.c", "kernels_float_x86.c",
           "dispatch.c", "membench.c",
           "threadpool.c", "bandwidth.c", "linear.c", "forward.c", "gdn.c", "attention.c", "moe.c"]
HEADERS = ["fermoe_blocks.h", "kernels.h", "threadpool.h", "model.h", "linear.h", "forward.h", "ctx.h", "ops.h"]
# -ffp-contract=off: no silent a*b+c fusing, so the scalar reference rounds as written.
CFLAGS = ["-O3", "-std=c11", "-fPIC", "-pthread", "-ffp-contract=off"]

CDEF = """
typedef struct { uint16_t d; uint8_t qs[16]; } block_q4_0;
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;

void fm_quantize_row_q8_0(const float *x, block_q8_0 *y, int n);
float fm_vec_dot_q4_0_q8_0(int n, const block_q4_0 *w, const block_q8_0 *x);
float fm_vec_dot_q8_0_q8_0(int n, const block_q8_0 *w, const block_q8_0 *x);
void fm_matvec_q4_0(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int row_begin, int row_end);
void fm_matvec_q8_0(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int row_begin, int row_end);
void fm_matvec_f32(const float *W, const float *x, float *y, int cols, int row_begin, int row_end);
void fm_matvec_f16(const uint16_t *W, const float *x, float *y, int cols, int row_begin, int row_end);
void fm_matmul_q4_0(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int row_begin, int row_end);
void fm_matmul_q8_0(const block_q8_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int row_begin, int row_end);
void fm_matmul_f32(const float *W, const float *X, float *Y, int cols, int B, int ldy, int row_begin, int row_end);

int fm_init_dispatch(void);
int fm_best_isa(void);
int fm_isa_supported(int isa);
int fm_set_isa(int isa);
int fm_get_isa(void);
const char *fm_isa_name(int isa);
int fm_isa_from_name(const char *name);

uint64_t fm_read_sum(const void *buf, size_t nbytes);
float fm_fp16_to_fp32(uint16_t h);
uint16_t fm_fp32_to_fp16(float f);
"""

# The forward's headers are plain declarations: cffi reads them as they are (less the
# preprocessor lines), so the Python view of the structs can never drift from C.
FORWARD_HEADERS = ["model.h", "threadpool.h", "forward.h"]


def _header_cdef(name: str) -> str:
    lines = (HERE / name).read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


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
    builder.cdef(CDEF + "".join(_header_cdef(h) for h in FORWARD_HEADERS))
    builder.set_source(
        "native._fermoe_native",
        '#include "kernels.h"\n#include "forward.h"',
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
        shutil.copy(so, dest)
        print(dest)
