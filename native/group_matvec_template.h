/* group_matvec_template.h: the Q4_0 products straight from the GGUF layout of the
 * x86 ISAs, a template: the matrix-vector product (one token) and the few-token
 * one (2 to FM_FEW_TOKENS tokens). An x86 kernel file includes it once, after
 * defining
 *   FM_TARGET, FM_GB    (for the whole file) as for tiled_matmul_template.h
 *   GROUP_MATVEC_NAME   the matrix-vector product it defines (fm_matvec_q4_0_*)
 *   GROUP_FEW_NAME      the few-token product it defines (fm_matmul_q4_0_*'s signature)
 *   GROUP_XG            one token's group of FM_GB activation blocks, prepared
 *   GROUP_KC            groups a k-chunk: the tiled product's, so that a row sums
 *                       in the same pieces in every product
 *   GROUP_PREP(x, ng, g)                 prepares ng groups of one token
 *   GROUP_ROW(w, g, ng) -> float         one row over ng <= GROUP_KC groups
 *   GROUP_ROW_TOKENS(w, g, gs, ng, T, s) the same for T tokens into s[T] (g: T rows
 *                       of gs groups), each rounding as GROUP_ROW rounds it
 *   GROUP_DOT(n, w, x)                   the per-block dot product, for the tails
 * and undefines the GROUP_ names at its end.
 *
 * The activations are prepared CHUNK_BLOCKS at a time; each row is summed by
 * GROUP_ROW over at most GROUP_KC groups at a time, those sums added in order, then
 * the tail blocks by GROUP_DOT: every row rounds exactly as in the tiled product,
 * so a prompt gives the same bits whole, chunked or token by token (serving relies
 * on it). The few-token product runs the same loop with each weight group unpacked
 * once and multiplied by every token's activations (a decode round of a few
 * sequences; an expert's gate and up for its ~4 tokens of a 64-token prompt), where
 * unpacking into the tiled layout would be a large share of the time. 40 KB of
 * stack.
 */

#define GROUP_CHUNK (CHUNK_BLOCKS / FM_GB)  /* groups prepared a pass */

_Static_assert(GROUP_CHUNK % (GROUP_KC) == 0, "an activation chunk holds whole k-chunks");

static FM_TARGET void GROUP_MATVEC_NAME(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / FM_GB;
    GROUP_XG g[GROUP_CHUNK];
    for (int k0 = 0; k0 < ng; k0 += GROUP_CHUNK) {
        const int nk = ng - k0 < GROUP_CHUNK ? ng - k0 : GROUP_CHUNK;
        GROUP_PREP(x + FM_GB * k0, nk, g);
        for (int r = r0; r < r1; r++) {
            const block_q4_0 *w = W + (size_t)r * nb + FM_GB * k0;
            float v = k0 ? y[r] : 0.0f;
            for (int k = 0; k < nk; k += (GROUP_KC)) {
                const float s = GROUP_ROW(w + FM_GB * k, g + k, nk - k < (GROUP_KC) ? nk - k : (GROUP_KC));
                v = k0 + k ? v + s : s;
            }
            y[r] = v;
        }
    }
    matvec_tail_q4_0(GROUP_DOT, W, x, y, cols, FM_GB, r0, r1);
}

static FM_TARGET void GROUP_FEW_NAME(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy,
                                     int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / FM_GB, nt = nb - FM_GB * ng;
    GROUP_XG g[FM_FEW_TOKENS * GROUP_CHUNK];
    for (int k0 = 0; k0 < ng; k0 += GROUP_CHUNK) {
        const int nk = ng - k0 < GROUP_CHUNK ? ng - k0 : GROUP_CHUNK;
        for (int b = 0; b < B; b++) GROUP_PREP(X + (size_t)b * nb + FM_GB * k0, nk, g + b * GROUP_CHUNK);
        for (int r = r0; r < r1; r++) {
            const block_q4_0 *w = W + (size_t)r * nb + FM_GB * k0;
            for (int k = 0; k < nk; k += (GROUP_KC)) {
                const int n = nk - k < (GROUP_KC) ? nk - k : (GROUP_KC);
                float s[FM_FEW_TOKENS];
                switch (B) {
                case 2: GROUP_ROW_TOKENS(w + FM_GB * k, g + k, GROUP_CHUNK, n, 2, s); break;
                case 3: GROUP_ROW_TOKENS(w + FM_GB * k, g + k, GROUP_CHUNK, n, 3, s); break;
                default: GROUP_ROW_TOKENS(w + FM_GB * k, g + k, GROUP_CHUNK, n, 4, s); break;
                }
                for (int b = 0; b < B; b++) {
                    float *yb = Y + (size_t)b * ldy + r;
                    *yb = k0 + k ? *yb + s[b] : s[b];
                }
            }
        }
    }
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++) {
            float *yb = Y + (size_t)b * ldy + r;
            if (!ng) *yb = 0.0f;
            if (nt) *yb += GROUP_DOT(nt * FM_QK, W + (size_t)r * nb + FM_GB * ng, X + (size_t)b * nb + FM_GB * ng);
        }
}

#undef GROUP_CHUNK
#undef GROUP_MATVEC_NAME
#undef GROUP_FEW_NAME
#undef GROUP_XG
#undef GROUP_KC
#undef GROUP_PREP
#undef GROUP_ROW
#undef GROUP_ROW_TOKENS
#undef GROUP_DOT
