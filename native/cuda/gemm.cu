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
 * The tile kernel (fm_gemm_tile): one block of 256 threads computes a BM x BN tile
 * of C, BM x BN = 32, 64 or 128 x 128 or 64 x 256. Every thread holds TM x 8 outputs
 * in registers; the threads form a TY x TX grid (TX = BN / 8) and a warp is 4 x 8 of
 * them, so a k step's shared loads of a warp touch 4 thread rows' A values (one
 * 128-bit load serves 8 threads) and 8 x 4 contiguous W columns twice (128
 * contiguous bytes: no bank conflict). Thread (ty, tx) has rows ty*TM .. + TM - 1
 * (a warp's rows are one run of 4 TM, so a warp past the tile's last row skips its
 * FMAs) and columns tx*4 + {0..3} and BN/2 + tx*4 + {0..3}.
 *
 * K goes in steps of 16 (half a Q4_0 / Q8_0 block), double-buffered:
 *
 *   As [2][16][BM + 4]   A tile, k-major
 *   Ws [2][16][BN + 4]   W tile dequantised to fp32, k-major
 *
 *   step s:  global loads of step s + 1 into registers (raw weight bytes)
 *            FMAs of step s from buffer s & 1
 *            registers -> buffer (s + 1) & 1, the weights dequantised on the way
 *            one __syncthreads
 *
 * so each weight of a tile is dequantised once, the loads' latency hides under the
 * FMAs, and one barrier a step suffices (the buffer written in step s was last read
 * in step s - 1, before that step's barrier). Within a step each k's shared loads are
 * issued before the previous k's FMAs (fm_mma: two sets of fragment registers), and a
 * tile's A rows (gathered or not) are looked up once, not every step. Shared memory:
 * 21 KB (32 x 128) to 42 KB (64 x 256). A's rows are read 16 bytes a thread (4 threads a row's 16 k)
 * when K and lda are multiples of 4 and the tile has 64 rows or more, else a float
 * a thread (16 threads a row); a W row's 16 k are fetched by 256 / BN threads
 * (fm_w_row), and Q4_0 / Q8_0 become floats by exponent bits, not conversions.
 *
 * Split K: a dense launch of Z = gridDim.z > 1 splits gives block z the K range
 * [z ksplit, (z + 1) ksplit) (ksplit a multiple of 32) and writes its partial sums
 * to C + z M ldc; gemm_splitk_sum adds the Z partials in order into the output, so
 * results do not depend on scheduling. Few output tiles (a short prompt, a narrow
 * W) then still occupy every SM.
 *
 * Entry points, for each weight type T in f32, f16, q4_0, q8_0 (gpu_worker/ops.py
 * picks the tile by shape):
 *
 *   gemm_mBM_T        C (+)= A W^T, tiles BM x 128, BM = 32, 64, 128
 *   gemm_splitk_sum   C (+)= the sum of Z partial products (type-free)
 *   gemm_narrow_T     the same for outputs of a few columns (the GDN's beta and alpha): a
 *                     block a 8 x 32 tile over K in steps of 256 (8 K blocks at once), so a
 *                     long prompt still spreads over every SM (no FM_SWIGLU)
 *   moe_gateup_mBM_T  act[p] = silu(x Wg_e^T) * (x Wu_e^T) for the grouped rows p of each
 *                     expert e, x gathered by token (pair_token[p]); tiles BM x 128 (64
 *                     gate and the matching 64 up columns), BM = 64 or 128; N = ff (GLU
 *                     below). The height goes with the rows an expert gets
 *                     (ops.moe_tile_rows). No 32-row tiles: they waste fewer rows but
 *                     dequantise each weight for half as many, and lose
 *                     (docs/measurements.md has the sweep)
 *   moe_down_mBM_T    y[p] = act[p] Wd_e^T, tiles 64 x 256 or 128 x 128
 *
 * The MoE entries take the tile table moe.cu makes (a tile = an expert and up to BM
 * of its grouped rows; blocks past *n_tiles exit at once) and find expert e's
 * matrices in its slot of a layer buffer: slot + slot_map[e] * expert_bytes, gate
 * and up at offset 0, down at down_offset. A tile's rows past the expert's last run
 * no FMAs (whole warps skip), so the padding of a tile costs loads, not arithmetic.
 * grid: (ceil(N / 128), ceil(M / BM), Z) dense, (ceil(M / 8), ceil(N / 32)) narrow,
 * (ceil(ff / (BN / 2)), max tiles) MoE gate|up, (ceil(N / BN), max tiles) MoE down. */
#include "prelude.cuh"
#include "weights.cuh"

#define FM_BK 16
#define FM_GEMM_THREADS 256

#define FM_ACCUMULATE 1
#define FM_SWIGLU 2

/* A 16-byte load of four 32-bit words (fp16 pairs, fp32 bits) */
typedef struct FM_ALIGN16 {
    unsigned x, y, z, w;
} fm_u4;

FM_DEVICE bool fm_aligned16(const void *p) { return ((unsigned long long)p & 15u) == 0; }

/* The shape of a BM x BN tile's thread grid */
template <int BM, int BN>
struct FmTile {
    enum {
        TX = BN / 8,                    /* threads across the columns, 8 outputs each */
        TY = FM_GEMM_THREADS / TX,      /* threads down the rows */
        TM = BM / TY,                   /* rows a thread */
        WX = TX / 8,                    /* warps across the columns (a warp: 4 x 8 threads) */
        TPR = FM_GEMM_THREADS / BN,     /* threads that fetch one W row's 16 k of a step */
        KW = FM_BK / TPR                /* ... k each */
    };
};

/* Thread (ty, tx) of the grid and the first row of its warp's 4 TM */
template <int BM, int BN>
FM_DEVICE int fm_ty() { return 4 * ((int)(threadIdx.x >> 5) / FmTile<BM, BN>::WX) + (int)((threadIdx.x & 31) >> 3); }
template <int BM, int BN>
FM_DEVICE int fm_tx() { return 8 * ((int)(threadIdx.x >> 5) % FmTile<BM, BN>::WX) + (int)(threadIdx.x & 7); }
template <int BM, int BN>
FM_DEVICE int fm_warp_row0() { return 4 * ((int)(threadIdx.x >> 5) / FmTile<BM, BN>::WX) * FmTile<BM, BN>::TM; }

/* ---- A: rows of activations (gathered, or their SwiGLU) ---- */

/* The rows of A that thread t's vec fetches read (tile rows (t + 256 e) / 4, below):
 * their indices in A, gathered or not, or -1 past the tile's rows; once a tile */
template <int BM>
FM_DEVICE void fm_a_rows(int vrow[], const int *rows_map, int m0, int rows)
{
    for (int e = 0; e < (BM + 63) / 64; e++) {
        int m = (int)(threadIdx.x + FM_GEMM_THREADS * e) >> 2;
        vrow[e] = m >= rows ? -1 : rows_map ? rows_map[m0 + m] : m0 + m;
    }
}

/* vec (BM a multiple of 64, rows 16-byte aligned): thread t fetches k = 4 (i % 4) ..
 * + 3 of tile row i / 4, i = t + 256 e, e < BM / 64 (its row in A: vrow[e]): a warp
 * reads 8 rows' 64 bytes. Otherwise k = t % 16 of the tile rows t / 16 + 16 e,
 * e < BM / 16. Past the tile's rows or kend: zeros. */
template <int BM>
FM_DEVICE void fm_fetch_a(float a[BM / 16], const float *A, int lda, const int *rows_map, const int vrow[], int m0,
                          int rows, int k0, int kend, int K, bool swiglu, bool vec)
{
    if (BM % 64 == 0 && vec) {
        for (int e = 0; e < BM / 64; e++) {
            int i = threadIdx.x + FM_GEMM_THREADS * e, k = k0 + 4 * (i & 3);
            fm_f4 v = {0.0f, 0.0f, 0.0f, 0.0f};
            if (vrow[e] >= 0 && k < kend) {
                const float *p = A + (long long)vrow[e] * lda + k;
                v = *(const fm_f4 *)p;
                if (swiglu) {
                    fm_f4 u = *(const fm_f4 *)(p + K);
                    v.x = fm_siluf(v.x) * u.x, v.y = fm_siluf(v.y) * u.y;
                    v.z = fm_siluf(v.z) * u.z, v.w = fm_siluf(v.w) * u.w;
                }
            }
            a[4 * e] = v.x, a[4 * e + 1] = v.y, a[4 * e + 2] = v.z, a[4 * e + 3] = v.w;
        }
        return;
    }
    int k = k0 + (threadIdx.x & 15);
    for (int e = 0; e < BM / 16; e++) {
        int m = (threadIdx.x >> 4) + 16 * e;
        a[e] = 0.0f;
        if (m < rows && k < kend) {
            int src = rows_map ? rows_map[m0 + m] : m0 + m;
            const float *p = A + (long long)src * lda + k;
            a[e] = swiglu ? fm_siluf(p[0]) * p[K] : p[0];
        }
    }
}

template <int BM>
FM_DEVICE void fm_store_a(float (*As)[BM + 4], const float a[BM / 16], bool vec)
{
    if (BM % 64 == 0 && vec) {
        for (int e = 0; e < BM / 64; e++) {
            int i = threadIdx.x + FM_GEMM_THREADS * e;
            for (int j = 0; j < 4; j++) As[4 * (i & 3) + j][i >> 2] = a[4 * e + j];
        }
        return;
    }
    for (int e = 0; e < BM / 16; e++) As[threadIdx.x & 15][(threadIdx.x >> 4) + 16 * e] = a[e];
}

/* ---- W: KW consecutive k of one row, raw, then dequantised ---- */

/* KW (8 or 16) consecutive k of one W row from k0, as raw bits: Q4_0 / Q8_0 the
 * block's scale and the KW (nibble-)bytes (r[0 .. KW / 4]), F16 KW halves, F32 KW
 * floats (16-byte loads where the row allows). A row past N or a k past kend reads
 * as zero (a zero scale). A Q4_0 block's second half is the high nibbles of the
 * bytes of its first: those registers are kept (the caller passes the same r,
 * fetched 16 k earlier). */
template <int WT, int KW>
FM_DEVICE void fm_fetch_w(unsigned r[KW], const uint8_t *row, int k0, int kend)
{
    if (WT == FM_W_Q4_0 && (k0 & 16)) return;      /* the high nibbles of the bytes fetched for k0 - 16 */
    for (int i = 0; i < KW; i++) r[i] = 0u;
    if (!row || k0 >= kend) return;
    if (WT == FM_W_Q4_0 || WT == FM_W_Q8_0) {
        int j0 = k0 % FM_QK;
        const uint16_t *b = (const uint16_t *)(row + (long long)(k0 / FM_QK) * (WT == FM_W_Q4_0 ? 18 : 34));
        int at = 1 + (WT == FM_W_Q4_0 ? (j0 & 15) : j0) / 2;    /* Q4_0: element j and j + 16 share byte j */
        r[0] = b[0];
        for (int q = 0; q < KW / 4; q++) r[1 + q] = b[at + 2 * q] | (unsigned)b[at + 2 * q + 1] << 16;
    } else if (WT == FM_W_F16) {
        const uint16_t *h = (const uint16_t *)row + k0;
        if (k0 + KW <= kend && fm_aligned16(h)) {
            for (int q = 0; q < KW / 8; q++) {
                fm_u4 v = ((const fm_u4 *)h)[q];
                unsigned w[4] = {v.x, v.y, v.z, v.w};
                for (int j = 0; j < 4; j++) r[8 * q + 2 * j] = w[j] & 0xffffu, r[8 * q + 2 * j + 1] = w[j] >> 16;
            }
        } else {
            for (int i = 0; i < KW; i++)
                if (k0 + i < kend) r[i] = h[i];
        }
    } else {
        const unsigned *f = (const unsigned *)row + k0;
        if (k0 + KW <= kend && fm_aligned16(f)) {
            for (int q = 0; q < KW / 4; q++) {
                fm_u4 v = ((const fm_u4 *)f)[q];
                r[4 * q] = v.x, r[4 * q + 1] = v.y, r[4 * q + 2] = v.z, r[4 * q + 3] = v.w;
            }
        } else {
            for (int i = 0; i < KW; i++)
                if (k0 + i < kend) r[i] = f[i];
        }
    }
}

FM_DEVICE float fm_bits_float(unsigned u)
{
    union { unsigned u; float f; } b;
    b.u = u;
    return b.f;
}

template <int WT, int KW>
FM_DEVICE void fm_decode_w(float v[KW], const unsigned r[KW], int k0)
{
    if (WT == FM_W_Q4_0 || WT == FM_W_Q8_0) {
        /* 2^23 + q as float bits, less 2^23 + 8 (Q4_0) or, the sign bit flipped, 2^23 + 128
         * (Q8_0): the exact integer without a conversion instruction */
        float d = fm_fp16_to_fp32((uint16_t)r[0]);
        bool high = (k0 % FM_QK) & 16;                       /* Q4_0: elements 16..31 are the high nibbles */
        for (int i = 0; i < KW; i++) {
            unsigned word = r[1 + i / 4];
            if (WT == FM_W_Q4_0) {
                unsigned q = ((high ? word >> 4 : word) >> (8 * (i % 4))) & 15u;
                v[i] = (fm_bits_float(0x4B000000u | q) - 8388616.0f) * d;
            } else {
                unsigned q = ((word >> (8 * (i % 4))) & 0xffu) ^ 0x80u;
                v[i] = (fm_bits_float(0x4B000000u | q) - 8388736.0f) * d;
            }
        }
    } else if (WT == FM_W_F16) {
        for (int i = 0; i < KW; i++) v[i] = fm_fp16_to_fp32((uint16_t)r[i]);
    } else {
        for (int i = 0; i < KW; i++) v[i] = fm_bits_float(r[i]);
    }
}

/* The W row of the tile thread t fetches, and its first k of the step: BN = 256, row t,
 * all 16; BN = 128, row t / 2, k 8 (t % 2) .. + 7 (a pair reads one block's 16 bytes). */
template <int BN>
FM_DEVICE int fm_w_row() { return BN == 256 ? (int)threadIdx.x : (int)(threadIdx.x >> 1); }
template <int BN>
FM_DEVICE int fm_w_k() { return BN == 256 ? 0 : 8 * (int)(threadIdx.x & 1); }

/* Shared column of tile column n in k row k: with two threads a row, the k rows 8..15
 * have column bit 4 flipped, so a warp's stores (16 rows x both halves) fall in 32
 * distinct banks; 4 consecutive columns stay contiguous for the 128-bit reads. */
template <int BN>
FM_DEVICE int fm_w_swz(int k) { return BN == 128 && k >= 8 ? 16 : 0; }

template <int WT, int BN, int KW>
FM_DEVICE void fm_store_w(float (*Ws)[BN + 4], const unsigned r[KW], int k0)
{
    int n = fm_w_row<BN>(), kw = fm_w_k<BN>();
    float v[KW];
    fm_decode_w<WT, KW>(v, r, k0 + kw);
    for (int i = 0; i < KW; i++) Ws[kw + i][n ^ fm_w_swz<BN>(kw + i)] = v[i];
}

/* ---- the tile ---- */

template <int BN>
FM_DEVICE int fm_col(int tx, int j) { return (j / 4) * (BN / 2) + tx * 4 + (j % 4); }

/* Thread (ty, tx)'s A values (its TM rows) and W values (its 8 columns) of k row k */
template <int BM, int BN>
FM_DEVICE void fm_frag(float a[], float b[8], float (*As)[BM + 4], float (*Ws)[BN + 4], int k, int ty, int tx)
{
    const int TM = FmTile<BM, BN>::TM;
    if (TM % 4 == 0) {
        for (int i = 0; i < TM; i += 4) {
            fm_f4 v = *(const fm_f4 *)&As[k][ty * TM + i];
            a[i] = v.x, a[i + 1] = v.y, a[i + 2] = v.z, a[i + 3] = v.w;
        }
    } else {
        for (int i = 0; i < TM; i++) a[i] = As[k][ty * TM + i];
    }
    for (int j = 0; j < 8; j += 4) {
        fm_f4 v = *(const fm_f4 *)&Ws[k][fm_col<BN>(tx, j) ^ fm_w_swz<BN>(k)];
        b[j] = v.x, b[j + 1] = v.y, b[j + 2] = v.z, b[j + 3] = v.w;
    }
}

/* A step's 16 k of FMAs, each k's shared loads issued before the previous k's FMAs
 * (two sets of fragment registers) so their latency hides under them */
template <int BM, int BN>
FM_DEVICE void fm_mma(float acc[][8], float (*As)[BM + 4], float (*Ws)[BN + 4], int ty, int tx)
{
    const int TM = FmTile<BM, BN>::TM;
    float a[2][TM], b[2][8];
    fm_frag<BM, BN>(a[0], b[0], As, Ws, 0, ty, tx);
#pragma unroll
    for (int k = 0; k < FM_BK; k++) {
        if (k + 1 < FM_BK) fm_frag<BM, BN>(a[(k + 1) & 1], b[(k + 1) & 1], As, Ws, k + 1, ty, tx);
        for (int i = 0; i < TM; i++)
            for (int j = 0; j < 8; j++) acc[i][j] = fm_fma(a[k & 1][i], b[k & 1][j], acc[i][j]);
    }
}

/* One BM x BN tile: rows [m0, m0 + rows) of A (or its gathered rows) against W
 * rows [n0, n0 + BN), k in [kbeg, kend). The result rows go to C rows c0 + m.
 *
 * GLU: W is [gate; up], N rows each, and the tile takes gate rows [n0, n0 + BN/2)
 * and the up rows N further as its columns 0 .. BN/2 - 1 and BN/2 .., so that a
 * thread holds gate column c and up column c together (fm_col: j and j + 4) and
 * writes silu(gate) * up to C column n0 + c: the SwiGLU in the epilogue, C [M, N]. */
template <int WT, int BM, int BN, bool GLU>
FM_DEVICE void fm_gemm_tile(float *C, int ldc, int c0, int flags, const float *A, int lda, const int *rows_map,
                            int m0, int rows, const uint8_t *W, int n0, int N, int K, int kbeg, int kend)
{
    typedef FmTile<BM, BN> G;
    const int TM = G::TM, KW = G::KW;
    __shared__ FM_ALIGN16 float As[2][FM_BK][BM + 4];
    __shared__ FM_ALIGN16 float Ws[2][FM_BK][BN + 4];
    float acc[TM][8];
    for (int i = 0; i < TM; i++)
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
    bool swiglu = flags & FM_SWIGLU;
    bool vec = ((lda | K) & 3) == 0 && fm_aligned16(A);
    int wn = fm_w_row<BN>(), nw = n0 + wn, valid = nw < N;
    if (GLU) {
        int c = wn % (BN / 2);
        valid = n0 + c < N;
        nw = n0 + c + (wn < BN / 2 ? 0 : N);
    }
    const uint8_t *wrow = valid ? W + (long long)nw * fm_row_bytes(WT, K) : 0;
    int kw = fm_w_k<BN>(), ty = fm_ty<BM, BN>(), tx = fm_tx<BM, BN>();
    bool busy = fm_warp_row0<BM, BN>() < rows;            /* this warp has rows of the tile */
    int steps = (kend - kbeg + FM_BK - 1) / FM_BK;
    float ra[BM / 16];
    unsigned rw[KW];
    int vrow[(BM + 63) / 64];
    fm_a_rows<BM>(vrow, rows_map, m0, rows);
    fm_fetch_a<BM>(ra, A, lda, rows_map, vrow, m0, rows, kbeg, kend, K, swiglu, vec);
    fm_fetch_w<WT, KW>(rw, wrow, kbeg + kw, kend);
    fm_store_a<BM>(As[0], ra, vec);
    fm_store_w<WT, BN, KW>(Ws[0], rw, kbeg);
    __syncthreads();
    for (int s = 0; s < steps; s++) {
        int next = kbeg + (s + 1) * FM_BK;
        if (s + 1 < steps) {              /* the next step's loads fly while this one multiplies */
            fm_fetch_a<BM>(ra, A, lda, rows_map, vrow, m0, rows, next, kend, K, swiglu, vec);
            fm_fetch_w<WT, KW>(rw, wrow, next + kw, kend);
        }
        if (busy) fm_mma<BM, BN>(acc, As[s & 1], Ws[s & 1], ty, tx);
        if (s + 1 < steps) {
            fm_store_a<BM>(As[(s + 1) & 1], ra, vec);
            fm_store_w<WT, BN, KW>(Ws[(s + 1) & 1], rw, next);
        }
        __syncthreads();
    }
    bool add = flags & FM_ACCUMULATE;
    for (int i = 0; i < TM; i++) {
        int m = ty * TM + i;
        if (m >= rows) break;
        float *c = C + (long long)(c0 + m) * ldc;
        if (GLU) {
            for (int j = 0; j < 4; j++) {
                int n = n0 + fm_col<BN>(tx, j);
                if (n < N) c[n] = fm_siluf(acc[i][j]) * acc[i][j + 4];
            }
        } else {
            for (int j = 0; j < 8; j++) {
                int n = n0 + fm_col<BN>(tx, j);
                if (n < N) c[n] = add ? c[n] + acc[i][j] : acc[i][j];
            }
        }
    }
}

FM_KERNEL void gemm_splitk_sum(float *C, const float *part, int M, int N, int ldc, int splits, int flags)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, mn = (long long)M * N;
    if (i >= mn) return;
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s += part[z * mn + i];
    float *c = C + (i / N) * ldc + i % N;
    *c = flags & FM_ACCUMULATE ? *c + s : s;
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

#define FM_GEMM_DENSE(T, WT, BM, BLOCKS)                                                                         \
    FM_KERNEL FM_BOUNDS(FM_GEMM_THREADS, BLOCKS) void gemm_m##BM##_##T(float *C, const float *A, const uint8_t *W,   \
                                                                       int M, int N, int K, int lda, int ldc,      \
                                                                       int flags, int ksplit)                      \
    {                                                                                                              \
        int m0 = blockIdx.y * BM, kbeg = blockIdx.z * ksplit;                                                      \
        fm_gemm_tile<WT, BM, 128, false>(C + (long long)blockIdx.z * M * ldc, ldc, m0, flags, A, lda, 0, m0,      \
                                         fm_mini(BM, M - m0), W, blockIdx.x * 128, N, K, kbeg,                     \
                                         fm_mini(K, kbeg + ksplit));                                               \
    }

