/* gdn_chunk.cu: the gated delta rule over a prompt in chunks of up to 64 tokens
 * (the WY form of the delta rule). Per value head h and chunk of n tokens
 * (local index i), with S0 the state entering the chunk:
 *
 *   G_i  = sum_{s<=i} g_s                       cumulative log decay (<= 0)
 *   A_ij = beta_i (k_i . k_j) e^(G_i - G_j)     i > j, else 0
 *   T    = (I + A)^-1                           unit lower triangular
 *   W    = T diag(beta e^G) K,   U = T diag(beta) V
 *   Vn   = U - W S0
 *   O    = diag(e^G) Q S0 + P Vn,               P_ij = (q_i . k_j) e^(G_i - G_j), i >= j
 *   S1   = e^(G_n) S0 + (diag(e^(G_n - G)) K)^T Vn
 *
 * Exponents are masked before they are taken, so every one is <= 0. Chunks are
 * rows [chunk_start[c], + chunk_len[c]) of this pass's tokens (the host cuts them
 * at 64 and at every snapshot boundary). Buffers, per chunk c and head h:
 * Gc [nc, hv, 64], W [nc, hv, 64, dk], U and Vn [nc, hv, 64, dv], P [nc, hv, 64, 64],
 * S0 [nc, hv, dk, dv] (the state at each chunk's start: the snapshot at a boundary).
 * Layouts of q, k, v, beta, g, S as in gdn.cu; dk <= 128.
 *
 *   gdn_chunk_prep    G, A, T (forward substitution in shared memory), W, U, P
 *                     grid (nc, hv), block 256; shared: A/T [64][65], K and Q slabs
 *                     [64][33] (dk in slabs of 32)
 *   gdn_chunk_state   the only sequential part: chunk after chunk, Vn and S1 from S0;
 *                     a block holds 16 value columns of a head's state in shared
 *                     memory [dk][17] (many small blocks: the chain of chunks is
 *                     short work a step). grid (hv, ceil(dv / 16)), block 256
 *   gdn_chunk_output  O from S0, P, Vn: every chunk in parallel
 *                     grid (nc, hv, ceil(dv / 32)), block 256 */
#include "prelude.cuh"

#define FM_CHUNK 64
#define FM_GDN_MAX_DK 128
#define FM_SLAB 32
#define FM_CHUNK_THREADS 256

FM_DEVICE int fm_chunk_key_head(int h, int hk, int hv, int tiled) { return tiled ? h % hk : h / (hv / hk); }

/* rows [t0, t0 + n) of a [T, heads, width] tensor, columns [c0, c0 + 32) of head `head`, scaled by
 * scale[i] (or 1), into dst [64][33]; the rest of the slab is 0. */
FM_DEVICE void fm_load_slab(float (*dst)[FM_SLAB + 1], const float *src, long long row_stride, int head_offset,
                            int t0, int n, int c0, int width, const float *scale)
{
    for (int idx = threadIdx.x; idx < FM_CHUNK * FM_SLAB; idx += blockDim.x) {
        int i = idx / FM_SLAB, c = idx % FM_SLAB;
        float v = 0.0f;
        if (i < n && c0 + c < width) v = src[(long long)(t0 + i) * row_stride + head_offset + c0 + c];
        dst[i][c] = scale && i < n ? v * scale[i] : v;
    }
}

