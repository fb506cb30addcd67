/* gemm.cu: C = A W^T with W in its ggml type (dequantised in the tile), fp32 FMA.
 *
 *   A  [M, K] fp32, row stride lda (activations, one row a token)
 *   W  [N, K] in type WT, rows of fm_row_bytes(WT, K) bytes (one row an output)
 *   C  [M, N] fp32, row stride ldc
 *
 * flags: FM_ACCUMULATE adds to C (the residual); FM_SWIGLU reads A's rows as
 * [gate | up], K each, and multiplies silu(gate) * up (the SwiGLU of an FFN, fused
 * into the load of its down projection).
 *
 * One block computes a BM x BN tile of C with 256 threads (16 x 16), each thread a
 * TM x TN micro-tile from registers (rows and columns in groups of four, fm_row).
 * The K loop takes one 32-element block at a time, the next fetched meanwhile:
 *
 *   As [32][BM + 4]   A tile, transposed (k-major), so a thread's rows are a stride apart
 *   Ws [32][BN + 4]   W tile dequantised to fp32, k-major
 *
 * (BM=BN=64: 17 KB of shared memory; 128: 34 KB.) Entry points, for each weight type T in
 * f32, f16, q4_0, q8_0:
 *
 *   gemm_T        C (+)= A W^T in 64 x 64 tiles
 *   gemm_wide_T   the same in 128 x 128 tiles (8 x 8 a thread): long prompts, wide outputs
 *   gemm_narrow_T the same for outputs of a few columns (the GDN's beta and alpha): a
 *                 block a 8 x 32 tile over K in steps of 256 (8 K blocks at once), so a
 *                 long prompt still spreads over every SM (no FM_SWIGLU)
 *   moe_gateup_T  act[p] = x [Wg_e; Wu_e]^T (64 x 128 tiles) for the grouped rows p of
 *                 each expert e, x gathered by token (pair_token[p]): an expert's gate
 *                 and up rows are contiguous, so they are one matrix of N = 2 ff rows
 *   moe_down_T    y[p] = (silu(act_gate[p]) * act_up[p]) Wd_e^T
 *   moe_*_wide_T  the same with tiles of 128 of an expert's rows (many tokens an expert)
 *
 * The MoE entries take the tile table moe.cu makes (a tile = an expert and up to
 * 64 (wide: 128) of its grouped rows; blocks past *n_tiles exit at once) and find expert e's
 * matrices in its slot of a layer buffer: slot + slot_map[e] * expert_bytes, gate
 * and up at offset 0, down at down_offset.
 * grid: (ceil(N / BN), ceil(M / BM)) dense, (ceil(M / 8), ceil(N / 32)) narrow,
 * (ceil(N / 128), max tiles) MoE. */
#include "prelude.cuh"
#include "weights.cuh"

#define FM_BK 32
#define FM_GEMM_THREADS 256

/* The next K block of the A and W tiles is fetched into registers while the current
 * one is multiplied from shared memory (the global loads' latency hides under the
 * FMAs), then stored. A thread fetches rows (tid >> 3) + 32 i of A, four columns
 * each, and quarter tid & 3 of W rows (tid >> 2) + 64 i, dequantised. */
template <int BM, int BN>
struct fm_tile_regs {
    float a[BM / 32][4];
    float w[BN / 64][8];
};

#define FM_ACCUMULATE 1
#define FM_SWIGLU 2

template <int BM>
FM_DEVICE void fm_fetch_a(float a[BM / 32][4], const float *A, int lda, const int *rows_map, int m0, int rows, int k0,
                          int K, bool swiglu)
{
    int c = (threadIdx.x & 7) * 4;
    for (int i = 0; i < BM / 32; i++) {
        int m = (threadIdx.x >> 3) + 32 * i;
        for (int j = 0; j < 4; j++) a[i][j] = 0.0f;
        if (m < rows) {
            int src = rows_map ? rows_map[m0 + m] : m0 + m;
            const float *p = A + (long long)src * lda + k0 + c;
            for (int j = 0; j < 4; j++)
                if (k0 + c + j < K) a[i][j] = swiglu ? fm_siluf(p[j]) * p[K + j] : p[j];
        }
    }
}

