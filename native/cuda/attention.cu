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
 *                      position start + t (KV head h / (nh / nkv)); an online softmax
 *                      in fp32 over key tiles of 16 (flash style):
 *                        Qs  [16][hd]       the block's 16 queries
 *                        KVs [16][hd + 1]   a key tile, then its value tile
 *                        S   [16][17]       scores, then probabilities
 *                      each thread keeps dims d = tid, tid + 128 of the 16 output rows.
 *                      grid (ceil(T / 16), nh), block 128. */
#include "prelude.cuh"
#include "reduce.cuh"
#include "../fermoe_blocks.h"

#define FM_ATTN_MAX_HD 256
#define FM_ATTN_THREADS 128
#define FM_BQ 16
#define FM_BKEY 16

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

FM_KERNEL void attn_prompt(float *out, const float *q, const float *Kc, const float *Vc, const float *qg, int start,
                           int T, int nh, int nkv, int hd, float scale)
{
    __shared__ float Qs[FM_BQ][FM_ATTN_MAX_HD];
    __shared__ float KVs[FM_BKEY][FM_ATTN_MAX_HD + 1];
    __shared__ float S[FM_BQ][FM_BKEY + 1];
    __shared__ float m_s[FM_BQ], l_s[FM_BQ], alpha_s[FM_BQ];
    int tid = threadIdx.x, q0 = blockIdx.x * FM_BQ, h = blockIdx.y, kvh = h / (nh / nkv);
    int rows = fm_mini(FM_BQ, T - q0);
    for (int idx = tid; idx < FM_BQ * hd; idx += blockDim.x) {
        int r = idx / hd, d = idx % hd;
        Qs[r][d] = r < rows ? q[((long long)(q0 + r) * nh + h) * hd + d] : 0.0f;
    }
    if (tid < FM_BQ) {
        m_s[tid] = fm_neg_inf();
        l_s[tid] = 0.0f;
    }
    float o[FM_BQ][2];
    for (int r = 0; r < FM_BQ; r++) o[r][0] = o[r][1] = 0.0f;
    int kend = start + q0 + rows;        /* keys [0, kend): up to the last query's position */
    __syncthreads();
    for (int j0 = 0; j0 < kend; j0 += FM_BKEY) {
        for (int idx = tid; idx < FM_BKEY * hd; idx += blockDim.x) {
            int c = idx / hd, d = idx % hd, key = j0 + c;
            KVs[c][d] = key < kend ? Kc[((long long)key * nkv + kvh) * hd + d] : 0.0f;
        }
        __syncthreads();
        for (int p = tid; p < FM_BQ * FM_BKEY; p += blockDim.x) {
            int r = p / FM_BKEY, c = p % FM_BKEY, key = j0 + c;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot = fm_fma(Qs[r][d], KVs[c][d], dot);
            S[r][c] = r < rows && key < kend && key <= start + q0 + r ? dot * scale : fm_neg_inf();
        }
        __syncthreads();
        if (tid < FM_BQ) {
            float mx = m_s[tid];
            for (int c = 0; c < FM_BKEY; c++) mx = fmaxf(mx, S[tid][c]);
            float alpha = 1.0f, sum = 0.0f;
            if (mx != fm_neg_inf()) {          /* a row with no key yet keeps its zeros */
                alpha = fm_expf(m_s[tid] - mx);
                for (int c = 0; c < FM_BKEY; c++) {
                    float p = fm_expf(S[tid][c] - mx);
                    S[tid][c] = p;
                    sum += p;
                }
            } else {
                for (int c = 0; c < FM_BKEY; c++) S[tid][c] = 0.0f;
            }
            l_s[tid] = l_s[tid] * alpha + sum;
            m_s[tid] = mx;
            alpha_s[tid] = alpha;
        }
        for (int idx = tid; idx < FM_BKEY * hd; idx += blockDim.x) {   /* the keys are read: now the values */
            int c = idx / hd, d = idx % hd, key = j0 + c;
            KVs[c][d] = key < kend ? Vc[((long long)key * nkv + kvh) * hd + d] : 0.0f;
        }
        __syncthreads();
        for (int r = 0; r < FM_BQ; r++) {
            for (int dd = 0; dd < 2; dd++) {
                int d = tid + FM_ATTN_THREADS * dd;
                if (d >= hd) continue;
                float acc = o[r][dd] * alpha_s[r];
                for (int c = 0; c < FM_BKEY; c++) acc = fm_fma(S[r][c], KVs[c][d], acc);
                o[r][dd] = acc;
            }
        }
        __syncthreads();
    }
    for (int r = 0; r < FM_BQ; r++) {       /* a constant bound: o stays in registers */
        long long t = q0 + r;
        for (int dd = 0; dd < 2; dd++) {
            int d = tid + FM_ATTN_THREADS * dd;
            if (r >= rows || d >= hd) continue;
            float gate = qg[(t * nh + h) * 2 * hd + hd + d];
            out[(t * nh + h) * hd + d] = o[r][dd] / l_s[r] * fm_sigmoidf(gate);
        }
    }
}
