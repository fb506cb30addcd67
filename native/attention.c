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

/* The rotations of NeoX RoPE at one position, pair i = (i, i + rope_dim/2): computed
 * once a token for all its heads, not per head: pow, cos and sin are costly calls.
 * pos3: the (t, h, w) M-RoPE position, pair i turning by pos3[stream[i]]; stream NULL:
 * all three are pos3[0] (text), the same products. */
static void rope_angles(const int64_t *pos3, const int32_t *stream, int rope_dim, float theta, float *cs, float *sn) {
    for (int i = 0; i < rope_dim / 2; i++) {
        double inv_freq = 1.0 / pow(theta, (double)(2 * i) / rope_dim);
        float angle = (float)(pos3[stream ? stream[i] : 0] * inv_freq);
        cs[i] = cosf(angle), sn[i] = sinf(angle);
    }
}

static void rope(float *x, int rope_dim, const float *cs, const float *sn) {
    int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cs[i] - x2 * sn[i];
        x[i + half] = x2 * cs[i] + x1 * sn[i];
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
    const fm_inputs *in = a->c->inputs;
    float cs[m->rope_dim / 2 + 1], sn[m->rope_dim / 2 + 1];
    rope_angles(in ? in->rope_pos + 3 * (size_t)t : &pos, in ? in->rope_stream : NULL, m->rope_dim, m->rope_theta,
                cs, sn);
    for (int h = 0; h < m->n_head; h++) {
        float *q = a->qg + ((size_t)t * m->n_head + h) * 2 * hd;
        fm_rmsnorm(q, q, a->l->attn_q_norm.data, hd, m->rms_eps);
        rope(q, m->rope_dim, cs, sn);
    }
    float k[hd];
    for (int h = 0; h < nkv; h++) {
        fm_rmsnorm(k, a->k + (size_t)t * kvw + h * hd, a->l->attn_k_norm.data, hd, m->rms_eps);
        rope(k, m->rope_dim, cs, sn);
        store_kv(s, kv_at(s, s->k_pages, slot, pos, h, nkv, hd), k, hd);
        store_kv(s, kv_at(s, s->v_pages, slot, pos, h, nkv, hd), a->v + (size_t)t * kvw + h * hd, hd);
    }
}

#define KV_CHUNK 64             /* positions scored at once; chunks start at position 0 */
#define KV_SEGMENT 1024         /* positions one task attends over (16 chunks); segments start at 0 */

/* Causal softmax attention of one token for the G query heads that share one KV head
 * (grouped-query attention): each K and V row is read once for all of them, by the
 * fm_attn_* kernels. A token's positions split into segments of KV_SEGMENT, one task
 * each, so a long context spreads over all threads (split-KV, as flash-decoding).
 * A task runs its segment in chunks of KV_CHUNK with an online softmax between them
 * and leaves a softmax state per head: running max, sum of e^(score - max), and the
 * e^-weighted sum of V rows. The states of a token's segments are then folded in
 * segment order. Chunks and segments start at absolute positions, so every result
 * depends on the token's position only: bitwise the same whole, chunked or decoded.
 *
 *   softmax state of one query head: float [hd + 2] = acc[hd] | max | sum
 *   attn_part [task of the region][G][hd + 2]     attn_run [token][n_head][hd + 2]
 */
typedef struct {
    attn_ctx *a;
    int64_t *first;             /* [T + 1]: item index of token t's first (KV head, segment) */
    int64_t i0;                 /* the region's first item */
    int *pair_first;            /* fold region: pair k's items lie in [pair_first[k], pair_first[k+1]) */
} seg_ctx;

static int n_segments(int64_t last) { return (int)(last / KV_SEGMENT) + 1; }

