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
           "threadpool.c", "linear.c", "forward.c", "gdn.c", "attention.c", "moe.c"]
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
""" + """
/* threadpool.h */
typedef struct fm_pool fm_pool;
fm_pool *fm_pool_create(int n_threads, const int *cpus);
void fm_pool_destroy(fm_pool *pool);
int fm_pool_size(const fm_pool *pool);

/* model.h: keep in step with the C header */
typedef struct { const void *data; int32_t type; int32_t rows, cols; int64_t mat_stride; } fm_tensor;
typedef struct {
    int32_t is_attention;
    fm_tensor attn_norm, post_attention_norm;
    fm_tensor attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_conv1d, ssm_dt, ssm_a, ssm_norm, ssm_out;
    int32_t gdn_slot;
    fm_tensor attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm;
    int32_t attn_slot;
    fm_tensor ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps;
    fm_tensor ffn_gate_inp_shexp, ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp;
} fm_layer;
typedef struct {
    int32_t n_layer, n_embd, n_vocab;
    float rms_eps;
    int32_t n_head, n_head_kv, head_dim, rope_dim;
    float rope_theta;
    int32_t ssm_conv_kernel, ssm_k_heads, ssm_v_heads, ssm_head_k_dim, ssm_head_v_dim;
    int32_t v_heads_tiled;
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    fm_tensor token_embd, output_norm, output;
    fm_layer *layers;
} fm_model;
typedef struct {
    float *ssm; float *conv; float *const *k_pages; float *const *v_pages;
    int32_t max_pages, block; int64_t position;
} fm_seq;

/* forward.h */
typedef struct fm_ctx fm_ctx;
fm_ctx *fm_ctx_create(const fm_model *m, fm_pool *pool, int max_tokens);
void fm_ctx_destroy(fm_ctx *c);
int fm_forward(fm_ctx *c, fm_seq *seq, const int32_t *tokens, int T, float *logits, int all_logits);
"""

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
    builder.cdef(CDEF)
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
