/* attention.cu: gated GQA attention over a prompt (Qwen3.5/3.6 full-attention layers).
 *
 *   attn_qk_norm_rope  per token t and head: q = rope(rmsnorm(q, q_norm)) from the
 *                      query half of qg [T, nh, 2 hd] ([query | gate] a head) into
 *                      q_out [T, nh, hd]; k = rope(rmsnorm(k, k_norm)) and v into the
 *                      cache rows start + t of Kc, Vc [positions, nkv, hd], rounded
 *                      through fp16 when kv_f16 (the state's KV dtype). RoPE is NeoX
 *                      style on the first rope_dim dims (pairs i, i + rope_dim / 2),
 *                      cos / sin [T, rope_dim / 2] from the host.
 *                      grid (T, nh + nkv), block 128.
 *   attn_prompt        out[t, h] = softmax(q_t K^T * scale, causal) V * sigmoid(gate_t,h)
 *                      for query rows t of head h against every cached key up to its
 *                      position start + t (KV head h / (nh / nkv)); gate is the second
 *                      half of qg's [query | gate]; q [T, nh, hd], out [T, nh hd]; hd a
 *                      multiple of 4 up to 256, q, Kc, Vc 16-byte aligned (ops.py checks).
 *                      A block takes 64 query rows of one head through the 64-key tiles up
 *                      to its last row's position, flash style (online softmax in fp32):
 *                        S = Q K^T         from 32-dim chunks of Q and K in shared memory,
 *                                          4 x 4 scores a thread (rows ty + 16 i, keys
 *                                          tx + 16 j of its 16 x 16 place)
 *                        P                 masked before any exp, scaled; the row max, exp
 *                                          and sums by four threads a row (16 keys each)
 *                        O = alpha O + P V V in 16-key chunks; a thread keeps rows 4 ty + i,
 *                                          dims 64 g + 4 tx + e of O in registers (hd = 256:
 *                                          64 accumulators)
 *                      shared (37 KB): one buffer for the Q | K chunks [64][36] each or a V
 *                      chunk [16][64 ceil(hd / 64)], P^T [64][68], the row partials. The
 *                      next chunk is fetched into registers while the current multiplies.
 *                      grid (nh, ceil(T / 64)), block 256; blockIdx.y = 0 is the last 64
 *                      rows (the most keys): the longest blocks start first. */
#include "prelude.cuh"
#include "reduce.cuh"
#include "../fermoe_blocks.h"

#define FM_ATTN_MAX_HD 256
#define FM_ATTN_THREADS 128

FM_DEVICE float fm_round_f16(float v) { return fm_fp16_to_fp32(fm_fp32_to_fp16(v)); }

FM_KERNEL void attn_qk_norm_rope(float *q_out, float *Kc, float *Vc, const float *qg, const float *k_in,
                                 const float *v_in, const float *q_norm, const float *k_norm, const float *cos_t,
                                 const float *sin_t, int start, int T, int nh, int nkv, int hd, int rope_dim,
                                 float eps, int kv_f16)
{
    __shared__ float scratch[FM_ATTN_THREADS];
    __shared__ float xs[FM_ATTN_MAX_HD];
    int t = blockIdx.x, h = blockIdx.y, j = h - nh;
    bool is_q = h < nh;
    const float *src = is_q ? qg + ((long long)t * nh + h) * 2 * hd : k_in + ((long long)t * nkv + j) * hd;
    const float *w = is_q ? q_norm : k_norm;
    float *dst = is_q ? q_out + ((long long)t * nh + h) * hd : Kc + ((long long)(start + t) * nkv + j) * hd;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ss = fm_fma(src[i], src[i], ss);
    float inv = 1.0f / fm_sqrtf(fm_block_sum(ss, scratch) / (float)hd + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) xs[i] = src[i] * inv * w[i];
    __syncthreads();
    int half = rope_dim / 2;
    const float *c = cos_t + (long long)t * half, *s = sin_t + (long long)t * half;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float v = xs[i];
        if (i < half) v = xs[i] * c[i] - xs[i + half] * s[i];
        else if (i < rope_dim) v = xs[i] * c[i - half] + xs[i - half] * s[i - half];
        dst[i] = !is_q && kv_f16 ? fm_round_f16(v) : v;
    }
    if (!is_q) {
        const float *vs = v_in + ((long long)t * nkv + j) * hd;
        float *vd = Vc + ((long long)(start + t) * nkv + j) * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) vd[i] = kv_f16 ? fm_round_f16(vs[i]) : vs[i];
    }
}