FM_KERNEL void gdn_chunk_prep(float *W, float *U, float *Gc, float *P, const float *q, const float *k, const float *v,
                              const float *beta, const float *g, const int *chunk_start, const int *chunk_len, int hk,
                              int hv, int dk, int dv, int ldv, int tiled)
{
    __shared__ float Gs[FM_CHUNK], Bs[FM_CHUNK], Es[FM_CHUNK], tmp[FM_CHUNK];
    __shared__ float Am[FM_CHUNK][FM_CHUNK + 1];
    __shared__ float Ks[FM_CHUNK][FM_SLAB + 1], Qs[FM_CHUNK][FM_SLAB + 1];
    int ci = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int t0 = chunk_start[ci], n = chunk_len[ci], kh = fm_chunk_key_head(h, hk, hv, tiled);
    long long ch = (long long)ci * hv + h;
    if (tid == 0) {
        float G = 0.0f;
        for (int i = 0; i < FM_CHUNK; i++) {
            if (i < n) G += g[(long long)(t0 + i) * hv + h];
            Gs[i] = G;
        }
    }
    if (tid < FM_CHUNK) Bs[tid] = tid < n ? beta[(long long)(t0 + tid) * hv + h] : 0.0f;
    __syncthreads();
    if (tid < FM_CHUNK) {
        Es[tid] = Bs[tid] * fm_expf(Gs[tid]);           /* beta e^G: W's row scale */
        Gc[ch * FM_CHUNK + tid] = Gs[tid];
    }

    /* K K^T and Q K^T over dk in slabs: thread tid owns pairs (i, j) = (idx / 64, idx % 64), idx = tid + 256 u */
    float accA[16], accP[16];
    for (int u = 0; u < 16; u++) accA[u] = accP[u] = 0.0f;
    long long rs = (long long)hk * dk;
    for (int s0 = 0; s0 < dk; s0 += FM_SLAB) {
        fm_load_slab(Ks, k, rs, kh * dk, t0, n, s0, dk, 0);
        fm_load_slab(Qs, q, rs, kh * dk, t0, n, s0, dk, 0);
        __syncthreads();
        for (int u = 0; u < 16; u++) {
            int idx = tid + FM_CHUNK_THREADS * u, i = idx / FM_CHUNK, j = idx % FM_CHUNK;
            for (int c = 0; c < FM_SLAB; c++) {
                accA[u] = fm_fma(Ks[i][c], Ks[j][c], accA[u]);
                accP[u] = fm_fma(Qs[i][c], Ks[j][c], accP[u]);
            }
        }
        __syncthreads();
    }
    for (int u = 0; u < 16; u++) {
        int idx = tid + FM_CHUNK_THREADS * u, i = idx / FM_CHUNK, j = idx % FM_CHUNK;
        bool in = i < n && j < n;
        Am[i][j] = in && j < i ? Bs[i] * accA[u] * fm_expf(Gs[i] - Gs[j]) : 0.0f;
        P[ch * FM_CHUNK * FM_CHUNK + idx] = in && j <= i ? accP[u] * fm_expf(Gs[i] - Gs[j]) : 0.0f;
    }
    __syncthreads();

    /* T = (I + A)^-1 in place, row by row: T_ij = -sum_{m=j}^{i-1} A_im T_mj (j < i), T_ii = 1 */
    if (tid == 0) Am[0][0] = n > 0 ? 1.0f : 0.0f;
    __syncthreads();
    for (int i = 1; i < FM_CHUNK; i++) {
        if (tid < i) {
            float acc = 0.0f;
            for (int m = tid; m < i; m++) acc = fm_fma(Am[i][m], Am[m][tid], acc);
            tmp[tid] = i < n ? -acc : 0.0f;
        }
        __syncthreads();
        if (tid < i) Am[i][tid] = tmp[tid];
        if (tid == 0) Am[i][i] = i < n ? 1.0f : 0.0f;
        __syncthreads();
    }

    /* W = T (beta e^G K), U = T (beta V), 32 columns at a time: thread owns (i, c) = (idx / 32, idx % 32) */
    for (int pass = 0; pass < 2; pass++) {
        int width = pass == 0 ? dk : dv;
        float *dst = pass == 0 ? W : U;
        for (int s0 = 0; s0 < width; s0 += FM_SLAB) {
            if (pass == 0) fm_load_slab(Ks, k, rs, kh * dk, t0, n, s0, dk, Es);
            else fm_load_slab(Ks, v, ldv, h * dv, t0, n, s0, dv, Bs);
            __syncthreads();
            for (int u = 0; u < FM_CHUNK * FM_SLAB / FM_CHUNK_THREADS; u++) {
                int idx = tid + FM_CHUNK_THREADS * u, i = idx / FM_SLAB, c = idx % FM_SLAB;
                float acc = 0.0f;
                for (int m = 0; m <= i; m++) acc = fm_fma(Am[i][m], Ks[m][c], acc);
                if (s0 + c < width) dst[(ch * FM_CHUNK + i) * width + s0 + c] = acc;
            }
            __syncthreads();
        }
    }
}

