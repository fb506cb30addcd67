/* gdn_chunk.cu: the gated delta rule over a prompt in chunks of up to 64 tokens, in
 * the WY form whose spec is shared/reference.py's delta_rule_chunked (G, A, T, W, U,
 * Vn, O, P and S1 below are its names; tests/shared/test_reference.py holds it to the
 * token-by-token rule).
 *
 * Exponents are masked before they are taken, so every one is <= 0. Chunks are
 * rows [chunk_start[c], + chunk_len[c]) of this pass's tokens (the host cuts them
 * at 64 and at every snapshot boundary). Buffers, per chunk c and head h:
 * Gc [nc, hv, 64], W [nc, hv, dk, 64] (key-major), U and Vn [nc, hv, 64, dv], P [nc, hv, 64, 64],
 * S0 [nc, hv, dk, dv] (the state at each chunk's start: the snapshot at a boundary).
 * Layouts of q, k, v, beta, g, S as in gdn.cu; dk <= 128.
 *
 *   gdn_chunk_prep    G, A, T (forward substitution in shared memory), W, U, P
 *                     grid (nc, hv), block 256; shared: A/T [64][68], two slabs of 32
 *                     key (or value) dims: K and Q transposed [32][68] for K K^T and
 *                     Q K^T, then K or V as rows [64][33] for T K and T V
 *   gdn_chunk_state   the only sequential part: chunk after chunk, Vn and S1 from S0;
 *                     a block holds 16 value columns of a head's state (in registers,
 *                     8 entries a thread), W and K stream through shared memory in
 *                     double-buffered slabs (below). grid (hv, ceil(dv / 16)), block 256;
 *                     dk a multiple of 4, k 16-byte aligned
 *   gdn_chunk_output  O from S0, P, Vn: every chunk in parallel
 *                     grid (nc, hv, ceil(dv / 32)), block 256
 *
 * The products inside a chunk are register-blocked as the GEMM tiles are: thread (ty, tx)
 * = (tid / 32, tid % 32) holds the 8 rows 8 ty .. 8 ty + 7 of one or two output columns,
 * so a step over the inner dimension takes the rows' 8 values in two 16-byte loads (a
 * warp's threads read the same ones) and a column's value in one: 3 shared loads for 8
 * FMAs, where a thread an output took 2 for 1. Every output sums its terms in the order
 * of the inner dimension, as a thread an output did. */
#include "prelude.cuh"
#include "gdn.cuh"

#define FM_CHUNK 64
#define FM_SLAB 32
#define FM_CHUNK_THREADS 256

#define FM_ROW_LD (FM_SLAB + 1)  /* a slab of rows' row stride ([64][33]) */
#define FM_T_LD 68      /* a transposed slab's row stride ([32][64] in rows of 68: 16-byte aligned) */

/* rows [t0, t0 + n) of a [T, heads, width] tensor, columns [c0, c0 + 32) of head `head`, scaled by
 * scale[i] (or 1), into a slab: row i's column c at dst[i * ld_row + c * ld_col] ([64][33] as
 * rows: FM_ROW_LD, 1; transposed [32][68]: 1, FM_T_LD); the rest of the slab is 0. */
FM_DEVICE void fm_load_slab(float *dst, int ld_row, int ld_col, const float *src, long long row_stride,
                            int head_offset, int t0, int n, int c0, int width, const float *scale)
{
    for (int idx = threadIdx.x; idx < FM_CHUNK * FM_SLAB; idx += blockDim.x) {
        int i = idx / FM_SLAB, c = idx % FM_SLAB;
        float v = 0.0f;
        if (i < n && c0 + c < width) v = src[(long long)(t0 + i) * row_stride + head_offset + c0 + c];
        dst[i * ld_row + c * ld_col] = scale && i < n ? v * scale[i] : v;
    }
}