/* ---- attn_prompt: 64 query rows x 64-key tiles, register-blocked (see the header) ---- */
#define FM_AQ 64                  /* query rows a block */
#define FM_AK 64                  /* keys a tile */
#define FM_AD 32                  /* head dims a Q / K chunk */
#define FM_AV 16                  /* keys a V chunk */
#define FM_AQK_LD (FM_AD + 4)     /* 36: eight rows' f4 at one dim fall in eight distinct bank quads */
#define FM_AP_LD (FM_AQ + 4)
#define FM_A_THREADS 256

struct fm_attn_smem {
    FM_ALIGN16 float buf[2 * FM_AQ * FM_AQK_LD];   /* Q chunk [64][36] | K chunk [64][36], or V chunk [16][64 DG] */
    FM_ALIGN16 float P[FM_AK][FM_AP_LD];           /* scores, then probabilities, key-major: P[key][row] */
    float red[4][FM_AQ];                           /* a row's partials over the four key quarters */
    float alpha[FM_AQ];                            /* a row's rescale for the tile */
};
static_assert(2 * FM_AQ * FM_AQK_LD >= FM_AV * FM_ATTN_MAX_HD, "a V chunk fits the Q / K chunk buffer");

struct fm_attn_args {
    const float *q, *Kc, *Vc;
    int qrow[2];               /* offsets of the two query rows this thread fetches (-1 past the prompt) */
    int kv0, kstride;          /* the KV head's first key (and value) offset; keys nkv hd apart */
    int q0, rows, kend, nh, hd, h;   /* keys [0, kend) */
};

/* A warp is a 4 x 8 patch of the 16 x 16 thread grid: its f4 shared reads touch four
 * rows' and eight keys' (or dims') addresses, one 128-byte wavefront each. */
FM_DEVICE int fm_attn_ty(void) { return (threadIdx.x >> 6) * 4 + ((threadIdx.x >> 3) & 3); }
FM_DEVICE int fm_attn_tx(void) { return ((threadIdx.x >> 5) & 1) * 8 + (threadIdx.x & 7); }

/* Dims [d0, d0 + 32) of the block's queries and of keys [j0, j0 + 64), two f4 of each a
 * thread (eight threads a 128-byte row segment); zeros past the rows, keys and hd. */
FM_DEVICE void fm_attn_fetch_qk(fm_f4 st[4], const fm_attn_args &a, int j0, int d0)
{
    unsigned tid = threadIdx.x;
    int c = d0 + (int)(tid & 7) * 4;
    for (int s = 0; s < 2; s++) {
        int key = j0 + (int)(tid >> 3) + 32 * s;
        fm_f4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
        st[s] = st[2 + s] = zero;
        if (c < a.hd && a.qrow[s] >= 0) st[s] = *(const fm_f4 *)(a.q + (a.qrow[s] + c));
        if (c < a.hd && key < a.kend) st[2 + s] = *(const fm_f4 *)(a.Kc + (a.kv0 + key * a.kstride + c));
    }
}

FM_DEVICE void fm_attn_store_qk(float *buf, const fm_f4 st[4])
{
    unsigned off = (threadIdx.x >> 3) * FM_AQK_LD + (threadIdx.x & 7) * 4;
    for (int s = 0; s < 2; s++) {
        *(fm_f4 *)&buf[off + 32 * FM_AQK_LD * s] = st[s];
        *(fm_f4 *)&buf[off + (FM_AQ + 32 * s) * FM_AQK_LD] = st[2 + s];
    }
}

/* Values of keys [j, j + 16) as rows of 64 DG floats (zeros past hd and kend), f4 slot
 * idx = threadIdx.x + 256 s of the chunk: row idx / (16 DG), shared offset 4 idx. */
template <int DG>
FM_DEVICE void fm_attn_fetch_v(fm_f4 st[4], const fm_attn_args &a, int j)
{
    for (int s = 0; s < DG; s++) {
        unsigned idx = threadIdx.x + FM_A_THREADS * s;
        int key = j + (int)(idx / (16 * DG)), c = (int)(idx % (16 * DG)) * 4;
        fm_f4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
        st[s] = zero;
        if (c < a.hd && key < a.kend) st[s] = *(const fm_f4 *)(a.Vc + (a.kv0 + key * a.kstride + c));
    }
}

template <int DG>
FM_DEVICE void fm_attn_store_v(float *buf, const fm_f4 st[4])
{
    for (int s = 0; s < DG; s++) *(fm_f4 *)&buf[4 * (threadIdx.x + FM_A_THREADS * s)] = st[s];
}

/* s[i][j] += q_row . k_key over the chunk's 32 dims, rows ty + 16 i, keys tx + 16 j:
 * 64 FMAs for every 8 f4 loads. */