#define FM_STATE_COLS 16     /* value columns of a head's state a block of the state pass holds */

FM_KERNEL void gdn_chunk_state(float *S, float *S0, float *Vn, const float *W, const float *U, const float *Gc,
                               const float *k, const int *chunk_start, const int *chunk_len, int nc, int hk, int hv,
                               int dk, int dv, int tiled)
{
    const int C = FM_STATE_COLS, ROWS = FM_CHUNK_THREADS / C;   /* a thread: column tid % C, rows tid / C + ROWS u */
    __shared__ float Ss[FM_GDN_MAX_DK][FM_STATE_COLS + 1];
    __shared__ float Vs[FM_CHUNK][FM_STATE_COLS + 1], Ks[FM_CHUNK][FM_SLAB + 1];
    __shared__ float scale[FM_CHUNK];
    int h = blockIdx.x, c0 = blockIdx.y * C, tid = threadIdx.x, kh = fm_chunk_key_head(h, hk, hv, tiled);
    int col = tid % C, row = tid / C;
    bool has_col = c0 + col < dv;
    float *Sh = S + (long long)h * dk * dv;
    for (int r = row; r < dk; r += ROWS) Ss[r][col] = has_col ? Sh[(long long)r * dv + c0 + col] : 0.0f;
    __syncthreads();
    for (int ci = 0; ci < nc; ci++) {
        long long ch = (long long)ci * hv + h;
        int t0 = chunk_start[ci], n = chunk_len[ci];
        if (has_col)
            for (int r = row; r < dk; r += ROWS) S0[(ch * dk + r) * dv + c0 + col] = Ss[r][col];
        /* Vn = U - W S0, W in slabs of 32 key dims through shared memory: thread owns
         * the outputs (i, c) = (idx / C, idx % C), idx = tid + 256 u */
        const int per = FM_CHUNK * C / FM_CHUNK_THREADS;
        float acc[per];
        for (int u = 0; u < per; u++) acc[u] = 0.0f;
        for (int r0 = 0; r0 < dk; r0 += FM_SLAB) {
            fm_load_slab(Ks, W + ch * FM_CHUNK * dk, dk, 0, 0, FM_CHUNK, r0, dk, 0);
            __syncthreads();
            for (int u = 0; u < per; u++) {
                int idx = tid + FM_CHUNK_THREADS * u, i = idx / C, c = idx % C;
                for (int r = 0; r < FM_SLAB; r++) acc[u] = fm_fma(Ks[i][r], Ss[r0 + r][c], acc[u]);
            }
            __syncthreads();
        }
        for (int u = 0; u < per; u++) {
            int idx = tid + FM_CHUNK_THREADS * u, i = idx / C, c = idx % C;
            float vn = i < n && c0 + c < dv ? U[(ch * FM_CHUNK + i) * dv + c0 + c] - acc[u] : 0.0f;
            Vs[i][c] = vn;
            if (c0 + c < dv) Vn[(ch * FM_CHUNK + i) * dv + c0 + c] = vn;
        }
        float G_n = Gc[ch * FM_CHUNK + (n > 0 ? n - 1 : 0)];
        if (tid < FM_CHUNK) scale[tid] = tid < n ? fm_expf(G_n - Gc[ch * FM_CHUNK + tid]) : 0.0f;
        __syncthreads();
        /* S1 = e^G_n S0 + (e^(G_n - G) K)^T Vn, the key dims in slabs of 32 */
        float decay = fm_expf(G_n);
        for (int r0 = 0; r0 < dk; r0 += FM_SLAB) {
            fm_load_slab(Ks, k, (long long)hk * dk, kh * dk, t0, n, r0, dk, scale);
            __syncthreads();
            for (int r = r0 + row; r < r0 + FM_SLAB && r < dk; r += ROWS) {
                float a = Ss[r][col] * decay;
                for (int i = 0; i < n; i++) a = fm_fma(Ks[i][r - r0], Vs[i][col], a);
                Ss[r][col] = a;
            }
            __syncthreads();
        }
    }
    if (has_col)
        for (int r = row; r < dk; r += ROWS) Sh[(long long)r * dv + c0 + col] = Ss[r][col];
}