template <int BM>
FM_DEVICE void fm_store_a(float (*As)[BM + 4], float a[BM / 32][4])
{
    int c = (threadIdx.x & 7) * 4;
    for (int i = 0; i < BM / 32; i++)
        for (int j = 0; j < 4; j++) As[c + j][(threadIdx.x >> 3) + 32 * i] = a[i][j];
}

template <int WT, int BN>
FM_DEVICE void fm_fetch_w(float w[BN / 64][8], const uint8_t *W, long long row_bytes, int n0, int N, int kb, int K)
{
    int q = threadIdx.x & 3;
    for (int i = 0; i < BN / 64; i++) {
        int r = (threadIdx.x >> 2) + 64 * i;
        for (int j = 0; j < 8; j++) w[i][j] = 0.0f;
        if (n0 + r < N) fm_quarter<WT>(W + (long long)(n0 + r) * row_bytes, kb, q, K, w[i]);
    }
}

template <int WT, int BN>
FM_DEVICE void fm_store_w(float (*Ws)[BN + 4], float w[BN / 64][8])
{
    int q = threadIdx.x & 3;
    for (int i = 0; i < BN / 64; i++)
        for (int j = 0; j < 8; j++) Ws[fm_quarter_k<WT>(q, j)][(threadIdx.x >> 2) + 64 * i] = w[i][j];
}

/* Thread (ty, tx) of the 16 x 16 owns rows fm_row(ty, i) and columns fm_row(tx, j):
 * groups of four, 64 apart, so a quarter warp's 128-bit shared loads of a k row are
 * 128 contiguous bytes (no bank conflict). */
FM_DEVICE int fm_row(int t, int i) { return (i / 4) * 64 + t * 4 + (i % 4); }

template <int TM, int TN, int BM, int BN>
FM_DEVICE void fm_mma(float acc[TM][TN], float (*As)[BM + 4], float (*Ws)[BN + 4])
{
    int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    for (int k = 0; k < FM_BK; k++) {
        float a[TM], b[TN];
        for (int i = 0; i < TM; i += 4) {
            fm_f4 v = *(const fm_f4 *)&As[k][fm_row(ty, i)];
            a[i] = v.x, a[i + 1] = v.y, a[i + 2] = v.z, a[i + 3] = v.w;
        }
        for (int j = 0; j < TN; j += 4) {
            fm_f4 v = *(const fm_f4 *)&Ws[k][fm_row(tx, j)];
            b[j] = v.x, b[j + 1] = v.y, b[j + 2] = v.z, b[j + 3] = v.w;
        }
        for (int i = 0; i < TM; i++)
            for (int j = 0; j < TN; j++) acc[i][j] = fm_fma(a[i], b[j], acc[i][j]);
    }
}

/* One BM x BN tile of rows [m0, m0 + rows) of A (or its gathered rows) against W.
 * The result rows go to C rows c0 + m. BM, BN: 64 or 128. */
template <int WT, int BM, int BN>
FM_DEVICE void fm_gemm_tile(float *C, int ldc, int c0, int flags, const float *A, int lda, const int *rows_map,
                            int m0, int rows, const uint8_t *W, int n0, int N, int K)
{
    const int TM = BM / 16, TN = BN / 16;
    __shared__ FM_ALIGN16 float As[FM_BK][BM + 4];
    __shared__ FM_ALIGN16 float Ws[FM_BK][BN + 4];
    float acc[TM][TN];
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
    bool swiglu = flags & FM_SWIGLU;
    long long row_bytes = fm_row_bytes(WT, K);
    int nkb = (K + FM_BK - 1) / FM_BK;
    float ra[BM / 32][4], rw[BN / 64][8];
    fm_fetch_a<BM>(ra, A, lda, rows_map, m0, rows, 0, K, swiglu);
    fm_fetch_w<WT, BN>(rw, W, row_bytes, n0, N, 0, K);
    for (int kb = 0; kb < nkb; kb++) {
        fm_store_a<BM>(As, ra);
        fm_store_w<WT, BN>(Ws, rw);
        __syncthreads();
        if (kb + 1 < nkb) {                  /* the next block's loads fly while this one multiplies */
            fm_fetch_a<BM>(ra, A, lda, rows_map, m0, rows, (kb + 1) * FM_BK, K, swiglu);
            fm_fetch_w<WT, BN>(rw, W, row_bytes, n0, N, kb + 1, K);
        }
        fm_mma<TM, TN, BM, BN>(acc, As, Ws);
        __syncthreads();
    }
    int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    for (int i = 0; i < TM; i++) {
        int m = fm_row(ty, i);
        if (m >= rows) continue;
        float *c = C + (long long)(c0 + m) * ldc;
        for (int j = 0; j < TN; j++) {
            int n = n0 + fm_row(tx, j);
            if (n < N) c[n] = flags & FM_ACCUMULATE ? c[n] + acc[i][j] : acc[i][j];
        }
    }
}

