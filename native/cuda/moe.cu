/* moe.cu: routing and grouping of a MoE block's tokens, and the weighted combine.
 * Nothing here is read back by the host: the grouped GEMMs (gemm.cu) take the tile
 * table from device memory, so the copy stream never waits for routing.
 *
 *   moe_route    logits [T, E] -> softmax over all E experts, the top k (largest
 *                first, ties to the lower index), renormalised to sum 1:
 *                topk_ids, topk_w [T, k]; counts[e] += tokens routed to e
 *                (grid: T, block 128: a token's experts in shared memory, k block-wide
 *                argmaxes; E <= 1024)
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

#define FM_ROUTE_THREADS 128
#define FM_MAX_EXPERTS 1024

/* The larger of two (value, index) pairs; equal values: the lower index. */
FM_DEVICE bool fm_better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

FM_KERNEL void moe_route(int *topk_ids, float *topk_w, int *counts, const float *logits, int T, int E, int k)
{
    __shared__ float l[FM_MAX_EXPERTS];
    __shared__ float rv[FM_ROUTE_THREADS];
    __shared__ int ri[FM_ROUTE_THREADS];
    __shared__ float scratch[FM_ROUTE_THREADS];
    int t = blockIdx.x, tid = threadIdx.x;
    const float *lt = logits + (long long)t * E;
    float mx = fm_neg_inf();
    for (int e = tid; e < E; e += blockDim.x) {
        l[e] = lt[e];
        mx = fmaxf(mx, l[e]);
    }
    rv[tid] = mx;
    __syncthreads();
    for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
        if (tid < h) rv[tid] = fmaxf(rv[tid], rv[tid + h]);
        __syncthreads();
    }
    mx = rv[0];
    __syncthreads();
    float part = 0.0f;
    for (int e = tid; e < E; e += blockDim.x) part += fm_expf(l[e] - mx);
    float sum = fm_block_sum(part, scratch);
    float kept = 0.0f;
    for (int s = 0; s < k; s++) {           /* the s-th largest: a block-wide argmax, ties to the lower index */
        float bv = fm_neg_inf();
        int bi = E;
        for (int e = tid; e < E; e += blockDim.x)
            if (fm_better(l[e], e, bv, bi)) bv = l[e], bi = e;
        rv[tid] = bv;
        ri[tid] = bi;
        __syncthreads();
        for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
            if (tid < h && fm_better(rv[tid + h], ri[tid + h], rv[tid], ri[tid])) {
                rv[tid] = rv[tid + h];
                ri[tid] = ri[tid + h];
            }
            __syncthreads();
        }
        if (tid == 0) {
            int best = ri[0];
            float p = fm_expf(l[best] - mx) / sum;
            topk_ids[(long long)t * k + s] = best;
            topk_w[(long long)t * k + s] = p;
            kept += p;
            atomicAdd(&counts[best], 1);
            l[best] = fm_neg_inf();          /* taken */
        }
        __syncthreads();
    }
    if (tid == 0)
        for (int s = 0; s < k; s++) topk_w[(long long)t * k + s] /= kept;
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