/* Item i (token-major, then KV head, then segment) -> token, KV head, segment. */
static void item_of(const seg_ctx *sc, int nkv, int64_t i, int *t, int *g, int *s) {
    int tt = 0;
    while (i >= sc->first[tt + 1]) tt++;
    int S = (int)((sc->first[tt + 1] - sc->first[tt]) / nkv);
    int64_t r = i - sc->first[tt];
    *t = tt, *g = (int)(r / S), *s = (int)(r % S);
}

static float *head_state(float *states, int h, int hd) { return states + (size_t)h * (hd + 2); }

/* out = acc / sum * sigmoid(gate) for heads [h0, h0 + n) of the G that share KV head g
 * of token t; states holds theirs, head h0's first. */
__attribute__((target_clones("avx2", "default")))
static void finish_heads(const attn_ctx *a, int t, int g, int h0, int n, const float *states) {
    const fm_model *m = a->m;
    int nh = m->n_head, hd = m->head_dim, G = nh / m->n_head_kv;
    const float *q0 = a->qg + ((size_t)t * nh + (size_t)g * G + h0) * 2 * hd;
    for (int h = 0; h < n; h++) {
        const float *st = states + (size_t)h * (hd + 2), *gate = q0 + (size_t)h * 2 * hd + hd;
        float *out = a->out + (size_t)t * nh * hd + (size_t)(g * G + h0 + h) * hd;
        for (int i = 0; i < hd; i++) out[i] = st[i] / st[hd + 1] * fm_sigmoid(gate[i]);
    }
}

/* The softmax states of heads [h0, h0 + n) of the G sharing KV head g, over segment
 * seg of token t's positions, into states [n][hd + 2]. The kernels keep each head's
 * sums apart, so a head's state is bitwise the same whichever heads share the call. */
