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

/* The softmax states of heads [h0, h0 + H) of the G sharing KV head g, over segment
 * seg of the positions of nt consecutive tokens of one sequence from t0: token k's
 * state of head h into states + k * tstride + h * (hd + 2); a token whose positions
 * end before the segment is left alone. acc: scratch of [nt][H][hd] floats.
 * The tokens go through each chunk of KV_CHUNK positions one after the other, so the
 * chunk's K and V rows are read from memory once for all of them and stay in the
 * caches for the rest: a long prompt's split attention otherwise streams every row from
 * memory once per query token. Each token runs the chunks exactly as it would alone,
 * and the kernels keep each head's sums apart, so a head's state is bitwise the same
 * whichever heads and tokens share the call. */
__attribute__((target_clones("avx2", "default")))
static void attend_block(const attn_ctx *a, int t0, int nt, int g, int h0, int H, int seg, float *states,
                         size_t tstride, float *acc) {
    const fm_model *m = a->m;
    int nh = m->n_head, hd = m->head_dim, nkv = m->n_head_kv, G = nh / nkv, slot = a->l->attn_slot;
    const fm_seq *s = a->c->seqs[a->c->tok_seq[t0]];
    int f16 = s->kv_type == FM_F16;
    int64_t first = (int64_t)seg * KV_SEGMENT, end[nt], max_end = first - 1;
    for (int k = 0; k < nt; k++) {
        int64_t last = a->c->tok_pos[t0 + k];
        end[k] = last < first + KV_SEGMENT - 1 ? last : first + KV_SEGMENT - 1;
        max_end = end[k] > max_end ? end[k] : max_end;
    }
    float scale = 1.0f / sqrtf((float)hd), mx[nt][H], sum[nt][H], cm[H], sc[H][KV_CHUNK];
    const void *krow[KV_CHUNK], *vrow[KV_CHUNK];
    for (int k = 0; k < nt; k++)
        for (int h = 0; h < H; h++) {
            mx[k][h] = -INFINITY, sum[k][h] = 0.0f;
            for (int i = 0; i < hd; i++) acc[((size_t)k * H + h) * hd + i] = 0.0f;
        }
    for (int64_t p0 = first; p0 <= max_end; p0 += KV_CHUNK) {
        int rows = max_end + 1 - p0 < KV_CHUNK ? (int)(max_end + 1 - p0) : KV_CHUNK;
        for (int j = 0; j < rows; j++) {
            krow[j] = kv_at(s, s->k_pages, slot, p0 + j, g, nkv, hd);
            vrow[j] = kv_at(s, s->v_pages, slot, p0 + j, g, nkv, hd);
        }
        for (int k = 0; k < nt; k++) {
            if (end[k] < p0) continue;
            int n = end[k] + 1 - p0 < KV_CHUNK ? (int)(end[k] + 1 - p0) : KV_CHUNK;
            const float *q0 = a->qg + ((size_t)(t0 + k) * nh + (size_t)g * G + h0) * 2 * hd; /* head h: q0 + h*2*hd */
            float *ak = acc + (size_t)k * H * hd;
            fm_attn_scores(q0, 2 * hd, H, krow, f16, n, hd, &sc[0][0], KV_CHUNK);
            /* Each head's max and sum run over j in order; the heads side by side, so
             * that H running sums overlap instead of one add waiting on the last. */
            for (int h = 0; h < H; h++) {
                for (int j = 0; j < n; j++) sc[h][j] *= scale;
                cm[h] = mx[k][h];
            }
            for (int j = 0; j < n; j++)
                for (int h = 0; h < H; h++) cm[h] = sc[h][j] > cm[h] ? sc[h][j] : cm[h];
            for (int h = 0; h < H; h++) {
                float shrink = fm_expf(mx[k][h] - cm[h]);   /* ~0 on the first chunk: nothing to shrink */
                sum[k][h] *= shrink;
                for (int i = 0; i < hd; i++) ak[(size_t)h * hd + i] *= shrink;
                for (int j = 0; j < n; j++) sc[h][j] = fm_expf(sc[h][j] - cm[h]);   /* vectorises */
                mx[k][h] = cm[h];
            }
            for (int j = 0; j < n; j++)
                for (int h = 0; h < H; h++) sum[k][h] += sc[h][j];
            fm_attn_accumulate(&sc[0][0], KV_CHUNK, H, vrow, f16, n, hd, ak);
        }
    }
    for (int k = 0; k < nt; k++) {
        if (end[k] < first) continue;
        for (int h = 0; h < H; h++) {
            float *st = head_state(states + (size_t)k * tstride, h, hd);
            for (int i = 0; i < hd; i++) st[i] = acc[((size_t)k * H + h) * hd + i];
            st[hd] = mx[k][h], st[hd + 1] = sum[k][h];
        }
    }
}

/* attend_block for one token. */
static void attend_segment(const attn_ctx *a, int t, int g, int h0, int n_heads, int seg, float *states) {
    float acc[(size_t)n_heads * a->m->head_dim];
    attend_block(a, t, 1, g, h0, n_heads, seg, states, 0, acc);
}