/* Entries 8 ty .. 8 ty + 7 of a row of a transposed slab (two 16-byte loads) */
FM_DEVICE void fm_rows8(float v[8], const float *row, int ty)
{
    fm_f4 a = *(const fm_f4 *)(row + 8 * ty), b = *(const fm_f4 *)(row + 8 * ty + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

FM_KERNEL void gdn_chunk_prep(float *W, float *U, float *Gc, float *P, const float *q, const float *k, const float *v,
                              const float *beta, const float *g, const int *chunk_start, const int *chunk_len, int hk,
                              int hv, int dk, int dv, int ldv, int tiled)
{
    __shared__ float Gs[FM_CHUNK], Bs[FM_CHUNK], Es[FM_CHUNK], tmp[FM_CHUNK];
    __shared__ FM_ALIGN16 float Am[FM_CHUNK][FM_T_LD];
    __shared__ FM_ALIGN16 float slab[2][FM_SLAB * FM_T_LD];  /* K and Q transposed; then K or V as rows [64][33] */
    __shared__ float Ts[FM_SLAB][FM_CHUNK + 1];     /* a W slab, key-major, on its way out */
    float(*Ks)[FM_ROW_LD] = (float(*)[FM_ROW_LD])slab[0];
    int ci = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, ty = tid / 32, tx = tid % 32;
    int t0 = chunk_start[ci], n = chunk_len[ci], kh = fm_key_head(h, hk, hv, tiled);
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

    /* K K^T and Q K^T over dk in slabs: rows i = 8 ty + a, columns j = tx + 32 b */
    float accA[8][2], accP[8][2];
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 2; b++) accA[a][b] = accP[a][b] = 0.0f;
    long long rs = (long long)hk * dk;
    for (int s0 = 0; s0 < dk; s0 += FM_SLAB) {
        fm_load_slab(slab[0], 1, FM_T_LD, k, rs, kh * dk, t0, n, s0, dk, 0);
        fm_load_slab(slab[1], 1, FM_T_LD, q, rs, kh * dk, t0, n, s0, dk, 0);
        __syncthreads();
        for (int c = 0; c < FM_SLAB; c++) {
            const float *kt = slab[0] + c * FM_T_LD;
            float ki[8], qi[8], kj[2] = {kt[tx], kt[tx + 32]};
            fm_rows8(ki, kt, ty);
            fm_rows8(qi, slab[1] + c * FM_T_LD, ty);
            for (int a = 0; a < 8; a++)
                for (int b = 0; b < 2; b++) {
                    accA[a][b] = fm_fma(ki[a], kj[b], accA[a][b]);
                    accP[a][b] = fm_fma(qi[a], kj[b], accP[a][b]);
                }
        }
        __syncthreads();
    }
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 2; b++) {
            int i = 8 * ty + a, j = tx + 32 * b;
            bool in = i < n && j < n;
            Am[i][j] = in && j < i ? Bs[i] * accA[a][b] * fm_expf(Gs[i] - Gs[j]) : 0.0f;
            P[ch * FM_CHUNK * FM_CHUNK + i * FM_CHUNK + j] = in && j <= i ? accP[a][b] * fm_expf(Gs[i] - Gs[j]) : 0.0f;
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

    /* W = T (beta e^G K), U = T (beta V), 32 columns at a time: rows i = 8 ty + a of column
     * tx, the sum over m <= i (T is lower triangular) four m at a time (a row's four T
     * values in one 16-byte load). U [64][dv] is written as computed; W is stored
     * key-major, [dk][64] (the state pass reads it in slabs of key dims), through
     * Ts [32][65], so that a warp writes 32 consecutive rows of one key dim. */
    for (int pass = 0; pass < 2; pass++) {
        int width = pass == 0 ? dk : dv;
        for (int s0 = 0; s0 < width; s0 += FM_SLAB) {
            if (pass == 0) fm_load_slab(slab[0], FM_ROW_LD, 1, k, rs, kh * dk, t0, n, s0, dk, Es);
            else fm_load_slab(slab[0], FM_ROW_LD, 1, v, ldv, h * dv, t0, n, s0, dv, Bs);
            __syncthreads();
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int m0 = 0; m0 < 8 * ty + 8; m0 += 4) {
                float x[4] = {Ks[m0][tx], Ks[m0 + 1][tx], Ks[m0 + 2][tx], Ks[m0 + 3][tx]};
                for (int a = 0; a < 8; a++) {
                    int i = 8 * ty + a;
                    fm_f4 t = *(const fm_f4 *)&Am[i][m0];
                    float tm[4] = {t.x, t.y, t.z, t.w};
                    for (int e = 0; e < 4; e++)
                        if (m0 + e <= i) acc[a] = fm_fma(tm[e], x[e], acc[a]);
                }
            }
            for (int a = 0; a < 8; a++) {
                int i = 8 * ty + a;
                if (pass == 0) Ts[tx][i] = acc[a];
                else if (s0 + tx < width) U[(ch * FM_CHUNK + i) * dv + s0 + tx] = acc[a];
            }
            __syncthreads();
            if (pass == 0) {
                for (int idx = tid; idx < FM_CHUNK * FM_SLAB; idx += FM_CHUNK_THREADS) {
                    int c = idx / FM_CHUNK, i = idx % FM_CHUNK;
                    if (s0 + c < width) W[(ch * dk + s0 + c) * FM_CHUNK + i] = Ts[c][i];
                }
                __syncthreads();        /* Ts and Ks are written again by the next slab */
            }
        }
    }
}