__attribute__((target_clones("avx2", "default")))
static void attend_segment(const attn_ctx *a, int t, int g, int h0, int n_heads, int seg, float *states) {
    const fm_model *m = a->m;
    int nh = m->n_head, hd = m->head_dim, nkv = m->n_head_kv, G = nh / nkv, slot = a->l->attn_slot;
    const fm_seq *s = a->c->seqs[a->c->tok_seq[t]];
    int64_t last = a->c->tok_pos[t], end = (seg + 1) * (int64_t)KV_SEGMENT - 1;
    end = end < last ? end : last;
    int f16 = s->kv_type == FM_F16, H = n_heads;
    const float *q0 = a->qg + ((size_t)t * nh + (size_t)g * G + h0) * 2 * hd;   /* head h: q0 + h*2*hd */
    float scale = 1.0f / sqrtf((float)hd), mx[H], sum[H], acc[H][hd], sc[H][KV_CHUNK];
    const void *krow[KV_CHUNK], *vrow[KV_CHUNK];
    for (int h = 0; h < H; h++) {
        mx[h] = -INFINITY, sum[h] = 0.0f;
        for (int i = 0; i < hd; i++) acc[h][i] = 0.0f;
    }
    for (int64_t p0 = (int64_t)seg * KV_SEGMENT; p0 <= end; p0 += KV_CHUNK) {
        int n = end + 1 - p0 < KV_CHUNK ? (int)(end + 1 - p0) : KV_CHUNK;
        for (int j = 0; j < n; j++) {
            krow[j] = kv_at(s, s->k_pages, slot, p0 + j, g, nkv, hd);
            vrow[j] = kv_at(s, s->v_pages, slot, p0 + j, g, nkv, hd);
        }
        fm_attn_scores(q0, 2 * hd, H, krow, f16, n, hd, &sc[0][0], KV_CHUNK);
        for (int h = 0; h < H; h++) {
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
        fm_attn_accumulate(&sc[0][0], KV_CHUNK, H, vrow, f16, n, hd, &acc[0][0]);
    }
    for (int h = 0; h < H; h++) {
        float *st = head_state(states, h, hd);
        for (int i = 0; i < hd; i++) st[i] = acc[h][i];
        st[hd] = mx[h], st[hd + 1] = sum[h];
    }
}

/* One segment of one (token, KV head), all G heads. A token with a single segment
 * is finished here; otherwise the states go to attn_part for the fold. */
static void segment_task(void *p, int task, int worker) {
    (void)worker;
    seg_ctx *sg = p;
    attn_ctx *a = sg->a;
    int nh = a->m->n_head, hd = a->m->head_dim, nkv = a->m->n_head_kv, G = nh / nkv, t, g, seg;
    item_of(sg, nkv, sg->i0 + task, &t, &g, &seg);
    int alone = n_segments(a->c->tok_pos[t]) == 1;     /* the token's only segment: finished here */
    float *states = alone ? a->c->attn_run + ((size_t)t * nh + (size_t)g * G) * (hd + 2)
                          : a->c->attn_part + (size_t)task * G * (hd + 2);
    attend_segment(a, t, g, 0, G, seg, states);
    if (alone) finish_heads(a, t, g, 0, G, states);
}

/* Tokens of one segment each, fewer (token, KV head) pairs than threads (a decode
 * step at a short context): task = (token, KV head, one of `parts` runs of its G
 * heads), so that every thread has heads to attend with. */
typedef struct { attn_ctx *a; int parts; } part_ctx;

static void heads_task(void *p, int task, int worker) {
    (void)worker;
    const part_ctx *pc = p;
    attn_ctx *a = pc->a;
    int nh = a->m->n_head, hd = a->m->head_dim, nkv = a->m->n_head_kv, G = nh / nkv;
    int part = task % pc->parts, g = task / pc->parts % nkv, t = task / pc->parts / nkv;
    int h0 = part * G / pc->parts, h1 = (part + 1) * G / pc->parts;
    float *states = a->c->attn_run + ((size_t)t * nh + (size_t)g * G + h0) * (hd + 2);
    attend_segment(a, t, g, h0, h1 - h0, 0, states);
    finish_heads(a, t, g, h0, h1 - h0, states);
}

/* Fold a pair's segment states of this region into its running state, in segment
 * order; the pair's last segment finishes it. */
__attribute__((target_clones("avx2", "default")))
static void fold_task(void *p, int k, int worker) {
    (void)worker;
    seg_ctx *sg = p;
    attn_ctx *a = sg->a;
    const fm_model *m = a->m;
    int nh = m->n_head, hd = m->head_dim, nkv = m->n_head_kv, G = nh / nkv, t, g, seg;
    for (int item = sg->pair_first[k]; item < sg->pair_first[k + 1]; item++) {
        item_of(sg, nkv, sg->i0 + item, &t, &g, &seg);
        if (n_segments(a->c->tok_pos[t]) == 1) continue;   /* a one-segment token between two pairs: done */
        float *run = a->c->attn_run + ((size_t)t * nh + (size_t)g * G) * (hd + 2);
        const float *part = a->c->attn_part + (size_t)item * G * (hd + 2);
        for (int h = 0; h < G; h++) {
            float *r = head_state(run, h, hd);
            const float *q = part + (size_t)h * (hd + 2);
            if (seg == 0) {
                for (int i = 0; i < hd + 2; i++) r[i] = q[i];
                continue;
            }
            float mx = r[hd] > q[hd] ? r[hd] : q[hd], wr = fm_expf(r[hd] - mx), wq = fm_expf(q[hd] - mx);
            for (int i = 0; i < hd; i++) r[i] = r[i] * wr + q[i] * wq;
            r[hd] = mx, r[hd + 1] = r[hd + 1] * wr + q[hd + 1] * wq;
        }
        if (seg == n_segments(a->c->tok_pos[t]) - 1) finish_heads(a, t, g, 0, G, run);
    }
}

/* Attention of the pass's T tokens, FM_ATTN_TASKS segment tasks a region; when
 * every token has one segment and there are fewer (token, KV head) pairs than
 * threads, one task per run of query heads instead (heads_task). */
static void attend(fm_ctx *c, attn_ctx *a, int T) {
    int nkv = c->m->n_head_kv;
    int64_t first[T + 1];
    first[0] = 0;
    int split = 0;
    for (int t = 0; t < T; t++) {
        int S = n_segments(c->tok_pos[t]);
        split |= S > 1;
        first[t + 1] = first[t] + (int64_t)nkv * S;
    }
    int threads = fm_pool_size(c->pool), G = c->m->n_head / nkv;
    if (!split && first[T] < threads) {
        part_ctx pc = {a, (int)((threads + first[T] - 1) / first[T])};
        pc.parts = pc.parts < G ? pc.parts : G;
        fm_pool_run(c->pool, heads_task, &pc, (int)first[T] * pc.parts);
        return;
    }
    int pair_first[FM_ATTN_TASKS + 1];
    seg_ctx sg = {a, first, 0, pair_first};
    for (int64_t i0 = 0; i0 < first[T]; i0 += FM_ATTN_TASKS) {
        int n = first[T] - i0 < FM_ATTN_TASKS ? (int)(first[T] - i0) : FM_ATTN_TASKS;
        sg.i0 = i0;
        fm_pool_run(c->pool, segment_task, &sg, n);
        if (!split) continue;
        int pairs = 0, t, g, s, pt = -1, pg = -1;
        for (int item = 0; item < n; item++) {      /* the region's items of each split (token, KV head) */
            item_of(&sg, nkv, i0 + item, &t, &g, &s);
            if (n_segments(c->tok_pos[t]) == 1) continue;
            if (t != pt || g != pg) pair_first[pairs++] = item, pt = t, pg = g;
        }
        pair_first[pairs] = n;
        fm_pool_run(c->pool, fold_task, &sg, pairs);
    }
}

void fm_attention_scratch(const fm_model *m, size_t T, size_t floats[FM_SCRATCH]) {
    size_t width = (size_t)m->n_head * m->head_dim, kvw = (size_t)m->n_head_kv * m->head_dim;
    floats[0] = T * 2 * width;      /* qg: each head's query and its output gate */
    floats[1] = T * 2 * kvw;        /* the new keys, then values */
    floats[2] = T * width;          /* out: the gated attention output */
    floats[3] = 0;
}

void fm_attention_block(fm_ctx *c, const fm_layer *l, int T) {
    const fm_model *m = c->m;
    int D = m->n_embd, kvw = m->n_head_kv * m->head_dim, width = m->n_head * m->head_dim;
    float **buf = c->scratch;      /* as fm_attention_scratch sizes them */
    attn_ctx a = {c, m, l, .qg = buf[0], .k = buf[1], .v = buf[1] + (size_t)T * kvw, .out = buf[2], .T = T};
    /* q|gate = x W_q, k = x W_k, v = x W_v */
    fm_quantize_rows(c->pool, c->xn, c->xq, T, D);
    fm_job in[3] = {
        {.w = &l->attn_q, .x = c->xn, .xq = c->xq, .B = T, .y = a.qg, .ldy = 2 * width},
        {.w = &l->attn_k, .x = c->xn, .xq = c->xq, .B = T, .y = a.k, .ldy = kvw},
        {.w = &l->attn_v, .x = c->xn, .xq = c->xq, .B = T, .y = a.v, .ldy = kvw},
    };
    fm_run_jobs(c->pool, in, 3);
    /* q and k RMS-normed and rotated, k and v into the sequence's cache */
    fm_pool_run_light(c->pool, prepare_task, &a, T);  /* a few microseconds a token */
    /* out = softmax(q K^T / sqrt(d)) V over the sequence's keys so far, times sigmoid(gate) */
    attend(c, &a, T);
    /* tmp = out W_o */
    fm_quantize_rows(c->pool, a.out, c->xq, T, width);
    fm_job out = {.w = &l->attn_output, .x = a.out, .xq = c->xq, .B = T, .y = c->tmp, .ldy = D};
    fm_run_jobs(c->pool, &out, 1);
}