FM_KERNEL void gdn_chunk_output(float *O, const float *q, const float *S0, const float *Vn, const float *P,
                                const float *Gc, const int *chunk_start, const int *chunk_len, int hk, int hv, int dk,
                                int dv, int tiled)
{
    __shared__ float Qs[FM_CHUNK][FM_SLAB + 1], Ss[FM_SLAB][FM_SLAB + 1];
    __shared__ float Ps[FM_CHUNK][FM_CHUNK + 1], Vs[FM_CHUNK][FM_SLAB + 1];
    int ci = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * FM_SLAB, tid = threadIdx.x;
    int t0 = chunk_start[ci], n = chunk_len[ci], kh = fm_chunk_key_head(h, hk, hv, tiled);
    long long ch = (long long)ci * hv + h;
    const int per = FM_CHUNK * FM_SLAB / FM_CHUNK_THREADS;
    float acc[per];
    for (int u = 0; u < per; u++) acc[u] = 0.0f;
    for (int r0 = 0; r0 < dk; r0 += FM_SLAB) {            /* Q S0 */
        fm_load_slab(Qs, q, (long long)hk * dk, kh * dk, t0, n, r0, dk, 0);
        for (int idx = tid; idx < FM_SLAB * FM_SLAB; idx += blockDim.x) {
            int r = idx / FM_SLAB, c = idx % FM_SLAB;
            Ss[r][c] = r0 + r < dk && c0 + c < dv ? S0[(ch * dk + r0 + r) * dv + c0 + c] : 0.0f;
        }
        __syncthreads();
        for (int u = 0; u < per; u++) {
            int idx = tid + FM_CHUNK_THREADS * u, i = idx / FM_SLAB, c = idx % FM_SLAB;
            for (int r = 0; r < FM_SLAB; r++) acc[u] = fm_fma(Qs[i][r], Ss[r][c], acc[u]);
        }
        __syncthreads();
    }
    for (int idx = tid; idx < FM_CHUNK * FM_CHUNK; idx += blockDim.x)
        Ps[idx / FM_CHUNK][idx % FM_CHUNK] = P[ch * FM_CHUNK * FM_CHUNK + idx];
    for (int idx = tid; idx < FM_CHUNK * FM_SLAB; idx += blockDim.x) {
        int i = idx / FM_SLAB, c = idx % FM_SLAB;
        Vs[i][c] = c0 + c < dv ? Vn[(ch * FM_CHUNK + i) * dv + c0 + c] : 0.0f;
    }
    __syncthreads();
    for (int u = 0; u < per; u++) {                       /* e^G (Q S0) + P Vn */
        int idx = tid + FM_CHUNK_THREADS * u, i = idx / FM_SLAB, c = idx % FM_SLAB;
        float out = acc[u] * fm_expf(Gc[ch * FM_CHUNK + i]);
        for (int j = 0; j <= i; j++) out = fm_fma(Ps[i][j], Vs[j][c], out);
        if (i < n && c0 + c < dv) O[((long long)(t0 + i) * hv + h) * dv + c0 + c] = out;
    }
}
