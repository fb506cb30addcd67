/* moe.cu: routing and grouping of a MoE block's tokens, and the weighted combine.
 * Nothing here is read back by the host: the grouped GEMMs (gemm.cu) take the tile
 * table from device memory, so the copy stream never waits for routing.
 *
 *   moe_route    logits [T, E] -> softmax over all E experts, the top k (largest
 *                first, ties to the lower index), renormalised to sum 1:
 *                topk_ids, topk_w [T, k]; counts[e] += tokens routed to e
 *                (grid: ceil(T / 128), block 128: a thread a token)
 *   moe_tiles    counts -> offsets [E + 1] (exclusive sums), and the tile table:
 *                tile i = (tile_expert, tile_row0, tile_rows), up to bm grouped rows
 *                of one expert; *n_tiles tiles (grid 1, block 1: E steps)
 *   moe_scatter  pair p = t * k + s (token t's s-th expert e): a grouped row
 *                pos = offsets[e] + (arrival order within e), pair_token[pos] = t,
 *                pair_pos[p] = pos (grid: ceil(P / 256), block 256). The order within
 *                an expert varies run to run; no result depends on it (each grouped
 *                row is computed on its own, and the combine reads by pair).
 *   moe_combine  h[t] += sum_s topk_w[t, s] y[pair_pos[t * k + s]]
 *                       + sigmoid(x[t] . shared_gate) shared_out[t]
 *                (shared_out NULL: no shared expert; grid T, block 256) */
#include "prelude.cuh"
#include "reduce.cuh"

FM_KERNEL void moe_route(int *topk_ids, float *topk_w, int *counts, const float *logits, int T, int E, int k)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float *l = logits + (long long)t * E;
    float mx = l[0];
    for (int e = 1; e < E; e++) mx = fmaxf(mx, l[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; e++) sum += fm_expf(l[e] - mx);
    int *ids = topk_ids + (long long)t * k;
    float *w = topk_w + (long long)t * k;
    float kept = 0.0f;
    for (int s = 0; s < k; s++) {          /* the s-th largest: strictly below the last one taken */
        int best = -1;
        for (int e = 0; e < E; e++) {
            bool taken = false;
            for (int r = 0; r < s; r++) taken |= ids[r] == e;
            if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        ids[s] = best;
        w[s] = fm_expf(l[best] - mx) / sum;
        kept += w[s];
        atomicAdd(&counts[best], 1);
    }
    for (int s = 0; s < k; s++) w[s] /= kept;
}

FM_KERNEL void moe_tiles(int *offsets, int *tile_expert, int *tile_row0, int *tile_rows, int *n_tiles,
                         const int *counts, int E, int bm, int max_tiles)
{
    int n = 0, row = 0;
    for (int e = 0; e < E; e++) {
        offsets[e] = row;
        for (int r = 0; r < counts[e] && n < max_tiles; r += bm, n++) {
            tile_expert[n] = e;
            tile_row0[n] = row + r;
            tile_rows[n] = fm_mini(bm, counts[e] - r);
        }
        row += counts[e];
    }
    offsets[E] = row;
    *n_tiles = n;
}

FM_KERNEL void moe_scatter(int *pair_token, int *pair_pos, int *cursor, const int *offsets, const int *topk_ids,
                           int P, int k)
{
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P) return;
    int e = topk_ids[p];
    int pos = offsets[e] + atomicAdd(&cursor[e], 1);
    pair_token[pos] = p / k;
    pair_pos[p] = pos;
}

#define FM_COMBINE_THREADS 256

FM_KERNEL void moe_combine(float *h, const float *y, const float *topk_w, const int *pair_pos, const float *shared_out,
                           const float *x, const float *shared_gate, int T, int d, int k)
{
    __shared__ float scratch[FM_COMBINE_THREADS];
    int t = blockIdx.x;
    float sg = 0.0f;
    if (shared_out) {
        float dot = 0.0f;
        for (int i = threadIdx.x; i < d; i += blockDim.x) dot = fm_fma(x[(long long)t * d + i], shared_gate[i], dot);
        sg = fm_sigmoidf(fm_block_sum(dot, scratch));
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < k; s++)
            acc = fm_fma(topk_w[(long long)t * k + s], y[(long long)pair_pos[(long long)t * k + s] * d + i], acc);
        if (shared_out) acc = fm_fma(sg, shared_out[(long long)t * d + i], acc);
        h[(long long)t * d + i] += acc;
    }
}