FM_DEVICE void fm_attn_mma_qk(float s[4][4], const float *buf, int ty, int tx)
{
    const float *Qr = buf + ty * FM_AQK_LD, *Kr = buf + (FM_AQ + tx) * FM_AQK_LD;
#pragma unroll
    for (int k = 0; k < FM_AD; k += 4) {
        fm_f4 b[4];
        for (int j = 0; j < 4; j++) b[j] = *(const fm_f4 *)&Kr[16 * j * FM_AQK_LD + k];
        for (int i = 0; i < 4; i++) {
            fm_f4 q = *(const fm_f4 *)&Qr[16 * i * FM_AQK_LD + k];
            for (int j = 0; j < 4; j++) {
                float v = fm_fma(q.x, b[j].x, s[i][j]);
                v = fm_fma(q.y, b[j].y, v);
                v = fm_fma(q.z, b[j].z, v);
                s[i][j] = fm_fma(q.w, b[j].w, v);
            }
        }
    }
}

/* The tile's scaled scores into P, -inf where the key is past the row's position (or the
 * row past the prompt): masked before any exp. Clears s for the next tile. */
FM_DEVICE void fm_attn_scores(fm_attn_smem &sm, float s[4][4], int ty, int tx, int j0, int qpos0, int rows,
                              float scale)
{
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            int row = ty + 16 * i, c = tx + 16 * j;
            sm.P[c][row] = row < rows && j0 + c <= qpos0 + row ? s[i][j] * scale : fm_neg_inf();
            s[i][j] = 0.0f;
        }
}

/* Online softmax of the tile, thread (row r, key quarter part): m is the row's running
 * max (alike in its four threads), l this quarter's running sum; P becomes exp(S - m)
 * and alpha[r] the factor that rescales what the row has gathered so far. */
FM_DEVICE void fm_attn_softmax(fm_attn_smem &sm, float &m, float &l)
{
    int r = threadIdx.x & (FM_AQ - 1), c0 = (threadIdx.x / FM_AQ) * 16;
    float mx = fm_neg_inf();
    for (int c = 0; c < 16; c++) mx = fmaxf(mx, sm.P[c0 + c][r]);
    sm.red[threadIdx.x / FM_AQ][r] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(m, fmaxf(sm.red[0][r], sm.red[1][r])), fmaxf(sm.red[2][r], sm.red[3][r]));
    float alpha = 1.0f, sum = 0.0f;
    if (mx != fm_neg_inf()) {            /* a row past the prompt has no key: it keeps its zeros */
        alpha = fm_expf(m - mx);
        for (int c = 0; c < 16; c++) {
            float p = fm_expf(sm.P[c0 + c][r] - mx);
            sm.P[c0 + c][r] = p;
            sum += p;
        }
    } else {
        for (int c = 0; c < 16; c++) sm.P[c0 + c][r] = 0.0f;
    }
    l = l * alpha + sum;
    m = mx;
    if (c0 == 0) sm.alpha[r] = alpha;
    __syncthreads();
}

/* o[i][4 g + e] += sum_c P[key c][row ty*4 + i] V[c][dim 64 g + 4 tx + e] over the V chunk vc:
 * 16 DG FMAs for every 1 + DG f4 loads. */
template <int DG>
FM_DEVICE void fm_attn_mma_pv(float o[4][4 * DG], const fm_attn_smem &sm, int vc, int ty, int tx)
{
    const float *P = &sm.P[vc * FM_AV][ty * 4], *V = sm.buf + tx * 4;
#pragma unroll
    for (int c = 0; c < FM_AV; c++) {
        fm_f4 p4 = *(const fm_f4 *)&P[c * FM_AP_LD];
        float p[4] = {p4.x, p4.y, p4.z, p4.w};
        for (int g = 0; g < DG; g++) {
            fm_f4 v = *(const fm_f4 *)&V[c * 64 * DG + g * 64];
            for (int i = 0; i < 4; i++) {
                o[i][4 * g] = fm_fma(p[i], v.x, o[i][4 * g]);
                o[i][4 * g + 1] = fm_fma(p[i], v.y, o[i][4 * g + 1]);
                o[i][4 * g + 2] = fm_fma(p[i], v.z, o[i][4 * g + 2]);
                o[i][4 * g + 3] = fm_fma(p[i], v.w, o[i][4 * g + 3]);
            }
        }
    }
}

/* One block: rows [q0, q0 + rows) of head h, hd <= 64 DG. The next chunk (Q / K, or V)
 * is fetched into registers while the current one multiplies. */
