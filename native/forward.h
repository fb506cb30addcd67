/* The native forward pass: advances one sequence by T tokens (T = 1 for decode,
 * a prompt chunk for CPU prefill) through the whole model, reading weights in
 * place from the mapped GGUF. Python only loops over tokens and samples. */
#ifndef FM_FORWARD_H
#define FM_FORWARD_H

#include "model.h"
#include "threadpool.h"

typedef struct fm_ctx fm_ctx;

/* Scratch for batches of up to max_tokens; NULL on allocation failure. */
fm_ctx *fm_ctx_create(const fm_model *m, fm_pool *pool, int max_tokens);
void fm_ctx_destroy(fm_ctx *c);

/* Runs n_seqs sequences in one pass: counts[i] tokens of seqs[i], at positions
 * seqs[i]->position.., laid out one sequence after the other in tokens (T =
 * sum of counts), and advances each position. One sequence with T tokens is a
 * prompt chunk; n sequences of one token each is a batched decode step: every
 * weight is read once for all of them. Each token's result is bitwise what it
 * would be alone. logits: [T][n_vocab] when all_logits, else [n_seqs][n_vocab],
 * the last token of each sequence; NULL skips the LM head (a prompt chunk whose
 * logits nobody reads). The caller must have allocated KV pages for every
 * position written, and no sequence may appear twice.
 * Returns 0, or -1 if T exceeds max_tokens, a count is < 1 or a token id is out of range. */
int fm_forward(fm_ctx *c, fm_seq *const *seqs, const int32_t *counts, int n_seqs, const int32_t *tokens,
               float *logits, int all_logits);

/* What a pass's tokens carry besides their ids (images, shared/vision/prompt.py):
 * embd_row[t] >= 0 takes token t's input from row embd_row[t] of embd instead of the
 * token embedding; rope_pos[t] is its (t, h, w) M-RoPE position, and frequency pair i
 * of the rotary turns by rope_pos[t][rope_stream[i]] (a position in the sequence still
 * orders the KV and the causal mask). */
typedef struct {
    const float *embd;          /* [rows][n_embd] */
    const int32_t *embd_row;    /* [T] a row of embd, or -1: the token's own embedding */
    const int64_t *rope_pos;    /* [T][3] */
    const int32_t *rope_stream; /* [rope_dim / 2] 0, 1 or 2 */
} fm_inputs;

/* fm_forward with inputs (NULL: text, the positions those of the sequence). */
int fm_forward_inputs(fm_ctx *c, fm_seq *const *seqs, const int32_t *counts, int n_seqs, const int32_t *tokens,
                      const fm_inputs *inputs, float *logits, int all_logits);

/* The routed experts of one MoE layer for T tokens, as fm_forward's MoE block computes them
 * (x quantised to Q8_0 once, the tokens grouped by expert, the same kernels and sums):
 * out[t] = sum_j weights[t][j] * expert_{ids[t][j]}(x[t]), without the router and the shared
 * expert. x: [T][n_embd] the block's input, already normalised; ids, weights: [T][n_expert_used].
 * For a hybrid decode step whose other parts run elsewhere. Returns 0, or -1 if layer is out of
 * range or has no experts, T is outside 1..max_tokens or an id is outside 0..n_expert-1. */
int fm_routed_experts(fm_ctx *c, int layer, int T, const float *x, const int32_t *ids, const float *weights,
                      float *out);
/* The whole MoE block of one layer for T tokens of normalised input x (router, routed and
 * shared experts), and the experts and weights it routed each token to: what fm_forward adds
 * to the residual. Returns 0, or -1 as fm_routed_experts does. */
int fm_moe_rows(fm_ctx *c, int layer, int T, const float *x, float *out, int32_t *ids, float *weights);

/* Wall time spent in each phase since the context was created or last reset:
 * Gated DeltaNet blocks, attention blocks, MoE blocks, LM head, the rest (norms,
 * embedding). For `fermoe bench decode`'s breakdown. */
enum { FM_PHASE_GDN, FM_PHASE_ATTENTION, FM_PHASE_MOE, FM_PHASE_LM_HEAD, FM_PHASE_OTHER, FM_N_PHASES };
void fm_ctx_times(fm_ctx *c, double *seconds, int reset);
/* The same phases' seconds inside the pool's parallel regions, counted while the
 * pool keeps statistics (fm_pool_stats_enable): a phase's time less this is what
 * its caller ran alone, between regions. */
void fm_ctx_region_times(fm_ctx *c, double *seconds, int reset);
/* MoE blocks run and distinct experts they ran, since creation or reset: shows
 * whether a batch's tokens spread over the experts as real routing does. */
void fm_ctx_moe_stats(fm_ctx *c, int64_t *calls, int64_t *experts, int reset);

/* y[i] = e^x[i] as the forward computes it (ops.h: fm_expf), for its tests. */
void fm_exp_rows(const float *x, float *y, size_t n);

#endif
