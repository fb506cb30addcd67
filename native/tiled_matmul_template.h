/* tiled_matmul_template.h: the tiled batched product of the x86 ISAs (Q4_0 and Q8_0
 * weights), a template: an x86 kernel file includes it once per weight type, after
 * defining
 *   FM_TARGET      (for the whole file) its target attribute, e.g. FM_AVX2
 *   FM_GB          (for the whole file) blocks a group: 4 with 128-bit vectors, 8
 *                  with 256-bit, 16 with 512-bit
 *   TILED_NAME     the function it defines: static, fm_matmul_*'s signature
 *   TILED_W        the weight block: block_q4_0 or block_q8_0
 *   TILED_WT       one row's group of FM_GB weight blocks, unpacked
 *   TILED_XT       one token's group of FM_GB activation blocks, prepared
 *   TILED_KC       groups a k-chunk
 *   TILED_RB       rows a kernel call takes (the register block), with 2 tokens
 *   TILED_PREP(x, ng, g)        prepares ng groups of one token's activations
 *   TILED_UNPACK(w, wt)         unpacks one group of a row's weights
 *   TILED_KERNEL(w, wstride, x, xstride, nk, Y, ldy, acc_out, R, T)
 *                  R rows (wstride groups apart) x T tokens (xstride groups apart)
 *                  over nk groups into Y (added to it when acc_out); R, T constant
 *   TILED_DOT(n, w, x)          the per-block dot product, for the tail blocks
 *   TILED_MATVEC(W, x, y, cols, r0, r1)    the one-token product
 * and undefines the TILED_ names at its end.
 *
 * The product is a small GEMM in a "transposed" block layout: a group of FM_GB
 * blocks becomes 8 vectors, vector m holding 4 consecutive bytes of each of the
 * blocks, one block per 32-bit lane. Weights and activations are laid out alike,
 * so one vpmaddubsw/vpdpbusd multiplies 4 elements of every block at once and the
 * products of all 8 vectors land in the same lanes: they are summed there (int16
 * or int32) before one conversion and one scaling per group, instead of one
 * reduction per block. The B activations are prepared once per call (into
 * per-thread scratch); a tile of rows x up to TILED_KC groups of weights is
 * unpacked once (on the stack, FM_TILE_BYTES) and multiplied by every token,
 * TILED_RB rows x 2 tokens at a time (then 2 and 1 row, 1 token), so each loaded
 * vector feeds several products. Blocks past the last whole group go through
 * TILED_DOT; B = 1 goes to TILED_MATVEC.
 */

#define TILED_ROWS FM_CAT(TILED_NAME, _rows)

_Static_assert((TILED_RB) * (TILED_KC) * sizeof(TILED_WT) <= FM_TILE_BYTES, "a tile must hold TILED_RB rows");

/* Rows [0, nr) of a tile of nk groups by T tokens: TILED_RB rows a call, then 2, then 1. */
FM_INLINE FM_TARGET void TILED_ROWS(const TILED_WT *tile, int nk, const TILED_XT *xb, int ng, float *yb, int ldy,
                                    int acc_out, int nr, const int T)
{
    int i = 0;
    for (; i + (TILED_RB) <= nr; i += (TILED_RB))
        TILED_KERNEL(tile + i * nk, nk, xb, ng, nk, yb + i, ldy, acc_out, (TILED_RB), T);
    if ((TILED_RB) > 2 && i + 2 <= nr) {
        TILED_KERNEL(tile + i * nk, nk, xb, ng, nk, yb + i, ldy, acc_out, 2, T);
        i += 2;
    }
    if (i < nr) TILED_KERNEL(tile + i * nk, nk, xb, ng, nk, yb + i, ldy, acc_out, 1, T);
}

static FM_TARGET void TILED_NAME(const TILED_W *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0,
                                 int r1)
{
    const int nb = cols / FM_QK, ng = nb / FM_GB, nt = nb - FM_GB * ng;
    if (r0 >= r1 || B <= 0) return;
    if (B == 1) {  /* one token: the matrix-vector product is faster (no unpacking) */
        TILED_MATVEC(W, X, Y, cols, r0, r1);
        return;
    }
    TILED_XT *g = ng ? (TILED_XT *)fm_kernel_scratch((size_t)B * ng * sizeof(TILED_XT)) : NULL;
    if (!g) {  /* under one group, or out of memory: the per-block path is still right */
        for (int r = r0; r < r1; r++)
            for (int b = 0; b < B; b++)
                Y[(size_t)b * ldy + r] = TILED_DOT(cols, W + (size_t)r * nb, X + (size_t)b * nb);
        return;
    }
    for (int b = 0; b < B; b++) TILED_PREP(X + (size_t)b * nb, ng, g + (size_t)b * ng);
    const int kc = ng < (TILED_KC) ? ng : (TILED_KC);
    int rt_rows = (int)(FM_TILE_BYTES / (kc * sizeof(TILED_WT))) / (TILED_RB) * (TILED_RB);
    if (rt_rows > 64) rt_rows = 64;
    _Alignas(64) TILED_WT tile[FM_TILE_BYTES / sizeof(TILED_WT)];
    for (int rt = r0; rt < r1; rt += rt_rows) {
        const int nr = r1 - rt < rt_rows ? r1 - rt : rt_rows;
        for (int k0 = 0; k0 < ng; k0 += kc) {
            const int nk = ng - k0 < kc ? ng - k0 : kc;
            for (int i = 0; i < nr; i++) {
                const TILED_W *w = W + (size_t)(rt + i) * nb + FM_GB * k0;
                for (int k = 0; k < nk; k++) {
                    for (size_t o = 0; o < FM_GB * sizeof(TILED_W); o += 192)  /* 3 lines a call */
                        fm_prefetch((const char *)(w + FM_GB * k) + o);
                    TILED_UNPACK(w + FM_GB * k, &tile[i * nk + k]);
                }
            }
            for (int b = 0; b < B; b += 2) {
                const TILED_XT *xb = g + (size_t)b * ng + k0;
                float *yb = Y + (size_t)b * ldy + rt;
                if (b + 1 < B) TILED_ROWS(tile, nk, xb, ng, yb, ldy, k0 > 0, nr, 2);
                else TILED_ROWS(tile, nk, xb, ng, yb, ldy, k0 > 0, nr, 1);
            }
        }
        for (int i = 0; nt && i < nr; i++)
            for (int b = 0; b < B; b++)
                Y[(size_t)b * ldy + rt + i] += TILED_DOT(nt * FM_QK, W + (size_t)(rt + i) * nb + FM_GB * ng,
                                                         X + (size_t)b * nb + FM_GB * ng);
    }
}

#undef TILED_ROWS
#undef TILED_NAME
#undef TILED_W
#undef TILED_WT
#undef TILED_XT
#undef TILED_KC
#undef TILED_RB
#undef TILED_PREP
#undef TILED_UNPACK
#undef TILED_KERNEL
#undef TILED_DOT
#undef TILED_MATVEC
