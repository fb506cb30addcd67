/* Gated attention block for T tokens (see shared/reference.py: gated_attention).
 * Scratch: a = query|gate per head [T][n_head][2][head_dim], b = k [T][kv] then v [T][kv],
 *          c = attention output [T][n_head * head_dim]. K/V go to the sequence's pages,
 * fp16 (rounded to nearest even, as the reference's numpy pages round) or fp32. */
#include <string.h>

#include "ctx.h"
#include "kernels.h"
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

/* KV head h of position pos in a page table; rows are n_head_kv * hd elements wide. */
static void *kv_at(const fm_seq *s, void *const *pages, int slot, int64_t pos, int h, int n_head_kv, int hd) {
    size_t esize = s->kv_type == FM_F16 ? 2 : 4;
    size_t elem = (size_t)(pos % s->block) * n_head_kv * hd + (size_t)h * hd;
    return (char *)pages[(size_t)slot * s->max_pages + pos / s->block] + elem * esize;
}

static void store_kv(const fm_seq *s, void *dst, const float *x, int n) {
    if (s->kv_type == FM_F16) fm_fp32_to_fp16_row(x, dst, n);
    else memcpy(dst, x, (size_t)n * sizeof(float));
}

/* Norms, RoPE, and K/V into its sequence's pages: one task per token. */
static void prepare_task(void *p, int t, int worker) {
    (void)worker;
    attn_ctx *a = p;
    const fm_model *m = a->m;
    int hd = m->head_dim, nkv = m->n_head_kv, kvw = nkv * hd, slot = a->l->attn_slot;
    const fm_seq *s = a->c->seqs[a->c->tok_seq[t]];
    int64_t pos = a->c->tok_pos[t];
    for (int h = 0; h < m->n_head; h++) {
        float *q = a->qg + ((size_t)t * m->n_head + h) * 2 * hd;
        fm_rmsnorm(q, q, a->l->attn_q_norm.data, hd, m->rms_eps);
        rope(q, pos, m->rope_dim, m->rope_theta);
    }
    float k[hd];
    for (int h = 0; h < nkv; h++) {
        fm_rmsnorm(k, a->k + (size_t)t * kvw + h * hd, a->l->attn_k_norm.data, hd, m->rms_eps);
        rope(k, pos, m->rope_dim, m->rope_theta);
        store_kv(s, kv_at(s, s->k_pages, slot, pos, h, nkv, hd), k, hd);
        store_kv(s, kv_at(s, s->v_pages, slot, pos, h, nkv, hd), a->v + (size_t)t * kvw + h * hd, hd);
    }
}

#define KV_CHUNK 64             /* positions scored at once; chunks start at position 0 */

/* Causal softmax attention of one token for the query heads that share one KV head
 * (grouped-query attention): each K and V row is read once for all of them, by the
 * fm_attn_* kernels. Positions go by in chunks of KV_CHUNK from 0 with an online
 * softmax between chunks, so no score buffer grows with the context and every result
 * depends on the token's position only (bitwise the same whole, chunked or decoded). */
__attribute__((target_clones("avx2", "default")))
static void attn_head_task(void *p, int task, int worker) {
    (void)worker;
    attn_ctx *a = p;
    const fm_model *m = a->m;
    int nh = m->n_head, hd = m->head_dim, nkv = m->n_head_kv, G = nh / nkv, slot = a->l->attn_slot;
    int t = task / nkv, g = task % nkv;
    const fm_seq *s = a->c->seqs[a->c->tok_seq[t]];
    int64_t last = a->c->tok_pos[t];
    int f16 = s->kv_type == FM_F16;
    const float *q0 = a->qg + ((size_t)t * nh + (size_t)g * G) * 2 * hd;   /* head h of the group: q0 + h*2*hd */
    float scale = 1.0f / sqrtf((float)hd), mx[G], sum[G], acc[G][hd], sc[G][KV_CHUNK];
    const void *krow[KV_CHUNK], *vrow[KV_CHUNK];
    for (int h = 0; h < G; h++) {
        mx[h] = -INFINITY, sum[h] = 0.0f;
        for (int i = 0; i < hd; i++) acc[h][i] = 0.0f;
    }
    for (int64_t p0 = 0; p0 <= last; p0 += KV_CHUNK) {
        int n = last + 1 - p0 < KV_CHUNK ? (int)(last + 1 - p0) : KV_CHUNK;
        for (int j = 0; j < n; j++) {
            krow[j] = kv_at(s, s->k_pages, slot, p0 + j, g, nkv, hd);
            vrow[j] = kv_at(s, s->v_pages, slot, p0 + j, g, nkv, hd);
        }
        fm_attn_scores(q0, 2 * hd, G, krow, f16, n, hd, &sc[0][0], KV_CHUNK);
        for (int h = 0; h < G; h++) {
            float cm = mx[h];
            for (int j = 0; j < n; j++) sc[h][j] *= scale;
            for (int j = 0; j < n; j++) cm = sc[h][j] > cm ? sc[h][j] : cm;
            float shrink = fm_expf(mx[h] - cm);      /* ~0 on the first chunk: nothing to shrink */
            sum[h] *= shrink;
            for (int i = 0; i < hd; i++) acc[h][i] *= shrink;
            for (int j = 0; j < n; j++) sc[h][j] = fm_expf(sc[h][j] - cm);   /* vectorises */
            for (int j = 0; j < n; j++) sum[h] += sc[h][j];
            mx[h] = cm;
        }
        fm_attn_accumulate(&sc[0][0], KV_CHUNK, G, vrow, f16, n, hd, &acc[0][0]);
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
