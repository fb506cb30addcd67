/* The layer loop: h += mixer(norm1(h)); h += moe(norm2(h)); then the LM head. */
#include <stdlib.h>
#include <string.h>

#include "ctx.h"
#include "ops.h"

void fm_ctx_times(fm_ctx *c, double *seconds, int reset) {
    for (int i = 0; i < FM_N_PHASES; i++) {
        seconds[i] = c->seconds[i];
        if (reset) c->seconds[i] = 0.0;
    }
}

void fm_ctx_region_times(fm_ctx *c, double *seconds, int reset) {
    for (int i = 0; i < FM_N_PHASES; i++) {
        seconds[i] = c->region_seconds[i];
        if (reset) c->region_seconds[i] = 0.0;
    }
}

/* Closes a phase begun at t0: its wall time, and the region seconds the pool
 * counted meanwhile. Returns the next phase's start. */
static double phase_end(fm_ctx *c, int phase, double t0) {
    double t1 = fm_now(), regions = fm_pool_region_seconds(c->pool);
    c->seconds[phase] += t1 - t0;
    c->region_seconds[phase] += regions - c->regions_at;
    c->regions_at = regions;
    return t1;
}

void fm_ctx_moe_stats(fm_ctx *c, int64_t *calls, int64_t *experts, int reset) {
    *calls = c->moe_calls, *experts = c->experts_used;
    if (reset) c->moe_calls = c->experts_used = 0;
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

fm_ctx *fm_ctx_create(const fm_model *m, fm_pool *pool, int max_tokens) {
    fm_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->m = m, c->pool = pool, c->max_tokens = max_tokens;
    size_t T = max_tokens, D = m->n_embd, k = m->n_expert_used;
    size_t d_inner = (size_t)m->ssm_v_heads * m->ssm_head_v_dim;
    size_t ff = m->n_ff_exp, ffs = m->n_ff_shexp;
    size_t widest = max3(max3(D, d_inner, (size_t)m->n_head * m->head_dim), ff, ffs);
    c->x = malloc(T * D * sizeof(float));
    c->xn = malloc(T * D * sizeof(float));
    c->tmp = malloc(T * D * sizeof(float));
    size_t need[3][FM_SCRATCH], scratch_ok = 1;      /* each block's rule; the buffers hold the largest */
    fm_gdn_scratch(m, T, need[0]), fm_attention_scratch(m, T, need[1]), fm_moe_scratch(m, T, need[2]);
    for (int i = 0; i < FM_SCRATCH; i++) {
        c->scratch[i] = malloc((max3(need[0][i], need[1][i], need[2][i]) + 1) * sizeof(float));   /* never 0 bytes */
        scratch_ok = scratch_ok && c->scratch[i];
    }
    c->xq = malloc(T * (widest / 32) * sizeof(block_q8_0));
    c->xq2 = malloc(T * k * (D / 32) * sizeof(block_q8_0) + 1);
    c->hq = malloc(T * (k * (ff / 32) + ffs / 32) * sizeof(block_q8_0) + 1);
    c->xg = malloc(T * k * max3(D, ff, 0) * sizeof(float));
    size_t softmax_state = (size_t)(m->head_dim + 2) * sizeof(float);   /* one query head's, attention.c */
    c->attn_part = malloc((size_t)FM_ATTN_TASKS * (m->n_head / m->n_head_kv) * softmax_state);
    c->attn_run = malloc(T * m->n_head * softmax_state);
    c->attn_block = malloc((size_t)fm_pool_size(pool) * FM_ATTN_Q_BLOCK * (m->n_head / m->n_head_kv) *
                           (2 * m->head_dim + 2) * sizeof(float));
    c->ids = malloc(T * k * sizeof(int32_t));
    c->weights = malloc(T * k * sizeof(float));
    c->pair_token = malloc(T * k * sizeof(int32_t));
    c->pair_slot = malloc(T * k * sizeof(int32_t));
    c->seq_first = malloc(T * sizeof(int32_t));
    c->seq_count = malloc(T * sizeof(int32_t));
    c->tok_seq = malloc(T * sizeof(int32_t));
    c->tok_pos = malloc(T * sizeof(int64_t));
    if (!scratch_ok || !c->x || !c->xn || !c->tmp || !c->xq || !c->xq2 || !c->hq || !c->xg ||
        !c->ids || !c->weights || !c->pair_token || !c->pair_slot || !c->seq_first || !c->seq_count || !c->tok_seq ||
        !c->tok_pos || !c->attn_part || !c->attn_run || !c->attn_block) {
        fm_ctx_destroy(c);
        return NULL;
    }
    return c;
}

void fm_ctx_destroy(fm_ctx *c) {
    if (!c) return;
    for (int i = 0; i < FM_SCRATCH; i++) free(c->scratch[i]);
    void *bufs[] = {c->x, c->xn, c->tmp, c->xq, c->xq2, c->hq, c->xg, c->ids,
                    c->weights, c->pair_token, c->pair_slot, c->seq_first, c->seq_count, c->tok_seq, c->tok_pos,
                    c->attn_part, c->attn_run, c->attn_block};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    free(c);
}

static void norm_rows(const fm_ctx *c, float *y, const float *x, const fm_tensor *w, int T) {
    int D = c->m->n_embd;
    for (int t = 0; t < T; t++) fm_rmsnorm(y + (size_t)t * D, x + (size_t)t * D, w->data, D, c->m->rms_eps);
}

static void add_rows(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* Logits of every token, or of the last token of each sequence. */
static void lm_head(fm_ctx *c, int T, float *logits, int all_logits) {
    const fm_model *m = c->m;
    int D = m->n_embd, rows = all_logits ? T : c->n_seqs;
    for (int r = 0; r < rows; r++) {
        int t = all_logits ? r : c->seq_first[r] + c->seq_count[r] - 1;
        fm_rmsnorm(c->xn + (size_t)r * D, c->x + (size_t)t * D, m->output_norm.data, D, m->rms_eps);
    }
    if (m->output.type != FM_F32) fm_quantize_rows(c->pool, c->xn, c->xq, rows, D);
    fm_job job = {.w = &m->output, .x = c->xn, .xq = c->xq, .B = rows, .y = logits, .ldy = m->n_vocab};
    fm_run_jobs(c->pool, &job, 1);
}

/* Lays out the pass: which sequence and position each token has. */
static int plan(fm_ctx *c, fm_seq *const *seqs, const int32_t *counts, int n_seqs) {
    if (n_seqs < 1 || n_seqs > c->max_tokens) return -1;
    int T = 0;
    for (int i = 0; i < n_seqs; i++) {
        if (counts[i] < 1 || counts[i] > c->max_tokens - T) return -1;
        c->seq_first[i] = T, c->seq_count[i] = counts[i];
        for (int j = 0; j < counts[i]; j++, T++) c->tok_seq[T] = i, c->tok_pos[T] = seqs[i]->position + j;
    }
    c->seqs = seqs, c->n_seqs = n_seqs;
    return T;
}

int fm_forward(fm_ctx *c, fm_seq *const *seqs, const int32_t *counts, int n_seqs, const int32_t *tokens,
               float *logits, int all_logits) {
    return fm_forward_inputs(c, seqs, counts, n_seqs, tokens, NULL, logits, all_logits);
}

int fm_forward_inputs(fm_ctx *c, fm_seq *const *seqs, const int32_t *counts, int n_seqs, const int32_t *tokens,
                      const fm_inputs *inputs, float *logits, int all_logits) {
    const fm_model *m = c->m;
    int T = plan(c, seqs, counts, n_seqs);
    if (T < 1) return -1;
    for (int t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->n_vocab) return -1;
    if (inputs && (!inputs->rope_pos || !inputs->rope_stream || !inputs->embd_row)) return -1;
    int D = m->n_embd;
    double t0 = fm_now();
    c->regions_at = fm_pool_region_seconds(c->pool);
    c->inputs = inputs;
    /* x = the tokens' embeddings (an image's rows: the vision tower's) */
    for (int t = 0; t < T; t++) {
        int32_t row = inputs ? inputs->embd_row[t] : -1;
        if (row >= 0) memcpy(c->x + (size_t)t * D, inputs->embd + (size_t)row * D, (size_t)D * sizeof(float));
        else fm_dequant_row(&m->token_embd, tokens[t], c->x + (size_t)t * D);
    }
    for (int i = 0; i < m->n_layer; i++) {
        const fm_layer *l = &m->layers[i];
        /* x += mixer(rmsnorm(x)): gated attention every few layers, Gated DeltaNet between */
        norm_rows(c, c->xn, c->x, &l->attn_norm, T);
        t0 = phase_end(c, FM_PHASE_OTHER, t0);
        if (l->is_attention) fm_attention_block(c, l, T);
        else fm_gdn_block(c, l, T);
        t0 = phase_end(c, l->is_attention ? FM_PHASE_ATTENTION : FM_PHASE_GDN, t0);
        add_rows(c->x, c->tmp, (size_t)T * D);
        /* x += moe(rmsnorm(x)): the routed experts and the shared one */
        norm_rows(c, c->xn, c->x, &l->post_attention_norm, T);
        t0 = phase_end(c, FM_PHASE_OTHER, t0);
        fm_moe_block(c, l, T);
        t0 = phase_end(c, FM_PHASE_MOE, t0);
        add_rows(c->x, c->tmp, (size_t)T * D);
    }
    /* logits = rmsnorm(x) W_output, of every token or each sequence's last */
    if (logits) lm_head(c, T, logits, all_logits);
    phase_end(c, logits ? FM_PHASE_LM_HEAD : FM_PHASE_OTHER, t0);
    for (int i = 0; i < n_seqs; i++) seqs[i]->position += counts[i];
    c->inputs = NULL;
    return 0;
}

void fm_exp_rows(const float *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = fm_expf(x[i]);
}