/* ---- the state pass ----
 *
 * Block (h, value columns [c0, c0 + 16)) carries those columns of head h's state
 * through the chunks. Thread t owns column c = t % 16 and the group g = t / 16:
 *
 *   Vn = U - W S0        its outputs are rows 4g .. 4g + 3 (64 x 16 outputs)
 *   S1 = e^G_n S0 + K^T (e^(G_n - G) Vn)
 *                        its state entries are rows 8g .. 8g + 7 (dk <= 128), kept in
 *                        registers from chunk to chunk; a copy in shared memory (Ss)
 *                        is what the next chunk's W S0 reads
 *
 * W (stored key-major by gdn_chunk_prep: [dk][64] a chunk) and the chunk's keys do not
 * depend on the state, so they stream through shared memory in slabs of 2,048 floats
 * (W: 32 key dims x 64 rows; K: 16 tokens x 128 key dims), double-buffered: slab s + 1
 * is loaded into registers while slab s is multiplied, then stored to the other
 * buffer; one __syncthreads a slab, and the chain of chunks never waits for a global
 * load. A chunk is ceil(dk / 32) W slabs then 4 K slabs; the last K slab prefetches the
 * next chunk's first W slab. The decay scale e^(G_n - G_i) goes on Vn (Vs), not on K,
 * so K's rows are read as they are (16-byte loads: dk a multiple of 4). */
#define FM_STATE_COLS 16     /* value columns of a head's state a block of the state pass holds */
#define FM_SLAB_FLOATS 2048  /* a slab: 8 floats a thread */
#define FM_WS_LD 68          /* W slab [32][64] row stride (16-byte rows) */
#define FM_KS_LD 132         /* K slab [16][128] row stride */
#define FM_SS_LD 18          /* Ss [128][16]: 8 rows apart fall 16 banks apart (the stores of a warp) */
#define FM_VS_LD 20          /* Vs [64][16]: 4 rows apart fall 16 banks apart */

/* A slab into registers: W slab j (key dims 32 j ..) of chunk ch, or K slab j (tokens
 * 16 j .. of the chunk at row t0, n tokens). Past dk or n: zeros. */
FM_DEVICE void fm_state_fetch(fm_f4 r[2], bool is_w, int j, const float *Wc, const float *k, long long ks, int koff,
                              int t0, int n, int dk)
{
    for (int e = 0; e < 2; e++) {
        int f = 4 * ((int)threadIdx.x + FM_CHUNK_THREADS * e);
        fm_f4 v = {0.0f, 0.0f, 0.0f, 0.0f};
        if (is_w) {
            int kk = 32 * j + f / FM_CHUNK;                      /* key dim; f % 64: the chunk row */
            if (kk < dk) v = *(const fm_f4 *)(Wc + (long long)kk * FM_CHUNK + f % FM_CHUNK);
        } else {
            int i = 16 * j + f / 128, d = f % 128;               /* token of the chunk, key dim */
            if (i < n && d < dk) v = *(const fm_f4 *)(k + (long long)(t0 + i) * ks + koff + d);
        }
        r[e] = v;
    }
}

FM_DEVICE void fm_state_store(float *buf, const fm_f4 r[2], bool is_w)
{
    for (int e = 0; e < 2; e++) {
        int f = 4 * ((int)threadIdx.x + FM_CHUNK_THREADS * e);
        float *dst = is_w ? buf + (f / FM_CHUNK) * FM_WS_LD + f % FM_CHUNK : buf + (f / 128) * FM_KS_LD + f % 128;
        *(fm_f4 *)dst = r[e];
    }
}

