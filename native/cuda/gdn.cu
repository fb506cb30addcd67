/* gdn.cu: the Gated DeltaNet's token-wise parts, and its token-sequential recurrence.
 *
 * Layouts: x = the qkv projection [T, C] (C = 2 hk dk + hv dv channels: q, k, v);
 * q, k [T, hk, dk]; v is read from the conv output's last hv dv columns (row
 * stride ldv = C); beta, g [T, hv]; the state S [hv, dk, dv] fp32 (o = S^T q), the
 * conv state [Kk - 1, C] (oldest input first). Value head h reads key head
 * h % hk when `tiled` (llama.cpp's Qwen3.5/3.6 order), h / (hv / hk) otherwise.
 *
 *   gdn_conv          out[t, c] = silu(sum_j w[c, j] hist[t + j, c]), hist = the
 *                     carried conv state then x (grid (ceil(C / 256), T), block 256)
 *   gdn_conv_history  dst = hist rows [n, n + Kk - 1): the conv state after n of the
 *                     T tokens (dst may be the state itself; grid ceil(C / 256), block 256)
 *   gdn_qk_gates      q, k L2-normalised (q also scaled by dk^-1/2); beta = sigmoid(b),
 *                     g = ssm_a softplus(a + dt_bias)  (b, a [T, hv]; grid (T, hk), block 128)
 *   gdn_recurrent     per token: S = e^g S; d = beta (v - S^T k); S += k d^T; o = S^T q
 *                     o [T, hv, dv]. A block holds 32 value columns of one head's state:
 *                     thread r (of dk) keeps row r in registers; the column sums go
 *                     through red [dk][33]. grid (hv, ceil(dv / 32)), block dk. */
#include "prelude.cuh"
#include "gdn.cuh"
#include "reduce.cuh"

#define FM_GDN_COLS 32

FM_KERNEL void gdn_conv(float *out, const float *x, const float *state, const float *w, int T, int C, int Kk)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= C) return;
    float acc = 0.0f;
    for (int j = 0; j < Kk; j++) {
        int src = t + j - (Kk - 1);
        float v = src < 0 ? state[(long long)(Kk - 1 + src) * C + c] : x[(long long)src * C + c];
        acc = fm_fma(v, w[(long long)c * Kk + j], acc);
    }
    out[(long long)t * C + c] = fm_siluf(acc);
}

FM_KERNEL void gdn_conv_history(float *dst, const float *state, const float *x, int n, int T, int C, int Kk)
{
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int r = 0; r < Kk - 1; r++) {      /* ascending: in place, row n + r is read before it is written */
        int i = n + r;
        dst[(long long)r * C + c] = i < Kk - 1 ? state[(long long)i * C + c] : x[(long long)(i - (Kk - 1)) * C + c];
    }
}

FM_KERNEL void gdn_qk_gates(float *q, float *k, float *beta, float *g, const float *conv, const float *b,
                            const float *a, const float *ssm_a, const float *dt_bias, int T, int hk, int hv, int dk,
                            int C, float eps)
{
    __shared__ float scratch[128];
    int t = blockIdx.x, j = blockIdx.y;
    const float *qs = conv + (long long)t * C + j * dk, *ks = qs + hk * dk;
    float sq = 0.0f, sk = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        sq = fm_fma(qs[i], qs[i], sq);
        sk = fm_fma(ks[i], ks[i], sk);
    }
    float iq = 1.0f / fm_sqrtf(fm_block_sum(sq, scratch) + eps);
    float ik = 1.0f / fm_sqrtf(fm_block_sum(sk, scratch) + eps);
    float scale = 1.0f / fm_sqrtf((float)dk);
    long long o = ((long long)t * hk + j) * dk;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        q[o + i] = qs[i] * iq * scale;
        k[o + i] = ks[i] * ik;
    }
    if (j == 0)
        for (int h = threadIdx.x; h < hv; h += blockDim.x) {
            long long i = (long long)t * hv + h;
            beta[i] = fm_sigmoidf(b[i]);
            g[i] = ssm_a[h] * fm_softplusf(a[i] + dt_bias[h]);
        }
}

FM_KERNEL void gdn_recurrent(float *o, float *S, const float *q, const float *k, const float *v, const float *beta,
                             const float *g, int T, int hk, int hv, int dk, int dv, int ldv, int tiled)
{
    __shared__ float red[FM_GDN_MAX_DK][FM_GDN_COLS + 1];
    __shared__ float dcol[FM_GDN_COLS];
    int h = blockIdx.x, c0 = blockIdx.y * FM_GDN_COLS, r = threadIdx.x, kh = fm_key_head(h, hk, hv, tiled);
    int ncol = fm_mini(FM_GDN_COLS, dv - c0);
    float *Sh = S + (long long)h * dk * dv;
    float s[FM_GDN_COLS];
    for (int c = 0; c < FM_GDN_COLS; c++) s[c] = c < ncol ? Sh[(long long)r * dv + c0 + c] : 0.0f;
    for (int t = 0; t < T; t++) {
        float decay = fm_expf(g[(long long)t * hv + h]);
        float kr = k[((long long)t * hk + kh) * dk + r], qr = q[((long long)t * hk + kh) * dk + r];
        for (int c = 0; c < FM_GDN_COLS; c++) {
            s[c] *= decay;
            red[r][c] = s[c] * kr;
        }
        __syncthreads();
        for (int c = r; c < FM_GDN_COLS; c += blockDim.x) {
            float kv = 0.0f;
            for (int i = 0; i < dk; i++) kv += red[i][c];
            float vc = c < ncol ? v[(long long)t * ldv + h * dv + c0 + c] : 0.0f;
            dcol[c] = beta[(long long)t * hv + h] * (vc - kv);
        }
        __syncthreads();
        for (int c = 0; c < FM_GDN_COLS; c++) {
            s[c] = fm_fma(kr, dcol[c], s[c]);
            red[r][c] = s[c] * qr;
        }
        __syncthreads();
        for (int c = r; c < ncol; c += blockDim.x) {
            float out = 0.0f;
            for (int i = 0; i < dk; i++) out += red[i][c];
            o[((long long)t * hv + h) * dv + c0 + c] = out;
        }
        __syncthreads();
    }
    for (int c = 0; c < ncol; c++) Sh[(long long)r * dv + c0 + c] = s[c];
}
