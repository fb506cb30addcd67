/* Mixture-of-experts block for T tokens (see shared/reference.py: moe).
 * Tokens are grouped by expert, so each selected expert's weights are read once
 * per batch. Scratch: d = router logits [T][E] then shared-gate logits [T];
 * a = expert gate out [pairs][ff] then shared [T][ffs]; b = up, likewise;
 * c = expert down out [pairs][D]; a "pair" is one (expert, token) choice. */
#include <string.h>

#include "ctx.h"
#include "ops.h"

/* Softmax over all experts, top k by probability, renormalised to sum 1. */
static void route(const float *logits, int E, int k, int32_t *ids, float *weights) {
    float max = logits[0], sum = 0.0f;
    for (int e = 1; e < E; e++) max = logits[e] > max ? logits[e] : max;
    float p[E];
    for (int e = 0; e < E; e++) sum += p[e] = expf(logits[e] - max);
    float kept = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
        ids[j] = best;
        weights[j] = p[best] / sum;
        kept += weights[j];
        p[best] = -1.0f;                 /* taken */
    }
    for (int j = 0; j < k; j++) weights[j] /= kept;
}

/* Counting sort of the T*k choices by expert, leaving out those of weight 0 (they add
 * nothing: a hybrid step's choices that the GPU computes); returns the number of experts
 * used, and the pairs kept in *pairs. */
static int group_by_expert(fm_ctx *c, int T, int E, int k, int *first, int *count, int *experts, int *pairs) {
    memset(count, 0, E * sizeof *count);
    for (int i = 0; i < T * k; i++)
        if (c->weights[i] != 0.0f) count[c->ids[i]]++;
    int n_used = 0, off = 0, fill[E];
    for (int e = 0; e < E; e++) {
        first[e] = fill[e] = off;
        off += count[e];
        if (count[e]) experts[n_used++] = e;
    }
    for (int i = 0; i < T * k; i++) {
        if (c->weights[i] == 0.0f) continue;
        int p = fill[c->ids[i]]++;
        c->pair_token[p] = i / k;
        c->pair_slot[p] = i;
    }
    *pairs = off;
    return n_used;
}

static void gather_inputs(fm_ctx *c, int pairs, int D, int fp32) {
    int nb = D / 32;
    for (int p = 0; p < pairs; p++) {
        int t = c->pair_token[p];
        if (nb * 32 == D) memcpy(c->xq2 + (size_t)p * nb, c->xq + (size_t)t * nb, nb * sizeof(block_q8_0));
        if (fp32) memcpy(c->xg + (size_t)p * D, c->xn + (size_t)t * D, D * sizeof(float));
    }
}

void fm_moe_scratch(const fm_model *m, size_t T, size_t floats[FM_SCRATCH]) {
    size_t pairs = T * m->n_expert_used;
    floats[0] = pairs * m->n_ff_exp + T * m->n_ff_shexp;  /* G: the experts' gate (then h), the shared one's after */
    floats[1] = pairs * m->n_ff_exp + T * m->n_ff_shexp;  /* U: their up projections */
    floats[2] = pairs * m->n_embd;                        /* Dn: each (token, expert) pair's output */
    floats[3] = T * (m->n_expert + 1);                    /* the router's logits, the shared expert's gate */
}

/* The routed experts of T tokens whose inputs are c->xn (and quantised, c->xq), routed by
 * c->ids and c->weights: y[t] = scale[t] * y[t] + sum_j weights[t][j] * expert_{ids[t][j]}(x[t]),
 * with y = 0 first where scale is NULL. `extra` (the shared expert's down projection, which
 * writes y, or NULL) runs in the experts' down projections' parallel region. */
static void routed_experts(fm_ctx *c, const fm_layer *l, int T, const fm_job *extra, const float *scale, float *y) {
    const fm_model *m = c->m;
    int D = m->n_embd, E = m->n_expert, k = m->n_expert_used, ff = m->n_ff_exp;
    int pairs;
    float *G = c->scratch[0], *U = c->scratch[1], *Dn = c->scratch[2];   /* as fm_moe_scratch sizes them */
    int fp32 = l->ffn_gate_exps.type == FM_F32;
    /* h = silu(gate) * up comes out of the gate/up regions already quantised for
     * the down projections (F32 weights, in the tiny test models, read h itself). */
    block_q8_0 *hq = ff % FM_QK || l->ffn_down_exps.type == FM_F32 ? NULL : c->hq;

    /* the (token, expert) pairs grouped by expert: each chosen expert's silu(x W_gate) * (x W_up)
     * over its tokens at once */
    int firstp[E], count[E], experts[E];
    int n_used = group_by_expert(c, T, E, k, firstp, count, experts, &pairs);
    c->moe_calls++, c->experts_used += n_used;
    gather_inputs(c, pairs, D, fp32);
    fm_job jobs[E + 1];
    for (int i = 0; i < n_used; i++) {
        int e = experts[i], p = firstp[e];
        jobs[i] = (fm_job){.w = &l->ffn_gate_exps, .mat = e, .x = c->xg + (size_t)p * D,
                           .xq = c->xq2 + (size_t)p * (D / 32), .B = count[e], .y = G + (size_t)p * ff, .ldy = ff,
                           .w_up = &l->ffn_up_exps, .y_up = U + (size_t)p * ff,
                           .hq = hq ? hq + (size_t)p * (ff / 32) : NULL};
    }
    fm_run_jobs(c->pool, jobs, n_used);

    /* their down projections (and the extra job) */
    for (int i = 0; i < n_used; i++) {
        int e = experts[i], p = firstp[e];
        jobs[i] = (fm_job){.w = &l->ffn_down_exps, .mat = e, .x = G + (size_t)p * ff,
                           .xq = hq ? hq + (size_t)p * (ff / 32) : NULL, .B = count[e], .y = Dn + (size_t)p * D,
                           .ldy = D};
    }
    int n_jobs = n_used;
    if (extra) jobs[n_jobs++] = *extra;
    fm_run_jobs(c->pool, jobs, n_jobs);

    if (scale)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < D; i++) y[(size_t)t * D + i] *= scale[t];
    else memset(y, 0, (size_t)T * D * sizeof(float));
    for (int p = 0; p < pairs; p++) {
        int t = c->pair_token[p];
        float w = c->weights[c->pair_slot[p]];
        float *yt = y + (size_t)t * D;
        const float *src = Dn + (size_t)p * D;
        for (int i = 0; i < D; i++) yt[i] += w * src[i];
    }
}