#define FM_GEMM_GATEUP(T, WT, BM, BN, BLOCKS)                                                                    \
    FM_KERNEL FM_BOUNDS(FM_GEMM_THREADS, BLOCKS) void moe_gateup_m##BM##_##T(                                    \
        float *act, const float *x, const uint8_t *slot, const int *slot_map, long long expert_bytes,            \
        const int *tile_expert, const int *tile_row0, const int *tile_rows, const int *n_tiles,                  \
        const int *pair_token, int N, int K, int lda)                                                            \
    {                                                                                                            \
        int e, row0, rows;                                                                                       \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                  \
        const uint8_t *w = slot + slot_map[e] * expert_bytes;                                                    \
        fm_gemm_tile<WT, BM, BN, true>(act, N, row0, 0, x, lda, pair_token, row0, rows, w,                       \
                                       blockIdx.x * (BN / 2), N, K, 0, K);                                       \
    }

#define FM_GEMM_DOWN(T, WT, BM, BN, BLOCKS)                                                                      \
    FM_KERNEL FM_BOUNDS(FM_GEMM_THREADS, BLOCKS) void moe_down_m##BM##_##T(                                      \
        float *y, const float *act, const uint8_t *slot, const int *slot_map, long long expert_bytes,            \
        long long down_offset, const int *tile_expert, const int *tile_row0, const int *tile_rows,               \
        const int *n_tiles, int N, int K)                                                                        \
    {                                                                                                            \
        int e, row0, rows;                                                                                       \
        if (!fm_moe_tile(tile_expert, tile_row0, tile_rows, n_tiles, &e, &row0, &rows)) return;                  \
        const uint8_t *w = slot + slot_map[e] * expert_bytes + down_offset;                                      \
        fm_gemm_tile<WT, BM, BN, false>(y, N, row0, 0, act, K, 0, row0, rows, w, blockIdx.x * BN, N, K, 0, K);   \
    }

