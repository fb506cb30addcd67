/* Gated attention block for T tokens (see shared/reference.py: gated_attention).
 * Scratch: a = query|gate per head [T][n_head][2][head_dim], b = k [T][kv] then v [T][kv],
 *          c = attention output [T][n_head * head_dim]. K/V go to the sequence's pages. */
#include <string.h>

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

#define KV_CHUNK 64             /* positions scored at once; chunks start at position 0 */

/* q . k over n floats with 8 running sums in a fixed order (a generic vector: one
 * AVX2 register in that clone, two SSE ones in the other, the same roundings in
 * both and for every chunking of a prompt). */
typedef float v8f __attribute__((vector_size(32)));

static inline float dot8(const float *q, const float *k, int n) {
    v8f s = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f a, b;
        memcpy(&a, q + i, sizeof a);
        memcpy(&b, k + i, sizeof b);
        s += a * b;
    }
    for (; i < n; i++) s[0] += q[i] * k[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* Causal softmax attention of one token for the query heads that share one KV
 * head (grouped-query attention): each K and V row is read once for all of them.
 * Positions go by in chunks of KV_CHUNK from 0 with an online softmax between
 * chunks, so no score buffer grows with the context and every result depends on
 * the token's position only (bitwise the same whole, chunked or decoded). */
__attribute__((target_clones("avx2", "default")))
static void attn_head_task(void *p, int task, int worker) {
    (void)worker;
    attn_ctx *a = p;
    const fm_model *m = a->m;
    int nh = m->n_head, hd = m->head_dim, nkv = m->n_head_kv, kvw = nkv * hd, G = nh / nkv;
    int t = task / nkv, g = task % nkv;
    const fm_seq *s = a->c->seqs[a->c->tok_seq[t]];
    int64_t last = a->c->tok_pos[t];
    const float *q0 = a->qg + ((size_t)t * nh + (size_t)g * G) * 2 * hd;   /* head h of the group: q0 + h*2*hd */
    float scale = 1.0f / sqrtf((float)hd), mx[G], sum[G], acc[G][hd], sc[G][KV_CHUNK];
    for (int h = 0; h < G; h++) {
        mx[h] = -INFINITY, sum[h] = 0.0f;
        for (int i = 0; i < hd; i++) acc[h][i] = 0.0f;
    }
    for (int64_t p0 = 0; p0 <= last; p0 += KV_CHUNK) {
        int n = last + 1 - p0 < KV_CHUNK ? (int)(last + 1 - p0) : KV_CHUNK;
        for (int j = 0; j < n; j++) {
            const float *k = page_row(s->k_pages, s, a->l->attn_slot, p0 + j, kvw) + g * hd;
            for (int h = 0; h < G; h++) sc[h][j] = dot8(q0 + (size_t)h * 2 * hd, k, hd) * scale;
        }
        for (int h = 0; h < G; h++) {
            float cm = mx[h];
            for (int j = 0; j < n; j++) cm = sc[h][j] > cm ? sc[h][j] : cm;
            float shrink = fm_expf(mx[h] - cm);      /* ~0 on the first chunk: nothing to shrink */
            sum[h] *= shrink;
            for (int i = 0; i < hd; i++) acc[h][i] *= shrink;
            for (int j = 0; j < n; j++) sc[h][j] = fm_expf(sc[h][j] - cm);   /* vectorises */
            for (int j = 0; j < n; j++) sum[h] += sc[h][j];
            mx[h] = cm;
        }
        for (int j = 0; j < n; j++) {
            const float *v = page_row(s->v_pages, s, a->l->attn_slot, p0 + j, kvw) + g * hd;
            for (int h = 0; h < G; h++) {
                float w = sc[h][j];
                for (int i = 0; i < hd; i++) acc[h][i] += w * v[i];
            }
        }
    }
    for (int h = 0; h < G; h++) {
        const float *gate = q0 + (size_t)h * 2 * hd + hd;
        float *out = a->out + (size_t)t * nh * hd + (size_t)(g * G + h) * hd;
        for (int i = 0; i < hd; i++) out[i] = acc[h][i] / sum[h] * fm_sigmoid(gate[i]);
    }
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
    fm_pool_run(c->pool, attn_head_task, &a, T * m->n_head_kv);
    fm_quantize_rows(c->pool, a.out, c->xq, T, width);
    fm_job out = {&l->attn_output, 0, a.out, c->xq, T, c->tmp, D};
    fm_run_jobs(c->pool, &out, 1);
}