void fm_moe_block(fm_ctx *c, const fm_layer *l, int T) {
    const fm_model *m = c->m;
    int D = m->n_embd, E = m->n_expert, k = m->n_expert_used, ff = m->n_ff_exp, ffs = m->n_ff_shexp;
    int pairs = T * k;
    float **buf = c->scratch;      /* as fm_moe_scratch sizes them */
    float *router = buf[3], *sh_gate = buf[3] + (size_t)T * E;
    float *Gs = buf[0] + (size_t)pairs * ff, *Us = buf[1] + (size_t)pairs * ff;
    block_q8_0 *hsq = ffs % FM_QK || l->ffn_down_shexp.type == FM_F32 ? NULL : c->hq + (size_t)pairs * (ff / 32);
    /* the router's logits = x W_router; the shared expert's silu(x W_gate) * (x W_up) */
    fm_quantize_rows(c->pool, c->xn, c->xq, T, D);
    fm_job first[2] = {
        {.w = &l->ffn_gate_inp, .x = c->xn, .xq = c->xq, .B = T, .y = router, .ldy = E},
        {.w = &l->ffn_gate_shexp, .x = c->xn, .xq = c->xq, .B = T, .y = Gs, .ldy = ffs,
         .w_up = &l->ffn_up_shexp, .y_up = Us, .hq = hsq},
    };
    fm_run_jobs(c->pool, first, ffs ? 2 : 1);
    /* each token's top-k experts and their renormalised softmax weights; its shared expert's gate */
    for (int t = 0; t < T; t++) {
        route(router + (size_t)t * E, E, k, c->ids + (size_t)t * k, c->weights + (size_t)t * k);
        if (ffs) sh_gate[t] = fm_sigmoid(fm_dot(l->ffn_gate_inp_shexp.data, c->xn + (size_t)t * D, D));
    }
    /* y[t] = sigmoid(w_sh . x) * shared(x) + sum_k p_k * expert_k(x) */
    fm_job shared_down = {.w = &l->ffn_down_shexp, .x = Gs, .xq = hsq, .B = T, .y = c->tmp, .ldy = D};
    routed_experts(c, l, T, ffs ? &shared_down : NULL, ffs ? sh_gate : NULL, c->tmp);
}

int fm_routed_experts(fm_ctx *c, int layer, int T, const float *x, const int32_t *ids, const float *weights,
                      float *out) {
    const fm_model *m = c->m;
    if (layer < 0 || layer >= m->n_layer || T < 1 || T > c->max_tokens) return -1;
    const fm_layer *l = &m->layers[layer];
    if (!l->ffn_gate_exps.data || !l->ffn_up_exps.data || !l->ffn_down_exps.data) return -1;
    int D = m->n_embd, k = m->n_expert_used;
    for (int i = 0; i < T * k; i++)
        if (ids[i] < 0 || ids[i] >= m->n_expert) return -1;
    memcpy(c->xn, x, (size_t)T * D * sizeof(float));
    memcpy(c->ids, ids, (size_t)T * k * sizeof(int32_t));
    memcpy(c->weights, weights, (size_t)T * k * sizeof(float));
    fm_quantize_rows(c->pool, c->xn, c->xq, T, D);
    routed_experts(c, l, T, NULL, NULL, out);
    return 0;
}

int fm_moe_rows(fm_ctx *c, int layer, int T, const float *x, float *out, int32_t *ids, float *weights) {
    const fm_model *m = c->m;
    if (layer < 0 || layer >= m->n_layer || T < 1 || T > c->max_tokens) return -1;
    const fm_layer *l = &m->layers[layer];
    if (!l->ffn_gate_exps.data || !l->ffn_up_exps.data || !l->ffn_down_exps.data || !l->ffn_gate_inp.data) return -1;
    int D = m->n_embd, k = m->n_expert_used;
    memcpy(c->xn, x, (size_t)T * D * sizeof(float));
    fm_moe_block(c, l, T);
    memcpy(out, c->tmp, (size_t)T * D * sizeof(float));
    memcpy(ids, c->ids, (size_t)T * k * sizeof(int32_t));
    memcpy(weights, c->weights, (size_t)T * k * sizeof(float));
    return 0;
}
