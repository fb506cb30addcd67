/* embed.cu: embedding rows, dequantised: out[t] = W[tokens[t]]  (W [vocab, n] in
 * ggml type `type`: f32, f16, q4_0, q8_0; out [T, n] fp32).
 * grid: T; block: 256 threads over the row. */
#include "prelude.cuh"
#include "weights.cuh"

FM_KERNEL void embed_rows(float *out, const uint8_t *W, const int *tokens, int T, int n, int type)
{
    int t = blockIdx.x;
    const uint8_t *row = W + (long long)tokens[t] * fm_row_bytes(type, n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[(long long)t * n + i] = fm_weight_at(row, type, i);
}
