/* Gated attention block for T tokens (see shared/reference.py: gated_attention).
 * Scratch: a = query|gate per head [T][n_head][2][head_dim], b = k [T][kv] then v [T][kv],
 *          c = attention output [T][n_head * head_dim]. K/V go to the sequence's pages. */
#include "ctx.h"
#include "ops.h"

typedef struct {
    const fm_ctx *c;            /* the pass: each token's sequence and position */
    const fm_model *m;
    const fm_layer *l;
    float *qg, *k, *v, *out;
    int T;
} attn_ctx;

/* NeoX RoPE on the first rope_dim dims: pairs (i, i + rope_dim/2). */
static void rope(float *x, int64_t pos, int rope_dim, float theta) {
    int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        double inv_freq = 1.0 / pow(theta, (double)(2 * i) / rope_dim);
        float angle = (float)(pos * inv_freq);
        float cs = cosf(angle), sn = sinf(angle);
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cs - x2 * sn;
        x[i + half] = x2 * cs + x1 * sn;
    }
}

static float *page_row(float *const *pages, const fm_seq *s, int slot, int64_t pos, int width) {
    return pages[(size_t)slot * s->max_pages + pos / s->block] + (pos % s->block) * width;
}

/* Norms, RoPE, and K/V into its sequence's pages: one task per token. */
static void prepare_task(void *p, int t, int worker) {
    (void)worker;
    attn_ctx *a = p;
    const fm_model *m = a->m;
    int hd = m->head_dim, nkv = m->n_head_kv, kvw = nkv * hd;
    const fm_seq *s = a->c->seqs[a->c->tok_seq[t]];
    int64_t pos = a->c->tok_pos[t];
    for (int h = 0; h < m->n_head; h++) {
        float *q = a->qg + ((size_t)t * m->n_head + h) * 2 * hd;
        fm_rmsnorm(q, q, a->l->attn_q_norm.data, hd, m->rms_eps);
        rope(q, pos, m->rope_dim, m->rope_theta);
    }
    float *kdst = page_row(s->k_pages, s, a->l->attn_slot, pos, kvw);
    float *vdst = page_row(s->v_pages, s, a->l->attn_slot, pos, kvw);
    for (int h = 0; h < nkv; h++) {
        float *k = a->k + (size_t)t * kvw + h * hd;
        fm_rmsnorm(kdst + h * hd, k, a->l->attn_k_norm.data, hd, m->rms_eps);
        rope(kdst + h * hd, pos, m->rope_dim, m->rope_theta);
    }
    for (int i = 0; i < kvw; i++) vdst[i] = a->v[(size_t)t * kvw + i];
}

/* Causal softmax attention of one (token, head), with an online softmax so no
 * score buffer is needed however long the sequence; then the sigmoid gate. */
static void head_task(void *p, int task, int worker) {
    (void)worker;
    attn_ctx *a = p;
    const fm_model *m = a->m;
    int nh = m->n_head, hd = m->head_dim, kvw = m->n_head_kv * hd;
    int t = task / nh, h = task % nh, kvh = h / (nh / m->n_head_kv);
    const float *q = a->qg + ((size_t)t * nh + h) * 2 * hd, *gate = q + hd;
    const fm_seq *s = a->c->seqs[a->c->tok_seq[t]];
    int64_t last = a->c->tok_pos[t];
    float scale = 1.0f / sqrtf((float)hd), run_max = -INFINITY, sum = 0.0f, acc[hd];
    for (int i = 0; i < hd; i++) acc[i] = 0.0f;
    for (int64_t pos = 0; pos <= last; pos++) {
        const float *k = page_row(s->k_pages, s, a->l->attn_slot, pos, kvw) + kvh * hd;
        const float *v = page_row(s->v_pages, s, a->l->attn_slot, pos, kvw) + kvh * hd;
        float score = fm_dot(q, k, hd) * scale;
        if (score > run_max) {
            float shrink = expf(run_max - score);
            for (int i = 0; i < hd; i++) acc[i] *= shrink;
            sum *= shrink;
            run_max = score;
        }
        float w = expf(score - run_max);
        sum += w;
        for (int i = 0; i < hd; i++) acc[i] += w * v[i];
    }
    float *out = a->out + (size_t)t * nh * hd + h * hd;
    for (int i = 0; i < hd; i++) out[i] = acc[i] / sum * fm_sigmoid(gate[i]);
}

void fm_attention_block(fm_ctx *c, const fm_layer *l, int T) {
    const fm_model *m = c->m;
    int D = m->n_embd, kvw = m->n_head_kv * m->head_dim, width = m->n_head * m->head_dim;
    attn_ctx a = {c, m, l, c->a, c->b, c->b + (size_t)T * kvw, c->c, T};
    fm_quantize_rows(c->pool, c->xn, c->xq, T, D);
    fm_job in[3] = {
        {&l->attn_q, 0, c->xn, c->xq, T, a.qg, 2 * width},
        {&l->attn_k, 0, c->xn, c->xq, T, a.k, kvw},
        {&l->attn_v, 0, c->xn, c->xq, T, a.v, kvw},
    };
    fm_run_jobs(c->pool, in, 3);
    fm_pool_run(c->pool, prepare_task, &a, T);
    fm_pool_run(c->pool, head_task, &a, T * m->n_head);
    fm_quantize_rows(c->pool, a.out, c->xq, T, width);
    fm_job out = {&l->attn_output, 0, a.out, c->xq, T, c->tmp, D};
    fm_run_jobs(c->pool, &out, 1);
}
