/* vision.cu: the vision tower's own kernels (Qwen3.5/3.6's ViT: gpu_worker/vision.py runs
 * them; its matrix products are gemm.cu's, on the mmproj's weights as they are stored).
 *
 *   vis_layernorm  y[r] = (x[r] - mean) / sqrt(var + eps) * w + b     x, y [rows, n]; y may be x
 *   vis_bias_act   x[r] = act(x[r] + b)                                x [rows, n], b [n]
 *                  act: 0 none, 1 GELU (tanh form: the blocks' MLP), 2 GELU (exact erf form:
 *                  the merger's, as Hugging Face's nn.GELU())
 *   vis_qkv_rope   one row of the fused QKV product [q | k | v] (nh heads of hd each): the
 *                  bias added to all of it, then q and k turned by the 2-D rotary, NeoX
 *                  pairs (i, i + hd/2) by the angle whose cos / sin [rows, hd/2] the host
 *                  computed from the patch's (row, column)
 *   vis_attention  out[t, h] = softmax(q_t,h K_h^T * scale) V_h over every row of the image
 *                  (no mask: a patch sees the whole image), q, k, v read from qkv [n, 3 nh hd];
 *                  out [n, nh hd]; hd up to FM_VIS_MAX_HD.
 *                  A block takes 64 query rows of one head through 64-key tiles, flash style
 *                  (online softmax in fp32, nothing of size n x n stored):
 *                    S = Q K^T   Q and K in 32-dim chunks in shared memory (read 4 floats at
 *                                once); a thread keeps 4 x 4 scores (rows ty + 16 i, keys
 *                                tx + 16 j, 16 x 16 threads)
 *                    P           the running max and sum per row, by four threads a row
 *                                (16 keys each); keys past n are -inf before any exp
 *                    O           alpha O + P V over 16-key V chunks; a thread keeps rows
 *                                4 ty + i and dims tx + 16 e (e < ceil(hd / 16)) in registers
 *                  shared: 45.75 KB (Q and K chunks [64][36], P^T [64][68], a V chunk
 *                  [16][128], the row statistics); every exchange behind __syncthreads. Two
 *                  blocks an SM (FM_BOUNDS: the registers a thread may take).
 *                  grid (nh, ceil(n / 64)), block 256; qkv 16-byte aligned (vision.py checks).
 *
 * The row kernels loop over rows (blockIdx.x, then + gridDim.x): the host caps the grid
 * (Fermi's grids are at most 65535 blocks wide; an image may have more patches). */
#include "prelude.cuh"
#include "reduce.cuh"

#define FM_VIS_THREADS 256
#define FM_VIS_GELU_TANH 1
#define FM_VIS_GELU_ERF 2

/* erf with |error| < 1.5e-7 (Abramowitz & Stegun 7.1.26): no toolchain's erff is in the
 * Fermi check's reach (no CUDA headers, no libdevice), and this one is the CPU engine's. */
FM_DEVICE float fm_erff(float x)
{
    float a = fabsf(x);
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float poly = fm_fma(t, 1.061405429f, -1.453152027f);
    poly = fm_fma(t, poly, 1.421413741f);
    poly = fm_fma(t, poly, -0.284496736f);
    poly = fm_fma(t, poly, 0.254829592f);
    float r = 1.0f - t * poly * fm_expf(-a * a);
    return x < 0.0f ? -r : r;
}

/* 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3): no tanh needed,
 * and no overflow (e^(-2u) -> inf gives x / inf = 0). */
FM_DEVICE float fm_gelu_tanhf(float x)
{
    float u = 0.7978845608028654f * fm_fma(0.044715f * x, x * x, x);
    return x / (1.0f + fm_expf(-2.0f * u));
}

FM_DEVICE float fm_gelu_erff(float x) { return 0.5f * x * (1.0f + fm_erff(x * 0.7071067811865476f)); }

FM_KERNEL void vis_layernorm(float *y, const float *x, const float *w, const float *b, int rows, int n, float eps)
{
    __shared__ float scratch[FM_VIS_THREADS];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *xr = x + (long long)r * n;
        float *yr = y + (long long)r * n;
        float s = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
        float mean = fm_block_sum(s, scratch) / (float)n;
        float v = 0.0f;                   /* two passes: the variance of the centred values */
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            float c = xr[i] - mean;
            v = fm_fma(c, c, v);
        }
        float inv = 1.0f / fm_sqrtf(fm_block_sum(v, scratch) / (float)n + eps);
        for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = fm_fma((xr[i] - mean) * inv, w[i], b[i]);
    }
}

FM_KERNEL void vis_bias_act(float *x, const float *b, int rows, int n, int act)
{
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        float *xr = x + (long long)r * n;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            float v = xr[i] + b[i];
            if (act == FM_VIS_GELU_TANH) v = fm_gelu_tanhf(v);
            else if (act == FM_VIS_GELU_ERF) v = fm_gelu_erff(v);
            xr[i] = v;
        }
    }
}

