/* Internal: the forward context and the per-block functions it calls. */
#ifndef FM_CTX_H
#define FM_CTX_H

#include "fermoe_blocks.h"
#include "forward.h"
#include "linear.h"

enum { FM_SCRATCH = 4 };           /* scratch buffers the blocks share (fm_ctx.scratch) */

struct fm_ctx {
    const fm_model *m;
    fm_pool *pool;
    int max_tokens;
    float *x, *xn, *tmp;            /* [T][n_embd] residual, normed input, block output */
    block_q8_0 *xq;                 /* [T][widest input / 32] quantised activations */
    /* The blocks' activations between their projections. One block runs at a time, so they
     * share FM_SCRATCH buffers: each block names its views of them (gdn.c, attention.c,
     * moe.c) and says how many floats of each it needs (fm_*_scratch below); fm_ctx_create
     * gives each buffer the most any block asks. */
    float *scratch[FM_SCRATCH];
    int32_t *ids;                   /* MoE routing: [T][k] experts */
    float *weights;                 /* [T][k] routing weights */
    int32_t *pair_token, *pair_slot;/* MoE: token and top-k slot of each (expert, token) pair */
    block_q8_0 *xq2;                /* second quantised buffer (gathered expert inputs) */
    block_q8_0 *hq;                 /* quantised expert hidden states [T*k][ff/32], then shared [T][ffs/32] */
    float *xg;                      /* gathered fp32 expert inputs [T*k][n_embd] (F32 experts only) */
    float *attn_part;               /* attention: softmax states of segment tasks [FM_ATTN_TASKS][n_head/kv][hd+2] */
    float *attn_run;                /* and the merged one of each (token, KV head) [T][n_head][hd+2] */
    float *attn_block;              /* per pool thread: a token block's acc [FM_ATTN_Q_BLOCK][G][hd] and
                                     * one segment's states [FM_ATTN_Q_BLOCK][G][hd+2] (attention.c) */
    /* the pass in progress: sequence i holds tokens [seq_first[i], seq_first[i] + seq_count[i]) */
    fm_seq *const *seqs;
    int n_seqs;
    int32_t *seq_first, *seq_count; /* [max_tokens] */
    int32_t *tok_seq;               /* [max_tokens] the sequence of each token */
    int64_t *tok_pos;               /* [max_tokens] the position of each token */
    const fm_inputs *inputs;        /* images and M-RoPE positions of the pass's tokens, or NULL */
    double seconds[FM_N_PHASES];    /* where the time went, by phase (fm_ctx_times) */
    double region_seconds[FM_N_PHASES]; /* of which inside parallel regions (fm_ctx_region_times) */
    double regions_at;              /* the pool's region seconds at the last phase boundary */
    int64_t moe_calls, experts_used; /* distinct experts a MoE block ran, summed (fm_ctx_moe_stats) */
};

enum { FM_ATTN_TASKS = 256 };      /* attention segment tasks per parallel region (attention.c) */
enum { FM_ATTN_Q_BLOCK = 16 };     /* a long prompt's tokens attend in blocks of at most this many */

/* Floats of each scratch buffer a block needs for passes of T tokens. */
void fm_gdn_scratch(const fm_model *m, size_t T, size_t floats[FM_SCRATCH]);
void fm_attention_scratch(const fm_model *m, size_t T, size_t floats[FM_SCRATCH]);
void fm_moe_scratch(const fm_model *m, size_t T, size_t floats[FM_SCRATCH]);

void fm_gdn_block(fm_ctx *c, const fm_layer *l, int T);
void fm_attention_block(fm_ctx *c, const fm_layer *l, int T);
void fm_moe_block(fm_ctx *c, const fm_layer *l, int T);

#endif
