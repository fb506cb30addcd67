/* The model and sequence as the native forward sees them. Python fills these
 * structs with pointers into the memory-mapped GGUF and into the SequenceState
 * buffers (shared/state.py); nothing is copied or converted here. */
#ifndef FM_MODEL_H
#define FM_MODEL_H

#include <stdint.h>

/* ggml type ids of the tensors the native engine computes with */
enum { FM_F32 = 0, FM_F16 = 1, FM_Q4_0 = 2, FM_Q8_0 = 8 };

typedef struct {
    const void *data;       /* raw bytes; NULL when absent */
    int32_t type;           /* FM_F32, FM_Q4_0 or FM_Q8_0 (vectors are always F32) */
    int32_t rows, cols;     /* of one matrix */
    int64_t mat_stride;     /* bytes from one expert's matrix to the next (3-D tensors) */
} fm_tensor;

typedef struct {
    int32_t is_attention;
    fm_tensor attn_norm, post_attention_norm;
    /* Gated DeltaNet */
    fm_tensor attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_conv1d, ssm_dt, ssm_a, ssm_norm, ssm_out;
    int32_t gdn_slot;                       /* index into the state's S / conv arrays */
    /* gated attention */
    fm_tensor attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm;
    int32_t attn_slot;                      /* index into the KV page tables */
    /* MoE */
    fm_tensor ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps;
    fm_tensor ffn_gate_inp_shexp, ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp;
} fm_layer;

enum { FM_MAX_CONV_KERNEL = 16 };          /* longest ssm.conv_kernel the engine takes */

typedef struct {
    int32_t n_layer, n_embd, n_vocab;
    float rms_eps;
    int32_t n_head, n_head_kv, head_dim, rope_dim;
    float rope_theta;
    int32_t ssm_conv_kernel, ssm_k_heads, ssm_v_heads, ssm_head_k_dim, ssm_head_v_dim;
    int32_t v_heads_tiled;                  /* value head j reads key head j % k_heads (else j / ratio) */
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    fm_tensor token_embd, output_norm, output;
    fm_layer *layers;
} fm_model;

/* One sequence's state (layout of shared/state.py) and KV page tables. */
typedef struct {
    float *ssm;                 /* [n_gdn][v_heads][k_dim][v_dim] */
    float *conv;                /* [n_gdn][kernel-1][conv_channels], oldest first */
    void *const *k_pages;       /* [n_attn][max_pages] -> page [block][n_head_kv][head_dim] of kv_type */
    void *const *v_pages;
    int32_t max_pages, block;
    int32_t kv_type;            /* FM_F16 or FM_F32: the elements of the KV pages */
    int64_t position;           /* tokens already in the state */
} fm_seq;

#endif