FM_KERNEL FM_BOUNDS(FM_CHUNK_THREADS, 2) void gdn_chunk_state(float *S, float *S0, float *Vn, const float *W,
                                                              const float *U, const float *Gc, const float *k,
                                                              const int *chunk_start, const int *chunk_len, int nc,
                                                              int hk, int hv, int dk, int dv, int tiled)
{
    __shared__ FM_ALIGN16 float buf[2][FM_SLAB_FLOATS + 128];      /* a W slab [32][68] or a K slab [16][132] */
    __shared__ float Ss[FM_GDN_MAX_DK][FM_SS_LD];
    __shared__ float Vs[FM_CHUNK][FM_VS_LD];
    int h = blockIdx.x, c0 = blockIdx.y * FM_STATE_COLS, kh = fm_key_head(h, hk, hv, tiled);
    int c = threadIdx.x % FM_STATE_COLS, g = threadIdx.x / FM_STATE_COLS;
    bool has_col = c0 + c < dv;
    int nw = (dk + 31) / 32;                                       /* W slabs a chunk */
    long long ks = (long long)hk * dk;
    int koff = kh * dk;
    float *Sh = S + (long long)h * dk * dv + c0 + c;
    float st[8];                                                   /* S rows 8g .. 8g + 7, column c */
    for (int m = 0; m < 8; m++) {
        int r = 8 * g + m;
        st[m] = r < dk && has_col ? Sh[(long long)r * dv] : 0.0f;
        Ss[r][c] = st[m];
    }
    fm_f4 pre[2];
    fm_state_fetch(pre, true, 0, W + (long long)h * dk * FM_CHUNK, k, ks, koff, 0, 0, dk);
    fm_state_store(buf[0], pre, true);
    __syncthreads();
    int b = 0;
    for (int ci = 0; ci < nc; ci++) {
        long long ch = (long long)ci * hv + h;
        int t0 = chunk_start[ci], n = chunk_len[ci];
        const float *Wc = W + ch * dk * FM_CHUNK;
        float G[4], u[4], acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        float G_n = Gc[ch * FM_CHUNK + (n > 0 ? n - 1 : 0)];
        for (int x = 0; x < 4; x++) {                              /* used after the W slabs: their latency hides */
            int i = 4 * g + x;
            G[x] = Gc[ch * FM_CHUNK + i];
            u[x] = i < n && has_col ? U[(ch * FM_CHUNK + i) * dv + c0 + c] : 0.0f;
        }
        if (has_col)
            for (int m = 0; m < 8; m++)
                if (8 * g + m < dk) S0[(ch * dk + 8 * g + m) * dv + c0 + c] = st[m];

        /* Vn = U - W S0 over the W slabs */
        for (int j = 0; j < nw; j++) {
            bool next_w = j + 1 < nw;
            fm_state_fetch(pre, next_w, next_w ? j + 1 : 0, Wc, k, ks, koff, t0, n, dk);
            const float *Ws = buf[b];
#pragma unroll 8
            for (int kk = 0; kk < 32; kk++) {
                fm_f4 w = *(const fm_f4 *)(Ws + kk * FM_WS_LD + 4 * g);
                float s = Ss[32 * j + kk][c];
                acc[0] = fm_fma(w.x, s, acc[0]);
                acc[1] = fm_fma(w.y, s, acc[1]);
                acc[2] = fm_fma(w.z, s, acc[2]);
                acc[3] = fm_fma(w.w, s, acc[3]);
            }
            if (!next_w) {                                         /* Vn done: out, and scaled for the update */
                for (int x = 0; x < 4; x++) {
                    int i = 4 * g + x;
                    float vn = i < n && has_col ? u[x] - acc[x] : 0.0f;
                    if (has_col) Vn[(ch * FM_CHUNK + i) * dv + c0 + c] = vn;
                    Vs[i][c] = i < n ? vn * fm_expf(G_n - G[x]) : 0.0f;
                }
            }
            fm_state_store(buf[b ^ 1], pre, next_w);
            __syncthreads();
            b ^= 1;
        }

        /* S1 = e^G_n S0 + K^T Vs over the K slabs (16 tokens each) */
        float decay = fm_expf(G_n);
        for (int m = 0; m < 8; m++) st[m] *= decay;
        for (int j = 0; j < 4; j++) {
            bool last = j == 3;
            if (!last) {
                fm_state_fetch(pre, false, j + 1, Wc, k, ks, koff, t0, n, dk);
            } else if (ci + 1 < nc) {
                fm_state_fetch(pre, true, 0, W + (ch + hv) * dk * FM_CHUNK, k, ks, koff, 0, 0, dk);
            }
            const float *Ks = buf[b];
#pragma unroll 4
            for (int ii = 0; ii < 16; ii++) {
                fm_f4 ka = *(const fm_f4 *)(Ks + ii * FM_KS_LD + 8 * g);
                fm_f4 kb = *(const fm_f4 *)(Ks + ii * FM_KS_LD + 8 * g + 4);
                float v = Vs[16 * j + ii][c];
                st[0] = fm_fma(ka.x, v, st[0]);
                st[1] = fm_fma(ka.y, v, st[1]);
                st[2] = fm_fma(ka.z, v, st[2]);
                st[3] = fm_fma(ka.w, v, st[3]);
                st[4] = fm_fma(kb.x, v, st[4]);
                st[5] = fm_fma(kb.y, v, st[5]);
                st[6] = fm_fma(kb.z, v, st[6]);
                st[7] = fm_fma(kb.w, v, st[7]);
            }
            if (last)                                              /* the next chunk's W S0 reads it */
                for (int m = 0; m < 8; m++) Ss[8 * g + m][c] = st[m];
            if (!last || ci + 1 < nc) fm_state_store(buf[b ^ 1], pre, last);     /* last: a W slab */
            __syncthreads();
            b ^= 1;
        }
    }
    if (has_col)
        for (int m = 0; m < 8; m++)
            if (8 * g + m < dk) Sh[(long long)(8 * g + m) * dv] = st[m];
}