/* Blocks an SM is asked to hold (caps registers: 64 accumulators a thread need ~120, 32
 * ~80). The gate|up tile of 64 rows is 64 x 128 (32 accumulators, three blocks an SM):
 * its warps skip past an expert's rows in runs of 16 instead of 32, and its blocks, twice
 * as many, leave less of the last wave idle, which outweighs loading each A tile twice as
 * often; the down tile of 64 rows stays 64 x 256. */
#define FM_GEMM_ENTRIES(T, WT)                                                                                   \
    FM_GEMM_DENSE(T, WT, 32, 3)                                                                                  \
    FM_GEMM_DENSE(T, WT, 64, 3)                                                                                  \
    FM_GEMM_DENSE(T, WT, 128, 2)                                                                                 \
    FM_GEMM_GATEUP(T, WT, 64, 128, 3)                                                                            \
    FM_GEMM_GATEUP(T, WT, 128, 128, 2)                                                                           \
    FM_GEMM_DOWN(T, WT, 64, 256, 2)                                                                              \
    FM_GEMM_DOWN(T, WT, 128, 128, 2)                                                                             \
    FM_KERNEL void gemm_narrow_##T(float *C, const float *A, const uint8_t *W, int M, int N, int K, int lda,     \
                                   int ldc, int flags)                                                           \
    {                                                                                                            \
        fm_gemm_narrow<WT>(C, A, W, M, N, K, lda, ldc, flags);                                                   \
    }

FM_GEMM_ENTRIES(f32, FM_W_F32)
FM_GEMM_ENTRIES(f16, FM_W_F16)
FM_GEMM_ENTRIES(q4_0, FM_W_Q4_0)
FM_GEMM_ENTRIES(q8_0, FM_W_Q8_0)
