/* Gated DeltaNet block for T tokens (see shared/reference.py: gated_deltanet).
 * Scratch: a = qkv [T][conv_channels], b = z [T][d_inner],
 *          d = beta [T][v_heads] then alpha [T][v_heads], c = o [T][d_inner]. */
#include "ctx.h"
#include "ops.h"

#define CONV_RUN 256            /* channels a conv_channels call takes (its stack arrays) */

typedef struct {
    const fm_ctx *c;            /* the pass: which tokens belong to which sequence */
    const fm_model *m;
    const fm_layer *l;
    float *qkv, *z, *beta, *alpha, *o;
    int T, channels;
} gdn_ctx;

/* This layer's conv history and recurrent state of the pass's sequence i. */
static float *conv_state(const gdn_ctx *g, int i) {
    return g->c->seqs[i]->conv + (size_t)g->l->gdn_slot * (g->m->ssm_conv_kernel - 1) * g->channels;
}

static float *ssm_state(const gdn_ctx *g, int i) {
    const fm_model *m = g->m;
    return g->c->seqs[i]->ssm + (size_t)g->l->gdn_slot * m->ssm_v_heads * m->ssm_head_k_dim * m->ssm_head_v_dim;
}

/* Causal depthwise conv over the carried history of kernel-1 raw inputs, then SiLU.
 * Token by token over a run of channels, so every step is a loop over channels
 * that vectorises; each output sums w[K-1] x, then w[j] hist[j] for j = 0.. in
 * order, whatever the chunking of the prompt. Each sequence of the pass carries
 * its own history. */
__attribute__((target_clones("avx2", "default")))
static void conv_channels(const gdn_ctx *g, int c0, int n) {
    int K = g->m->ssm_conv_kernel, C = g->channels;
    const float *w = g->l->ssm_conv1d.data;
    float wt[FM_MAX_CONV_KERNEL][CONV_RUN], hist[FM_MAX_CONV_KERNEL - 1][CONV_RUN];
    float acc[CONV_RUN];
    for (int j = 0; j < K; j++)
        for (int i = 0; i < n; i++) wt[j][i] = w[(size_t)(c0 + i) * K + j];
    for (int s = 0; s < g->c->n_seqs; s++) {
        float *state = conv_state(g, s);
        for (int j = 0; j < K - 1; j++)
            for (int i = 0; i < n; i++) hist[j][i] = state[(size_t)j * C + c0 + i];
        for (int t = g->c->seq_first[s]; t < g->c->seq_first[s] + g->c->seq_count[s]; t++) {
            float *x = g->qkv + (size_t)t * C + c0;
            for (int i = 0; i < n; i++) acc[i] = wt[K - 1][i] * x[i];
            for (int j = 0; j < K - 1; j++)
                for (int i = 0; i < n; i++) acc[i] += wt[j][i] * hist[j][i];
            for (int j = 0; j + 1 < K - 1; j++)
                for (int i = 0; i < n; i++) hist[j][i] = hist[j + 1][i];
            for (int i = 0; i < n; i++) {
                hist[K - 2][i] = x[i];
                x[i] = fm_silu(acc[i]);
            }
        }
        for (int j = 0; j < K - 1; j++)
            for (int i = 0; i < n; i++) state[(size_t)j * C + c0 + i] = hist[j][i];
    }
}

/* The conv of channels [c0, c1): the projection region runs it as their rows come out. */
static void conv_rows(void *p, int c0, int c1) {
    for (int c = c0; c < c1; c += CONV_RUN) conv_channels(p, c, c1 - c < CONV_RUN ? c1 - c : CONV_RUN);
}

static void l2_normalize(float *y, const float *x, int n, float scale) {
    float inv = scale / sqrtf(fm_dot(x, x, n) + 1e-6f);
    for (int i = 0; i < n; i++) y[i] = x[i] * inv;
}

/* One step of the delta rule on S [dk][dv]:
 *   S' = e^g S + k d^T  with  d = beta (v - e^g S^T k),   o = S'^T q.
 * Since o = e^g S^T q + d (k.q), one read-only pass gives S^T k and S^T q and one
 * read-write pass applies the update: S (64 KiB a head) is streamed twice, not four times. */
/* The hottest loop of prefill: compiled for AVX2+FMA too, picked at load time. */
__attribute__((target_clones("avx2", "default")))
static void delta_step(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                       float *o, int dk, int dv) {
    float kv[dv], sq[dv], delta[dv];
    for (int j = 0; j < dv; j++) kv[j] = 0.0f, sq[j] = 0.0f;
    int i = 0;
    for (; i + 4 <= dk; i += 4) {   /* four rows a pass over kv and sq: a quarter of the stores, same sums */
        const float *r0 = S + (size_t)i * dv, *r1 = r0 + dv, *r2 = r1 + dv, *r3 = r2 + dv;
        const float k0 = k[i], k1 = k[i + 1], k2 = k[i + 2], k3 = k[i + 3];
        const float q0 = q[i], q1 = q[i + 1], q2 = q[i + 2], q3 = q[i + 3];
        for (int j = 0; j < dv; j++) {
            kv[j] = (((kv[j] + r0[j] * k0) + r1[j] * k1) + r2[j] * k2) + r3[j] * k3;
            sq[j] = (((sq[j] + r0[j] * q0) + r1[j] * q1) + r2[j] * q2) + r3[j] * q3;
        }
    }
    for (; i < dk; i++) {
        const float *row = S + (size_t)i * dv;
        for (int j = 0; j < dv; j++) {
            kv[j] += row[j] * k[i];
            sq[j] += row[j] * q[i];
        }
    }
    float kq = fm_dot(k, q, dk);
    for (int j = 0; j < dv; j++) {
        delta[j] = beta * (v[j] - decay * kv[j]);
        o[j] = decay * sq[j] + delta[j] * kq;
    }
    for (int i = 0; i < dk; i++) {
        float *row = S + (size_t)i * dv;
        for (int j = 0; j < dv; j++) row[j] = decay * row[j] + k[i] * delta[j];
    }
}