FM_KERNEL void gdn_chunk_output(float *O, const float *q, const float *S0, const float *Vn, const float *P,
                                const float *Gc, const int *chunk_start, const int *chunk_len, int hk, int hv, int dk,
                                int dv, int tiled)
{
    __shared__ FM_ALIGN16 float Qt[FM_SLAB * FM_T_LD];     /* a Q slab transposed: Qt[r][i] = q_i[r0 + r] */
    __shared__ FM_ALIGN16 float Pt[FM_CHUNK * FM_T_LD];    /* P transposed: Pt[j][i] = P[i][j] */
    __shared__ float Ss[FM_SLAB][FM_SLAB + 1], Vs[FM_CHUNK][FM_SLAB + 1];
    int ci = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * FM_SLAB, tid = threadIdx.x, ty = tid / 32, tx = tid % 32;
    int t0 = chunk_start[ci], n = chunk_len[ci], kh = fm_key_head(h, hk, hv, tiled);
    long long ch = (long long)ci * hv + h;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  /* rows 8 ty + a, column tx */
    for (int r0 = 0; r0 < dk; r0 += FM_SLAB) {            /* Q S0 */
        fm_load_slab(Qt, 1, FM_T_LD, q, (long long)hk * dk, kh * dk, t0, n, r0, dk, 0);
        for (int idx = tid; idx < FM_SLAB * FM_SLAB; idx += blockDim.x) {
            int r = idx / FM_SLAB, c = idx % FM_SLAB;
            Ss[r][c] = r0 + r < dk && c0 + c < dv ? S0[(ch * dk + r0 + r) * dv + c0 + c] : 0.0f;
        }
        __syncthreads();
        for (int r = 0; r < FM_SLAB; r++) {
            float qi[8], s = Ss[r][tx];
            fm_rows8(qi, Qt + r * FM_T_LD, ty);
            for (int a = 0; a < 8; a++) acc[a] = fm_fma(qi[a], s, acc[a]);
        }
        __syncthreads();
    }
    for (int idx = tid; idx < FM_CHUNK * FM_CHUNK; idx += blockDim.x)
        Pt[(idx % FM_CHUNK) * FM_T_LD + idx / FM_CHUNK] = P[ch * FM_CHUNK * FM_CHUNK + idx];
    for (int idx = tid; idx < FM_CHUNK * FM_SLAB; idx += blockDim.x) {
        int i = idx / FM_SLAB, c = idx % FM_SLAB;
        Vs[i][c] = c0 + c < dv ? Vn[(ch * FM_CHUNK + i) * dv + c0 + c] : 0.0f;
    }
    __syncthreads();
    float out[8];                                          /* e^G (Q S0) + P Vn, j <= i */
    for (int a = 0; a < 8; a++) out[a] = acc[a] * fm_expf(Gc[ch * FM_CHUNK + 8 * ty + a]);
    for (int j = 0; j < 8 * ty + 8; j++) {
        float pj[8], x = Vs[j][tx];
        fm_rows8(pj, Pt + j * FM_T_LD, ty);
        for (int a = 0; a < 8; a++)
            if (j <= 8 * ty + a) out[a] = fm_fma(pj[a], x, out[a]);
    }
    for (int a = 0; a < 8; a++) {
        int i = 8 * ty + a;
        if (i < n && c0 + tx < dv) O[((long long)(t0 + i) * hv + h) * dv + c0 + tx] = out[a];
    }
}

