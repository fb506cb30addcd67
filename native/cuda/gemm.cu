/* gemm.cu: C = A W^T with W in its ggml type (dequantised in the tile), fp32 FMA.
 *
 *   A  [M, K] fp32, row stride lda (activations, one row a token)
 *   W  [N, K] in type WT, rows of fm_row_bytes(WT, K) bytes (one row an output)
 *   C  [M, N] fp32, row stride ldc
 *
 * One block computes a BM x BN tile of C with 256 threads (16 x 16), each thread a
 * TM x TN micro-tile of rows ty + 16 i and columns tx + 16 j, from registers. The
 * K loop takes one 32-element block at a time:
 *
 *   As [32][BM + 4]   A tile, transposed (k-major), so a thread's rows are a stride apart
 *   Ws [32][BN + 4]   W tile dequantised to fp32, k-major
 *
 * (BM=BN=64: 17 KB of shared memory.) Entry points, for each weight type T in
 * f32, f16, q4_0, q8_0:
 *
 *   gemm_T        C (+)= A W^T                 (accumulate != 0 adds: the residual)
 *   gemm_gated_T  C = silu(A Wg^T) * (A Wu^T)  (the shared expert's gate and up)
 *   moe_gateup_T  act[p] = silu(x Wg_e^T) * (x Wu_e^T) for the grouped rows p of
 *                 each expert e, x gathered by token (pair_token[p])
 *   moe_down_T    y[p] = act[p] Wd_e^T
 *
 * The MoE entries take the tile table moe.cu makes (a tile = an expert and up to
 * 64 of its grouped rows; blocks past *n_tiles exit at once) and find expert e's
 * matrices in its slot of a layer buffer: slot + slot_map[e] * expert_bytes, the
 * gate at offset 0, up at up_offset, down at down_offset.
 * grid: (ceil(N / BN), ceil(M / BM)) dense, (ceil(N / BN), max tiles) MoE. */
#include "prelude.cuh"
#include "weights.cuh"

#define FM_BK 32
#define FM_GEMM_THREADS 256

/* A rows [m0, m0 + rows) (through rows_map when given), columns [k0, k0 + 32). */
template <int BM>
FM_DEVICE void fm_load_a(float (*As)[BM + 4], const float *A, int lda, const int *rows_map, int m0, int rows,
                         int k0, int K)
{
    int c = (threadIdx.x & 7) * 4;
    for (int m = threadIdx.x >> 3; m < BM; m += FM_GEMM_THREADS / 8) {
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (m < rows) {
            int src = rows_map ? rows_map[m0 + m] : m0 + m;
            const float *a = A + (long long)src * lda + k0 + c;
            for (int j = 0; j < 4; j++)
                if (k0 + c + j < K) v[j] = a[j];
        }
        for (int j = 0; j < 4; j++) As[c + j][m] = v[j];
    }
}

/* W rows [n0, n0 + BN), block kb, dequantised: thread t loads quarter t & 3 of rows t >> 2 (+ 64 i). */
template <int WT, int BN>
FM_DEVICE void fm_load_w(float (*Ws)[BN + 4], const uint8_t *W, long long row_bytes, int n0, int N, int kb, int K)
{
    int q = threadIdx.x & 3;
    for (int r = threadIdx.x >> 2; r < BN; r += FM_GEMM_THREADS / 4) {
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (n0 + r < N) fm_quarter<WT>(W + (long long)(n0 + r) * row_bytes, kb, q, K, v);
        for (int i = 0; i < 8; i++) Ws[fm_quarter_k<WT>(q, i)][r] = v[i];
    }
}

template <int TM, int TN, int BM, int BN>
FM_DEVICE void fm_mma(float acc[TM][TN], float (*As)[BM + 4], float (*Ws)[BN + 4])
{
    int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    for (int k = 0; k < FM_BK; k++) {
        float a[TM], b[TN];
        for (int i = 0; i < TM; i++) a[i] = As[k][ty + 16 * i];
        for (int j = 0; j < TN; j++) b[j] = Ws[k][tx + 16 * j];
        for (int i = 0; i < TM; i++)
            for (int j = 0; j < TN; j++) acc[i][j] = fm_fma(a[i], b[j], acc[i][j]);
    }
}

/* One BM x BN tile of rows [m0, m0 + rows) of A (or its gathered rows) against W
 * (and Wu when GATED). The result rows go to C rows c0 + m. */