/* run = the fold of q into it: both softmax states of one head, q's positions after run's. */
static void fold_state(float *r, const float *q, int hd) {
    float mx = r[hd] > q[hd] ? r[hd] : q[hd], wr = fm_expf(r[hd] - mx), wq = fm_expf(q[hd] - mx);
    for (int i = 0; i < hd; i++) r[i] = r[i] * wr + q[i] * wq;
    r[hd] = mx, r[hd + 1] = r[hd + 1] * wr + q[hd + 1] * wq;
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
            fold_state(r, q, hd);
        }
        if (seg == n_segments(a->c->tok_pos[t]) - 1) finish_heads(a, t, g, 0, G, run);
    }
}

/* Many (token, KV head) pairs (a long prompt): one task per (block of up to Q_BLOCK
 * consecutive tokens of one sequence, KV head) runs all the block's segments in order,
 * the first into the tokens' running states and each later one folded into them as
 * fold_task folds it (the same sums in the same order, so bitwise what the segment
 * tasks give), then finishes them. No fold regions; the blocks share each K/V chunk. */
#define Q_BLOCK FM_ATTN_Q_BLOCK

typedef struct {
    attn_ctx *a;
    const int *block_first;    /* [blocks + 1]: block b holds tokens [block_first[b], block_first[b + 1]) */
} block_ctx;

static void block_task(void *p, int task, int worker) {
    const block_ctx *bc = p;
    attn_ctx *a = bc->a;
    int nh = a->m->n_head, hd = a->m->head_dim, nkv = a->m->n_head_kv, G = nh / nkv;
    int b = task / nkv, g = task % nkv, t0 = bc->block_first[b], nt = bc->block_first[b + 1] - t0;
    float *acc = a->c->attn_block + (size_t)worker * Q_BLOCK * G * (2 * hd + 2), *part = acc + (size_t)Q_BLOCK * G * hd;
    float *run = a->c->attn_run + ((size_t)t0 * nh + (size_t)g * G) * (hd + 2);
    size_t run_stride = (size_t)nh * (hd + 2), part_stride = (size_t)G * (hd + 2);
    int64_t last = 0;
    for (int k = 0; k < nt; k++) last = a->c->tok_pos[t0 + k] > last ? a->c->tok_pos[t0 + k] : last;
    for (int seg = 0; seg < n_segments(last); seg++) {
        attend_block(a, t0, nt, g, 0, G, seg, seg ? part : run, seg ? part_stride : run_stride, acc);
        for (int k = 0; k < nt && seg; k++) {
            if (n_segments(a->c->tok_pos[t0 + k]) <= seg) continue;
            for (int h = 0; h < G; h++)
                fold_state(head_state(run + k * run_stride, h, hd), head_state(part + k * part_stride, h, hd), hd);
        }
    }
    for (int k = 0; k < nt; k++) finish_heads(a, t0 + k, g, 0, G, run + k * run_stride);
}

/* The blocks of up to qb tokens of the pass, sequence by sequence (a sequence's tokens are
 * consecutive in the pass); block_first must hold T + 1. Returns the number of blocks. */
static int token_blocks(const fm_ctx *c, int T, int qb, int *block_first) {
    int blocks = 0;
    for (int t = 0; t < T; t++)
        if (!blocks || c->tok_seq[t] != c->tok_seq[t - 1] || t - block_first[blocks - 1] == qb)
            block_first[blocks++] = t;
    block_first[blocks] = T;
    return blocks;
}

/* Attention of the pass's T tokens. A long prompt: one task per block of tokens and KV
 * head (block_task), blocks of up to Q_BLOCK tokens but small enough for two tasks a
 * thread (tasks of a pass are about the same size), when some block has more than one
 * token. Otherwise split KV,
 * FM_ATTN_TASKS segment tasks a region; when every token has one segment and there are
 * fewer (token, KV head) pairs than threads, one task per run of query heads instead
 * (heads_task). */
static void attend(fm_ctx *c, attn_ctx *a, int T) {
    int nkv = c->m->n_head_kv;
    int threads = fm_pool_size(c->pool), G = c->m->n_head / nkv;
    int qb = (int)((int64_t)T * nkv / (2 * threads));
    qb = qb < Q_BLOCK ? qb : Q_BLOCK;
    int block_first[T + 1], blocks = qb > 1 ? token_blocks(c, T, qb, block_first) : T;
    if (blocks < T && (int64_t)blocks * nkv >= 2 * threads) {
        block_ctx bc = {a, block_first};
        fm_pool_run(c->pool, block_task, &bc, blocks * nkv);
        return;
    }
    int64_t first[T + 1];
    first[0] = 0;
    int split = 0;
    for (int t = 0; t < T; t++) {
        int S = n_segments(c->tok_pos[t]);
        split |= S > 1;
        first[t + 1] = first[t] + (int64_t)nkv * S;
    }
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