__attribute__((target_clones("avx2", "default")))
/* One value head of one sequence, over that sequence's tokens in order. */
static void gdn_head_task(void *p, int task, int worker) {
    (void)worker;
    gdn_ctx *g = p;
    const fm_model *m = g->m;
    int Hk = m->ssm_k_heads, Hv = m->ssm_v_heads, dk = m->ssm_head_k_dim, dv = m->ssm_head_v_dim;
    int key_dim = Hk * dk, d_inner = Hv * dv, C = g->channels;
    int s = task / Hv, h = task % Hv;
    int kh = m->v_heads_tiled ? h % Hk : h / (Hv / Hk);
    const float *a_log = g->l->ssm_a.data, *dt = g->l->ssm_dt.data, *norm_w = g->l->ssm_norm.data;
    float *S = ssm_state(g, s) + (size_t)h * dk * dv;
    float qn[dk], kn[dk], out[dv], gate[dv];
    for (int t = g->c->seq_first[s]; t < g->c->seq_first[s] + g->c->seq_count[s]; t++) {
        const float *row = g->qkv + (size_t)t * C;
        l2_normalize(qn, row + kh * dk, dk, 1.0f / sqrtf((float)dk));
        l2_normalize(kn, row + key_dim + kh * dk, dk, 1.0f);
        float decay = expf(a_log[h] * fm_softplus(g->alpha[(size_t)t * Hv + h] + dt[h]));
        float beta = fm_sigmoid(g->beta[(size_t)t * Hv + h]);
        delta_step(S, qn, kn, row + 2 * key_dim + h * dv, decay, beta, out, dk, dv);
        /* gated RMSNorm: rmsnorm(o) * w * silu(z) */
        float *dst = g->o + (size_t)t * d_inner + h * dv;
        const float *z = g->z + (size_t)t * d_inner + h * dv;
        fm_rmsnorm(dst, out, norm_w, dv, m->rms_eps);
        for (int j = 0; j < dv; j++) gate[j] = fm_silu(z[j]);   /* apart from dst, so it vectorises */
        for (int j = 0; j < dv; j++) dst[j] *= gate[j];
    }
}

void fm_gdn_scratch(const fm_model *m, size_t T, size_t floats[FM_SCRATCH]) {
    size_t Hv = m->ssm_v_heads, d_inner = Hv * m->ssm_head_v_dim;
    floats[0] = T * (2 * (size_t)m->ssm_k_heads * m->ssm_head_k_dim + d_inner);   /* qkv, then its conv */
    floats[1] = T * d_inner;                                                 /* z, the output gate */
    floats[2] = T * d_inner;                                                 /* o, the heads' output */
    floats[3] = 2 * T * Hv;                                                  /* beta and alpha */
}

void fm_gdn_block(fm_ctx *c, const fm_layer *l, int T) {
    const fm_model *m = c->m;
    int D = m->n_embd, Hv = m->ssm_v_heads, d_inner = Hv * m->ssm_head_v_dim;
    int channels = 2 * m->ssm_k_heads * m->ssm_head_k_dim + d_inner;
    float **buf = c->scratch;      /* as fm_gdn_scratch sizes them */
    gdn_ctx g = {c, m, l, .qkv = buf[0], .z = buf[1], .o = buf[2], .beta = buf[3], .alpha = buf[3] + (size_t)T * Hv,
                 .T = T, .channels = channels};

    /* qkv = x W_qkv (then its causal conv, row by row), z = x W_gate, beta and alpha's inputs */
    fm_quantize_rows(c->pool, c->xn, c->xq, T, D);
    fm_job in[4] = {
        {.w = &l->attn_qkv, .x = c->xn, .xq = c->xq, .B = T, .y = g.qkv, .ldy = channels,
         .done = conv_rows, .done_ctx = &g},        /* the conv runs on rows as they are computed */
        {.w = &l->attn_gate, .x = c->xn, .xq = c->xq, .B = T, .y = g.z, .ldy = d_inner},
        {.w = &l->ssm_beta, .x = c->xn, .xq = c->xq, .B = T, .y = g.beta, .ldy = Hv},
        {.w = &l->ssm_alpha, .x = c->xn, .xq = c->xq, .B = T, .y = g.alpha, .ldy = Hv},
    };
    fm_run_jobs(c->pool, in, 4);
    /* the gated delta rule head by head: S = e^g S + k (beta (v - e^g S^T k))^T, o = S^T q;
     * then o = rmsnorm(o) * silu(z) */
    fm_pool_run(c->pool, gdn_head_task, &g, c->n_seqs * Hv);

    /* tmp = o W_out */
    fm_quantize_rows(c->pool, g.o, c->xq, T, d_inner);
    fm_job out = {.w = &l->ssm_out, .x = g.o, .xq = c->xq, .B = T, .y = c->tmp, .ldy = D};
    fm_run_jobs(c->pool, &out, 1);
}