FM_KERNEL void vis_qkv_rope(float *qkv, const float *bias, const float *cos_t, const float *sin_t, int rows, int nh,
                            int hd)
{
    int d = nh * hd, half = hd / 2, pairs = nh * half;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        float *row = qkv + (long long)r * 3 * d;
        const float *c = cos_t + (long long)r * half, *s = sin_t + (long long)r * half;
        for (int p = threadIdx.x; p < 2 * pairs; p += blockDim.x) {    /* q's pairs, then k's */
            int part = p / pairs, h = (p % pairs) / half, k = p % half;
            int i0 = part * d + h * hd + k, i1 = i0 + half;
            float x0 = row[i0] + bias[i0], x1 = row[i1] + bias[i1];
            row[i0] = x0 * c[k] - x1 * s[k];
            row[i1] = x1 * c[k] + x0 * s[k];
        }
        for (int i = 2 * d + threadIdx.x; i < 3 * d; i += blockDim.x) row[i] += bias[i];
    }
}

/* ---- vis_attention (see the header) ---- */
#define FM_VQ 64                  /* query rows a block */
#define FM_VK 64                  /* keys a tile */
#define FM_VD 32                  /* head dims a Q / K chunk */
#define FM_VV 16                  /* keys a V chunk */
#define FM_VIS_MAX_HD 128

#define FM_VQK_LD (FM_VD + 4)     /* 36: eight rows' f4 at one dim fall in eight distinct bank quads */
#define FM_VP_LD (FM_VQ + 4)

struct fm_vis_smem {
    FM_ALIGN16 float Q[FM_VQ][FM_VQK_LD];
    FM_ALIGN16 float K[FM_VK][FM_VQK_LD];
    FM_ALIGN16 float P[FM_VK][FM_VP_LD];      /* the tile's scores, then probabilities, key-major: P[key][row] */
    float V[FM_VV][FM_VIS_MAX_HD];
    float red[2][4][FM_VQ];                   /* a row's partial maxima and sums over the four key quarters */
    float m[FM_VQ], l[FM_VQ], alpha[FM_VQ];
};

struct fm_vis_args {
    const float *qkv;
    int n, hd, h, q0, ld;         /* ld: a token's qkv row (3 nh hd floats) */
};

/* Dims [d0, d0 + 32) of the block's queries and of keys [j0, j0 + 64): two f4 of each a
 * thread, eight threads a row's 32 dims (zeros past n and hd; hd is a multiple of 4 and
 * qkv 16-byte aligned, so an f4 is wholly in or out). */
FM_DEVICE void fm_vis_load_qk(fm_vis_smem &sm, const fm_vis_args &a, int j0, int d0)
{
    int c = (threadIdx.x & 7) * 4, dim = d0 + c, qoff = a.h * a.hd + dim, koff = a.ld / 3 + qoff;
    fm_f4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < 2; s++) {
        int row = (threadIdx.x >> 3) + 32 * s, q = a.q0 + row, key = j0 + row;
        bool in_dim = dim < a.hd;
        *(fm_f4 *)&sm.Q[row][c] = in_dim && q < a.n ? *(const fm_f4 *)(a.qkv + ((long long)q * a.ld + qoff)) : zero;
        *(fm_f4 *)&sm.K[row][c] = in_dim && key < a.n ? *(const fm_f4 *)(a.qkv + ((long long)key * a.ld + koff))
                                                      : zero;
    }
}

/* Values of keys [j, j + 16) (zeros past n). */
FM_DEVICE void fm_vis_load_v(fm_vis_smem &sm, const fm_vis_args &a, int j)
{
    int voff = 2 * (a.ld / 3) + a.h * a.hd;
    for (int e = threadIdx.x; e < FM_VV * a.hd; e += FM_VIS_THREADS) {
        int key = e / a.hd, dim = e % a.hd;
        sm.V[key][dim] = j + key < a.n ? a.qkv[(long long)(j + key) * a.ld + voff + dim] : 0.0f;
    }
}