template <int WT, int BM, int BN, bool GATED>
FM_DEVICE void fm_gemm_tile(float *C, int ldc, int c0, int accumulate, const float *A, int lda, const int *rows_map,
                            int m0, int rows, const uint8_t *W, const uint8_t *Wu, int n0, int N, int K)
{
    const int TM = BM / 16, TN = BN / 16;
    __shared__ float As[FM_BK][BM + 4];
    __shared__ float Ws[FM_BK][BN + 4];
    __shared__ float Us[GATED ? FM_BK : 1][GATED ? BN + 4 : 1];
    float acc[TM][TN], accu[GATED ? TM : 1][GATED ? TN : 1];
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;
    if constexpr (GATED)
        for (int i = 0; i < TM; i++)
            for (int j = 0; j < TN; j++) accu[i][j] = 0.0f;
    long long row_bytes = fm_row_bytes(WT, K);
    for (int kb = 0; kb * FM_BK < K; kb++) {
        fm_load_a<BM>(As, A, lda, rows_map, m0, rows, kb * FM_BK, K);
        fm_load_w<WT, BN>(Ws, W, row_bytes, n0, N, kb, K);
        if constexpr (GATED) fm_load_w<WT, BN>(Us, Wu, row_bytes, n0, N, kb, K);
        __syncthreads();
        fm_mma<TM, TN, BM, BN>(acc, As, Ws);
        if constexpr (GATED) fm_mma<TM, TN, BM, BN>(accu, As, Us);
        __syncthreads();
    }
    int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    for (int i = 0; i < TM; i++) {
        int m = ty + 16 * i;
        if (m >= rows) continue;
        float *c = C + (long long)(c0 + m) * ldc;
        for (int j = 0; j < TN; j++) {
            int n = n0 + tx + 16 * j;
            if (n >= N) continue;
            float v = acc[i][j];
            if constexpr (GATED) v = fm_siluf(v) * accu[i][j];
            c[n] = accumulate ? c[n] + v : v;
        }
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
                            int accumulate)                                                                        \
    {                                                                                                              \
        int m0 = blockIdx.y * 64;                                                                                  \
        fm_gemm_tile<WT, 64, 64, false>(C, ldc, m0, accumulate, A, lda, 0, m0, fm_mini(64, M - m0), W, 0,              \
                                        blockIdx.x * 64, N, K);                                                    \
    }                                                                                                              \
    FM_KERNEL void gemm_gated_##T(float *C, const float *A, const uint8_t *Wg, const uint8_t *Wu, int M, int N,    \
                                  int K, int lda, int ldc)                                                         \
    {                                                                                                              \
        int m0 = blockIdx.y * 64;                                                                                  \
        fm_gemm_tile<WT, 64, 64, true>(C, ldc, m0, 0, A, lda, 0, m0, fm_mini(64, M - m0), Wg, Wu, blockIdx.x * 64, N,  \
                                       K);                                                                         \
    }                                                                                                              \
    FM_KERNEL void moe_gateup_##T(float *act, const float *x, const uint8_t *slot, const int *slot_map,            \
                                  long long expert_bytes, long long up_offset, const int *tile_expert,             \
                                  const int *tile_row0, const int *tile_rows, const int *n_tiles,                  \
                                  const int *pair_token, int N, int K, int lda)                                    \
    {                                                                                                              \
        int e, row0, rows;                                                                                         \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                    \
        const uint8_t *w = slot + slot_map[e] * expert_bytes;                                                      \
        fm_gemm_tile<WT, 64, 64, true>(act, N, row0, 0, x, lda, pair_token, row0, rows, w, w + up_offset,          \
                                       blockIdx.x * 64, N, K);                                                     \
    }                                                                                                              \
    FM_KERNEL void moe_down_##T(float *y, const float *act, const uint8_t *slot, const int *slot_map,              \
                                long long expert_bytes, long long down_offset, const int *tile_expert,             \
                                const int *tile_row0, const int *tile_rows, const int *n_tiles, int N, int K)      \
    {                                                                                                              \
        int e, row0, rows;                                                                                         \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                    \
        const uint8_t *w = slot + slot_map[e] * expert_bytes + down_offset;                                        \
        fm_gemm_tile<WT, 64, 64, false>(y, N, row0, 0, act, K, 0, row0, rows, w, 0, blockIdx.x * 64, N, K);        \
    }

FM_GEMM_ENTRIES(f32, FM_W_F32)
FM_GEMM_ENTRIES(f16, FM_W_F16)
FM_GEMM_ENTRIES(q4_0, FM_W_Q4_0)
FM_GEMM_ENTRIES(q8_0, FM_W_Q8_0)