template <int DG>
FM_DEVICE void fm_attn_rows(fm_attn_smem &sm, float *out, const float *qg, const fm_attn_args &a, int start,
                            float scale)
{
    int ty = fm_attn_ty(), tx = fm_attn_tx(), nd = (a.hd + FM_AD - 1) / FM_AD;
    float s[4][4], o[4][4 * DG], m = fm_neg_inf(), l = 0.0f;
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4; j++) s[i][j] = 0.0f;
        for (int j = 0; j < 4 * DG; j++) o[i][j] = 0.0f;
    }
    fm_f4 st[4];
    fm_attn_fetch_qk(st, a, 0, 0);
    for (int j0 = 0; j0 < a.kend; j0 += FM_AK) {      /* tiles past the last row's position: none */
        for (int dc = 0; dc < nd; dc++) {
            fm_attn_store_qk(sm.buf, st);
            __syncthreads();
            if (dc + 1 < nd) fm_attn_fetch_qk(st, a, j0, (dc + 1) * FM_AD);
            else fm_attn_fetch_v<DG>(st, a, j0);
            fm_attn_mma_qk(s, sm.buf, ty, tx);
            __syncthreads();
        }
        fm_attn_scores(sm, s, ty, tx, j0, start + a.q0, a.rows, scale);
        __syncthreads();
        fm_attn_softmax(sm, m, l);
        for (int i = 0; i < 4; i++) {
            float alpha = sm.alpha[ty * 4 + i];
            for (int j = 0; j < 4 * DG; j++) o[i][j] *= alpha;
        }
        int nv = fm_mini(FM_AK / FM_AV, (a.kend - j0 + FM_AV - 1) / FM_AV);   /* chunks before kend */
        for (int vc = 0; vc < nv; vc++) {
            fm_attn_store_v<DG>(sm.buf, st);
            __syncthreads();
            if (vc + 1 < nv) fm_attn_fetch_v<DG>(st, a, j0 + (vc + 1) * FM_AV);
            else if (j0 + FM_AK < a.kend) fm_attn_fetch_qk(st, a, j0 + FM_AK, 0);
            fm_attn_mma_pv<DG>(o, sm, vc, ty, tx);
            __syncthreads();
        }
    }
    sm.red[threadIdx.x / FM_AQ][threadIdx.x & (FM_AQ - 1)] = l;
    __syncthreads();
    for (int i = 0; i < 4; i++) {
        int row = ty * 4 + i;
        if (row >= a.rows) continue;
        float inv = 1.0f / (sm.red[0][row] + sm.red[1][row] + sm.red[2][row] + sm.red[3][row]);
        long long t = a.q0 + row;
        const float *gate = qg + (t * a.nh + a.h) * 2 * a.hd + a.hd;
        float *dst = out + (t * a.nh + a.h) * a.hd;
        for (int j = 0; j < 4 * DG; j++) {
            int d = (j / 4) * 64 + tx * 4 + j % 4;
            if (d < a.hd) dst[d] = o[i][j] * inv * fm_sigmoidf(gate[d]);
        }
    }
}

/* One block an SM asked for: a thread's 64 output accumulators and 4 x 4 scores with the
 * chunks in flight take ~220 registers; held to 128 (two blocks) they spill to local
 * memory, which cost more than the second block's warps hid */
FM_KERNEL FM_BOUNDS(FM_A_THREADS, 1) void attn_prompt(float *out, const float *q, const float *Kc, const float *Vc,
                                                      const float *qg, int start, int T, int nh, int nkv, int hd,
                                                      float scale)
{
    __shared__ fm_attn_smem sm;
    fm_attn_args a;
    a.q0 = (gridDim.y - 1 - blockIdx.y) * FM_AQ;       /* the longest rows start first: they set the tail */
    a.rows = fm_mini(FM_AQ, T - a.q0);
    a.kend = start + a.q0 + a.rows;
    a.h = blockIdx.x, a.nh = nh, a.hd = hd, a.kstride = nkv * hd;
    a.q = q, a.Kc = Kc, a.Vc = Vc, a.kv0 = (a.h / (nh / nkv)) * hd;
    for (int s = 0; s < 2; s++) {          /* T nh hd and positions nkv hd < 2^31: ops.py checks */
        int r = (threadIdx.x >> 3) + 32 * s;
        a.qrow[s] = r < a.rows ? ((a.q0 + r) * nh + a.h) * hd : -1;
    }
    switch ((hd + 63) / 64) {
    case 1: fm_attn_rows<1>(sm, out, qg, a, start, scale); break;
    case 2: fm_attn_rows<2>(sm, out, qg, a, start, scale); break;
    case 3: fm_attn_rows<3>(sm, out, qg, a, start, scale); break;
    default: fm_attn_rows<4>(sm, out, qg, a, start, scale); break;
    }
}
