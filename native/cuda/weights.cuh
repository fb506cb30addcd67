/* weights.cuh: reading weight rows in the ggml types the GPU keeps them in.
 *
 * Weights stay in their file type in VRAM and over PCIe (Q4_0 is 4.5 bits an
 * element) and are dequantised as they are read. A row of K elements is
 * fm_row_bytes(type, K) bytes; Q4_0 / Q8_0 rows are K / 32 blocks of 18 / 34
 * bytes (fermoe_blocks.h), so only 2-byte aligned: they are read with 16-bit
 * loads. Types are ggml's numbers. */
#ifndef FM_WEIGHTS_CUH
#define FM_WEIGHTS_CUH

#include "prelude.cuh"
#include "../fermoe_blocks.h"

#define FM_W_F32 0
#define FM_W_F16 1
#define FM_W_Q4_0 2
#define FM_W_Q8_0 8

FM_DEVICE long long fm_row_bytes(int type, int k)
{
    switch (type) {
    case FM_W_F16: return 2LL * k;
    case FM_W_Q4_0: return (long long)(k / FM_QK) * 18;
    case FM_W_Q8_0: return (long long)(k / FM_QK) * 34;
    default: return 4LL * k;
    }
}

/* A quarter of one 32-element block of a row: quarter q (0..3) of block kb, eight
 * values. Which elements they are depends on the type (fm_quarter_k): Q4_0 packs
 * element j and j + 16 in one byte, so its quarter q holds 4q..4q+3 and
 * 16+4q..16+4q+3; the others hold 8q..8q+7. Elements at or past K read as 0 (F32
 * and F16 rows need not be whole blocks). */
template <int WT>
FM_DEVICE int fm_quarter_k(int q, int i)
{
    return WT == FM_W_Q4_0 ? (i < 4 ? 4 * q + i : 16 + 4 * q + (i - 4)) : 8 * q + i;
}

template <int WT>
FM_DEVICE void fm_quarter(const uint8_t *row, int kb, int q, int K, float v[8])
{
    if (WT == FM_W_Q4_0) {
        const uint16_t *b = (const uint16_t *)(row + (long long)kb * 18);
        float d = fm_fp16_to_fp32(b[0]);
        unsigned lo = b[1 + 2 * q], hi = b[2 + 2 * q];
        unsigned bytes[4] = {lo & 0xffu, lo >> 8, hi & 0xffu, hi >> 8};
        for (int i = 0; i < 4; i++) {
            v[i] = (float)((int)(bytes[i] & 15u) - 8) * d;
            v[4 + i] = (float)((int)(bytes[i] >> 4) - 8) * d;
        }
    } else if (WT == FM_W_Q8_0) {
        const uint16_t *b = (const uint16_t *)(row + (long long)kb * 34);
        float d = fm_fp16_to_fp32(b[0]);
        for (int i = 0; i < 4; i++) {
            unsigned pair = b[1 + 4 * q + i];
            v[2 * i] = (float)(int8_t)(pair & 0xffu) * d;
            v[2 * i + 1] = (float)(int8_t)(pair >> 8) * d;
        }
    } else if (WT == FM_W_F16) {
        const uint16_t *h = (const uint16_t *)row;
        int k0 = kb * FM_QK + 8 * q;
        for (int i = 0; i < 8; i++) v[i] = k0 + i < K ? fm_fp16_to_fp32(h[k0 + i]) : 0.0f;
    } else {
        const float *f = (const float *)row;
        int k0 = kb * FM_QK + 8 * q;
        for (int i = 0; i < 8; i++) v[i] = k0 + i < K ? f[k0 + i] : 0.0f;
    }
}

/* Element k of a row, any type (the embedding lookup: one row a token). */
FM_DEVICE float fm_weight_at(const uint8_t *row, int type, int k)
{
    int kb = k / FM_QK, j = k % FM_QK;
    switch (type) {
    case FM_W_Q4_0: {
        const uint8_t *b = row + (long long)kb * 18;
        float d = fm_fp16_to_fp32((uint16_t)(b[0] | b[1] << 8));
        int byte = b[2 + (j & 15)];
        return (float)((j < 16 ? byte & 15 : byte >> 4) - 8) * d;
    }
    case FM_W_Q8_0: {
        const uint8_t *b = row + (long long)kb * 34;
        return (float)(int8_t)b[2 + j] * fm_fp16_to_fp32((uint16_t)(b[0] | b[1] << 8));
    }
    case FM_W_F16: return fm_fp16_to_fp32(((const uint16_t *)row)[k]);
    default: return ((const float *)row)[k];
    }
}

#endif /* FM_WEIGHTS_CUH */