/* C[m0 .. m0 + 8, n0 .. n0 + 32) = A W^T for a narrow W: thread (r, c) = (tid / 32,
 * tid % 32) sums one output over K; each step stages 256 of K: W's 32 rows x 8
 * blocks dequantised (a block a thread) and A's 8 rows, in shared memory. */
#define FM_NARROW_K 256
template <int WT>
FM_DEVICE void fm_gemm_narrow(float *C, const float *A, const uint8_t *W, int M, int N, int K, int lda, int ldc,
                              int flags)
{
    __shared__ float Ws[FM_NARROW_K][33];
    __shared__ float As[8][FM_NARROW_K];
    int tid = threadIdx.x, r = tid / 32, c = tid % 32, m0 = blockIdx.x * 8, n0 = blockIdx.y * 32;
    long long row_bytes = fm_row_bytes(WT, K);
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += FM_NARROW_K) {
        int wc = tid % 32, wb = tid / 32;                      /* column wc, block k0 / 32 + wb */
        for (int q = 0; q < 4; q++) {
            float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (n0 + wc < N && k0 + wb * FM_QK < K)
                fm_quarter<WT>(W + (long long)(n0 + wc) * row_bytes, k0 / FM_QK + wb, q, K, v);
            for (int i = 0; i < 8; i++) Ws[wb * FM_QK + fm_quarter_k<WT>(q, i)][wc] = v[i];
        }
        for (int idx = tid; idx < 8 * FM_NARROW_K; idx += blockDim.x) {
            int rr = idx / FM_NARROW_K, k = idx % FM_NARROW_K;
            As[rr][k] = m0 + rr < M && k0 + k < K ? A[(long long)(m0 + rr) * lda + k0 + k] : 0.0f;
        }
        __syncthreads();
        for (int k = 0; k < FM_NARROW_K; k++) acc = fm_fma(As[r][k], Ws[k][c], acc);
        __syncthreads();
    }
    if (m0 + r < M && n0 + c < N) {
        float *out = C + (long long)(m0 + r) * ldc + n0 + c;
        *out = flags & FM_ACCUMULATE ? *out + acc : acc;
    }
}

/* The expert of MoE tile blockIdx.y and its rows; false past the last tile. */
FM_DEVICE bool fm_moe_tile(const int *tile_expert, const int *tile_row0, const int *tile_rows, const int *n_tiles,
                           int *expert, int *row0, int *rows)
{
    int tile = blockIdx.y;
    if (tile >= *n_tiles) return false;
    *expert = tile_expert[tile];
    *row0 = tile_row0[tile];
    *rows = tile_rows[tile];
    return true;
}