template <int DE>
FM_DEVICE void fm_vis_attend(fm_vis_smem &sm, float *out, const fm_vis_args &a, float scale)
{
    int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    int r = threadIdx.x & (FM_VQ - 1), part = threadIdx.x / FM_VQ;       /* softmax: row r, keys 16 part.. */
    float o[4][DE];
    for (int i = 0; i < 4; i++)
        for (int e = 0; e < DE; e++) o[i][e] = 0.0f;
    if (threadIdx.x < FM_VQ) {
        sm.m[threadIdx.x] = fm_neg_inf();
        sm.l[threadIdx.x] = 0.0f;
    }
    for (int j0 = 0; j0 < a.n; j0 += FM_VK) {
        float s[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) s[i][j] = 0.0f;
        for (int d0 = 0; d0 < a.hd; d0 += FM_VD) {
            fm_vis_load_qk(sm, a, j0, d0);
            __syncthreads();
            for (int k = 0; k < FM_VD; k += 4) {      /* 64 FMAs for every 8 f4 loads */
                fm_f4 q[4], b[4];
                for (int i = 0; i < 4; i++) q[i] = *(const fm_f4 *)&sm.Q[ty + 16 * i][k];
                for (int j = 0; j < 4; j++) b[j] = *(const fm_f4 *)&sm.K[tx + 16 * j][k];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) {
                        float v = fm_fma(q[i].x, b[j].x, s[i][j]);
                        v = fm_fma(q[i].y, b[j].y, v);
                        v = fm_fma(q[i].z, b[j].z, v);
                        s[i][j] = fm_fma(q[i].w, b[j].w, v);
                    }
            }
            __syncthreads();
        }
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++)
                sm.P[tx + 16 * j][ty + 16 * i] = j0 + tx + 16 * j < a.n ? s[i][j] * scale : fm_neg_inf();
        __syncthreads();
        float mx = fm_neg_inf();
        for (int c = 0; c < 16; c++) mx = fmaxf(mx, sm.P[16 * part + c][r]);
        sm.red[0][part][r] = mx;
        __syncthreads();
        /* every tile has a key below n: the new max is finite, masked keys give exp(-inf) = 0 */
        float mnew = fmaxf(fmaxf(sm.m[r], fmaxf(sm.red[0][0][r], sm.red[0][1][r])),
                           fmaxf(sm.red[0][2][r], sm.red[0][3][r]));
        float sum = 0.0f;
        for (int c = 0; c < 16; c++) {
            float p = fm_expf(sm.P[16 * part + c][r] - mnew);
            sm.P[16 * part + c][r] = p;
            sum += p;
        }
        sm.red[1][part][r] = sum;
        __syncthreads();
        if (part == 0) {
            float alpha = fm_expf(sm.m[r] - mnew);          /* 0 on the first tile (m = -inf) */
            sm.l[r] = sm.l[r] * alpha + ((sm.red[1][0][r] + sm.red[1][1][r]) + (sm.red[1][2][r] + sm.red[1][3][r]));
            sm.m[r] = mnew;
            sm.alpha[r] = alpha;
        }
        __syncthreads();
        for (int i = 0; i < 4; i++) {
            float alpha = sm.alpha[4 * ty + i];
            for (int e = 0; e < DE; e++) o[i][e] *= alpha;
        }
        for (int v0 = 0; v0 < FM_VK && j0 + v0 < a.n; v0 += FM_VV) {
            fm_vis_load_v(sm, a, j0 + v0);
            __syncthreads();
            for (int c = 0; c < FM_VV; c++) {         /* 4 DE FMAs for every 1 + DE loads */
                fm_f4 p4 = *(const fm_f4 *)&sm.P[v0 + c][4 * ty];
                float p[4] = {p4.x, p4.y, p4.z, p4.w}, v[DE];
                for (int e = 0; e < DE; e++) v[e] = sm.V[c][tx + 16 * e];
                for (int i = 0; i < 4; i++)
                    for (int e = 0; e < DE; e++) o[i][e] = fm_fma(p[i], v[e], o[i][e]);
            }
            __syncthreads();
        }
    }
    int width = a.ld / 3;
    for (int i = 0; i < 4; i++) {
        int row = a.q0 + 4 * ty + i;
        if (row >= a.n) continue;
        float inv = 1.0f / sm.l[4 * ty + i];
        for (int e = 0; e < DE; e++) {
            int dim = tx + 16 * e;
            if (dim < a.hd) out[(long long)row * width + a.h * a.hd + dim] = o[i][e] * inv;
        }
    }
}

FM_KERNEL FM_BOUNDS(FM_VIS_THREADS, 2) void vis_attention(float *out, const float *qkv, int n, int nh, int hd,
                                                          float scale)
{
    __shared__ fm_vis_smem sm;
    fm_vis_args a;
    a.qkv = qkv, a.n = n, a.hd = hd, a.h = blockIdx.x, a.q0 = blockIdx.y * FM_VQ, a.ld = 3 * nh * hd;
    switch ((hd + 15) / 16) {
    case 1: fm_vis_attend<1>(sm, out, a, scale); break;
    case 2: fm_vis_attend<2>(sm, out, a, scale); break;
    case 3: fm_vis_attend<3>(sm, out, a, scale); break;
    case 4: fm_vis_attend<4>(sm, out, a, scale); break;
    case 5: fm_vis_attend<5>(sm, out, a, scale); break;
    case 6: fm_vis_attend<6>(sm, out, a, scale); break;
    case 7: fm_vis_attend<7>(sm, out, a, scale); break;
    default: fm_vis_attend<8>(sm, out, a, scale); break;
    }
}