#define FM_GEMM_ENTRIES(T, WT)                                                                                     \
    FM_KERNEL void gemm_##T(float *C, const float *A, const uint8_t *W, int M, int N, int K, int lda, int ldc,     \
                            int flags)                                                                             \
    {                                                                                                              \
        int m0 = blockIdx.y * 64;                                                                                  \
        fm_gemm_tile<WT, 64, 64>(C, ldc, m0, flags, A, lda, 0, m0, fm_mini(64, M - m0), W, blockIdx.x * 64, N, K); \
    }                                                                                                              \
    FM_KERNEL FM_BOUNDS(256, 2) void gemm_wide_##T(float *C, const float *A, const uint8_t *W, int M, int N, int K, \
                                                   int lda, int ldc, int flags)                                    \
    {                                                                                                              \
        int m0 = blockIdx.y * 128;                                                                                 \
        fm_gemm_tile<WT, 128, 128>(C, ldc, m0, flags, A, lda, 0, m0, fm_mini(128, M - m0), W, blockIdx.x * 128, N, \
                                   K);                                                                             \
    }                                                                                                              \
    FM_KERNEL void gemm_narrow_##T(float *C, const float *A, const uint8_t *W, int M, int N, int K, int lda,       \
                                   int ldc, int flags)                                                             \
    {                                                                                                              \
        fm_gemm_narrow<WT>(C, A, W, M, N, K, lda, ldc, flags);                                                     \
    }                                                                                                              \
    FM_KERNEL void moe_gateup_##T(float *act, const float *x, const uint8_t *slot, const int *slot_map,            \
                                  long long expert_bytes, const int *tile_expert, const int *tile_row0,            \
                                  const int *tile_rows, const int *n_tiles, const int *pair_token, int N, int K,   \
                                  int lda)                                                                         \
    {                                                                                                              \
        int e, row0, rows;                                                                                         \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                    \
        const uint8_t *w = slot + slot_map[e] * expert_bytes;                                                      \
        fm_gemm_tile<WT, 64, 128>(act, N, row0, 0, x, lda, pair_token, row0, rows, w, blockIdx.x * 128, N, K);     \
    }                                                                                                              \
    FM_KERNEL void moe_down_##T(float *y, const float *act, const uint8_t *slot, const int *slot_map,              \
                                long long expert_bytes, long long down_offset, const int *tile_expert,             \
                                const int *tile_row0, const int *tile_rows, const int *n_tiles, int N, int K)      \
    {                                                                                                              \
        int e, row0, rows;                                                                                         \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                    \
        const uint8_t *w = slot + slot_map[e] * expert_bytes + down_offset;                                        \
        fm_gemm_tile<WT, 64, 128>(y, N, row0, FM_SWIGLU, act, 2 * K, 0, row0, rows, w, blockIdx.x * 128, N, K);    \
    }                                                                                                              \
    FM_KERNEL FM_BOUNDS(256, 2) void moe_gateup_wide_##T(float *act, const float *x, const uint8_t *slot,          \
                                                         const int *slot_map, long long expert_bytes,              \
                                                         const int *tile_expert, const int *tile_row0,             \
                                                         const int *tile_rows, const int *n_tiles,                 \
                                                         const int *pair_token, int N, int K, int lda)             \
    {                                                                                                              \
        int e, row0, rows;                                                                                         \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                    \
        const uint8_t *w = slot + slot_map[e] * expert_bytes;                                                      \
        fm_gemm_tile<WT, 128, 128>(act, N, row0, 0, x, lda, pair_token, row0, rows, w, blockIdx.x * 128, N, K);    \
    }                                                                                                              \
    FM_KERNEL FM_BOUNDS(256, 2) void moe_down_wide_##T(float *y, const float *act, const uint8_t *slot,            \
                                                       const int *slot_map, long long expert_bytes,                \
                                                       long long down_offset, const int *tile_expert,              \
                                                       const int *tile_row0, const int *tile_rows,                 \
                                                       const int *n_tiles, int N, int K)                           \
    {                                                                                                              \
        int e, row0, rows;                                                                                         \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                    \
        const uint8_t *w = slot + slot_map[e] * expert_bytes + down_offset;                                        \
        fm_gemm_tile<WT, 128, 128>(y, N, row0, FM_SWIGLU, act, 2 * K, 0, row0, rows, w, blockIdx.x * 128, N, K);   \
    }

FM_GEMM_ENTRIES(f32, FM_W_F32)
FM_GEMM_ENTRIES(f16, FM_W_F16)
FM_GEMM_ENTRIES(q4_0, FM_W_Q4_0)
FM_GEMM_ENTRIES(q8_0, FM_W_Q8_0)
