"""Each CUDA kernel (native/cuda) against the numpy reference, on random data of odd
sizes, in the host emulation (no GPU needed); on a machine with a GPU,
FERMOE_GPU= unset and `-m gpu` run the same tests on the device (tests/gpu_device.py)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.buffers import DeviceArray
from gpu_worker.kernels import DENSE_BM, LaunchError
from gpu_worker.ops import CHUNK, AttnHeads, GDNHeads, dense_tiling, moe_tile_rows, moe_useful_fraction
from gpu_worker.workspace import ChunkWork, MoeGroups
from shared import reference as R
from shared.ggml_types import GGMLType
from shared.quants import dequantize, quantize
from tests.support.gpu_device import assert_close, ops  # noqa: F401  (ops: the fixture)

# fp32 kernels against fp32 numpy: only the order of sums differs (and on a GPU the
# hardware exp2/log2, ~2 ulp), relative to the largest value.
KERNEL_RTOL = 2e-5
# The chunked recurrence inverts a 64x64 triangle in fp32: a few ulp per step.
CHUNK_RTOL = 1e-4
TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q4_0": GGMLType.Q4_0, "q8_0": GGMLType.Q8_0}


def close(got, want, rtol=KERNEL_RTOL):
    assert_close(got, want, rtol)


def dev(ops, host):
    return DeviceArray.of(ops.device, np.ascontiguousarray(host))


def empty(ops, shape, dtype=np.float32):
    return DeviceArray.empty(ops.device, shape, dtype)


def quantized(rng, shape, kind):
    raw = quantize(rng.standard_normal(shape).astype(np.float32), TYPES[kind]).reshape(-1)
    return raw, dequantize(raw, TYPES[kind], shape)


# ---- rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TYPES)
def test_embed_rows(ops, kind):
    rng = np.random.default_rng(1)
    raw, table = quantized(rng, (37, 96), kind)
    tokens = np.array([5, 0, 36, 5, 17], np.int32)
    out = empty(ops, (5, 96))
    ops.embed(out, dev(ops, raw), dev(ops, tokens), 5, 96, kind)
    np.testing.assert_array_equal(out.download(), table[tokens])


def test_rmsnorm_strided_and_in_place(ops):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 310)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    y = empty(ops, (7, 300))
    ops.rmsnorm(y, dev(ops, x), dev(ops, w), 7, 300, 1e-6, ldx=310)
    close(y.download(), R.rms_norm(x[:, :300], w, 1e-6))
    ops.rmsnorm(y, y, dev(ops, w), 7, 300, 1e-6)
    close(y.download(), R.rms_norm(R.rms_norm(x[:, :300], w, 1e-6), w, 1e-6))


def test_rmsnorm_gated(ops):
    rng = np.random.default_rng(3)
    x, z = rng.standard_normal((2, 9, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    y = empty(ops, (9, 48))
    ops.rmsnorm_gated(y, dev(ops, x), dev(ops, z), dev(ops, w), 9, 48, 1e-6)
    close(y.download(), R.rms_norm(x, w, 1e-6) * R.silu(z))


# ---- products ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("M, N, K", [(70, 97, 96), (1, 64, 32), (130, 5, 320), (300, 1100, 64), (70, 40, 608)])
# 300 x 1100: 128-wide tiles; N <= 64: the narrow kernel (K past several 256-steps)
def test_gemm(ops, kind, M, N, K):
    rng = np.random.default_rng(M + N)
    raw, W = quantized(rng, (N, K), kind)
    A = rng.standard_normal((M, K)).astype(np.float32)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    C = dev(ops, C0)
    ops.gemm(C, dev(ops, A), dev(ops, raw), M, N, K, kind)
    close(C.download(), A @ W.T)
    C.upload(C0)
    ops.gemm(C, dev(ops, A), dev(ops, raw), M, N, K, kind, accumulate=True)
    close(C.download(), C0 + A @ W.T)


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_gemm_rows_not_whole_blocks(ops, kind):
    """F32 and F16 rows need not be a whole number of 32-element blocks."""
    rng = np.random.default_rng(4)
    W = rng.standard_normal((33, 50)).astype(np.float32)
    raw = quantize(W, TYPES[kind]).reshape(-1)
    A = rng.standard_normal((3, 50)).astype(np.float32)
    C = empty(ops, (3, 33))
    ops.gemm(C, dev(ops, A), dev(ops, raw), 3, 33, 50, kind)
    close(C.download(), A @ dequantize(raw, TYPES[kind], (33, 50)).T)


@pytest.mark.parametrize("kind", ["q4_0", "f32"])
@pytest.mark.parametrize("M", [67, 300])
def test_gemm_swiglu_and_accumulate(ops, kind, M):
    """An FFN's down projection: A's rows are [gate | up], the product reads silu(gate) * up."""
    rng = np.random.default_rng(5)
    raw, W = quantized(rng, (1100, 64), kind)
    A = rng.standard_normal((M, 128)).astype(np.float32)
    C0 = rng.standard_normal((M, 1100)).astype(np.float32)
    C = dev(ops, C0)
    ops.gemm(C, dev(ops, A), dev(ops, raw), M, 1100, 64, kind, accumulate=True, swiglu=True)
    close(C.download(), C0 + (R.silu(A[:, :64]) * A[:, 64:]) @ W.T)


@pytest.mark.parametrize("bm", DENSE_BM)
@pytest.mark.parametrize("kind", TYPES)
def test_gemm_every_tile_height(ops, kind, bm):
    """Each tile height on odd sizes: a partial last row tile (whole warps past its end
    skip their FMAs), a partial column tile, F32 / F16 K not a whole 16-step; then the
    SwiGLU down projection with accumulate."""
    rng = np.random.default_rng(bm)
    M, N, K = 77, 131, 96 if kind in ("q4_0", "q8_0") else 83
    raw, W = quantized(rng, (N, K), kind)
    A = rng.standard_normal((M, 2 * K)).astype(np.float32)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    C = empty(ops, (M, N))
    ops.gemm(C, dev(ops, A[:, :K]), dev(ops, raw), M, N, K, kind, bm=bm)
    close(C.download(), A[:, :K] @ W.T)
    C.upload(C0)
    ops.gemm(C, dev(ops, A), dev(ops, raw), M, N, K, kind, accumulate=True, swiglu=True, bm=bm)
    close(C.download(), C0 + (R.silu(A[:, :K]) * A[:, K:]) @ W.T)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("bm, splits, K", [(32, 3, 160), (64, 2, 96), (128, 4, 320)])
def test_gemm_split_k(ops, kind, bm, splits, K):
    """K cut into parts (the last one short), each part's partial sums summed in order
    into C: plain, then the SwiGLU down projection with accumulate."""
    rng = np.random.default_rng(bm + K)
    M, N = 45, 139
    raw, W = quantized(rng, (N, K), kind)
    A = rng.standard_normal((M, 2 * K)).astype(np.float32)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    C = empty(ops, (M, N))
    ops.split_scratch = empty(ops, (splits * M * N,))
    try:
        ops.gemm(C, dev(ops, A[:, :K]), dev(ops, raw), M, N, K, kind, bm=bm, splits=splits)
        close(C.download(), A[:, :K] @ W.T)
        C.upload(C0)
        ops.gemm(C, dev(ops, A), dev(ops, raw), M, N, K, kind, accumulate=True, swiglu=True, bm=bm, splits=splits)
        close(C.download(), C0 + (R.silu(A[:, :K]) * A[:, K:]) @ W.T)
    finally:
        ops.split_scratch = None


def test_dense_tiling_by_shape():
    """Large outputs take the tallest tile unsplit; a grid short of the SMs' two blocks
    each is split along K (parts of 16 steps at least) within the scratch, preferring
    taller tiles cut more; with no scratch, short tiles instead."""
    big = 1 << 22
    assert dense_tiling(947, 8192, 2048, 132, big) == (128, 1)
    assert dense_tiling(8192, 2048, 4096, 132, big) == (128, 1)
    assert dense_tiling(947, 2048, 4096, 132, big) == (128, 2)        # 128 tiles
    assert dense_tiling(947, 512, 2048, 132, big) == (128, 8)         # attention's K: 32 tiles
    assert dense_tiling(947, 2048, 512, 132, big) == (128, 2)         # K of 2 x 16 steps
    assert dense_tiling(947, 512, 2048, 132, 0) == (32, 1)
    assert dense_tiling(947, 512, 2048, 132, 2 * 947 * 512)[1] <= 2
    assert dense_tiling(947, 128, 256, 132, big)[1] == 1              # 16 steps in all
    for M, N, K in [(61, 1024, 2048), (5, 3000, 64), (1, 248320, 2048)]:
        bm, splits = dense_tiling(M, N, K, 132, big)
        assert bm in DENSE_BM and splits * 16 * 16 <= max(K, 256)


def test_gemm_refuses_a_tile_height_it_lacks(ops):
    with pytest.raises(LaunchError, match="tiles of 48 rows"):
        ops.gemm(empty(ops, (4, 4)), empty(ops, (4, 32)), empty(ops, (4, 32)), 4, 4, 32, "f32", bm=48)


def test_moe_useful_fraction():
    """Tiles of 64 rows: 64 + 70 routed rows in tiles 64, 64, 6; 64 x 256 tiles have warps
    of 32 rows, 64 x 128 ones of 16."""
    f = moe_useful_fraction([64, 64, 6], 64, 256)
    assert f["of_tiles"] == pytest.approx(134 / 192)
    assert f["of_computed"] == pytest.approx(134 / 160)
    assert moe_useful_fraction([64, 64, 6], 64, 128)["of_computed"] == pytest.approx(134 / 144)


def test_moe_tile_rows_by_rows_an_expert():
    """Taller tiles once an expert averages enough rows (40, 947, 2048 and 8192 tokens
    over 128 experts, 8 each: 2.5, 59, 128 and 512 rows)."""
    assert moe_tile_rows(40, 128, 8) == 64
    assert moe_tile_rows(947, 128, 8) == 64
    assert moe_tile_rows(2048, 128, 8) == 64
    assert moe_tile_rows(8192, 128, 8) == 128


# ---- MoE -------------------------------------------------------------------------------------
def _route(logits, k):
    probs = R.softmax(logits)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, top, axis=-1)
    return top, w / w.sum(-1, keepdims=True)


def test_moe_route_and_group(ops):
    rng = np.random.default_rng(6)
    T, E, k = 150, 12, 3
    logits = (3 * rng.standard_normal((T, E))).astype(np.float32)
    g = MoeGroups(ops.device, T, E, k)
    g.reset(ops.stream)
    ops.moe_route(g.topk_ids, g.topk_w, g.counts, dev(ops, logits), T, E, k)
    ops.moe_group(g, T, E, k)
    top, w = _route(logits, k)
    np.testing.assert_array_equal(g.topk_ids.download(), top)
    close(g.topk_w.download(), w)
    counts = np.bincount(top.reshape(-1), minlength=E)
    np.testing.assert_array_equal(g.counts.download(), counts)
    offsets = g.offsets.download()
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(counts)]))
    pair_token, pair_pos = g.pair_token.download(), g.pair_pos.download()
    assert sorted(pair_pos) == list(range(T * k))                  # a grouped row for every pair
    for p in range(T * k):                                         # ... in its expert's segment
        e = top.reshape(-1)[p]
        assert offsets[e] <= pair_pos[p] < offsets[e + 1] and pair_token[pair_pos[p]] == p // k
    n = int(g.n_tiles.download()[0])
    tiles = list(zip(g.tile_expert.download()[:n], g.tile_row0.download()[:n], g.tile_rows.download()[:n]))
    assert g.bm == 64                                              # 37.5 rows an expert
    assert n == sum(-(-c // 64) for c in counts)
    assert sum(r for _, _, r in tiles) == T * k and all(0 < r <= 64 for _, _, r in tiles)
    assert all(offsets[e] <= r0 and r0 + r <= offsets[e + 1] for e, r0, r in tiles)
    ops.moe_group(g, T, E, k, bm=128)                              # grouped again, in other tiles
    assert sorted(g.pair_pos.download()) == list(range(T * k))
    assert int(g.n_tiles.download()[0]) == sum(-(-c // 128) for c in counts)


@pytest.mark.parametrize("kind, T, ff, d, bm", [("q4_0", 90, 32, 64, None), ("q8_0", 90, 32, 64, None),
                                                ("f16", 90, 32, 64, None), ("q4_0", 700, 32, 64, None),
                                                ("q8_0", 150, 96, 160, 128)])
def test_moe_experts_and_combine(ops, kind, T, ff, d, bm):
    """The whole routed block from device routing: grouped gate/up (its SwiGLU in the
    epilogue) and down products over every expert in one launch each, weighted combine
    with the shared expert, against the reference's loop over experts (T = 90: 30 rows an
    expert, 64-row tiles; T = 700: 233 rows, 128-row tiles; T = 150: 50 rows in 128-row tiles,
    forced; ff = 96: a gate|up tile of 64 gate columns and a partial one)."""
    rng = np.random.default_rng(7)
    E, k = 6, 2
    x = rng.standard_normal((T, d)).astype(np.float32)
    h0 = rng.standard_normal((T, d)).astype(np.float32)
    logits = (3 * rng.standard_normal((T, E))).astype(np.float32)
    experts = [[quantized(rng, shape, kind) for shape in ((ff, d), (ff, d), (d, ff))] for _ in range(E)]
    # a layer buffer: expert e at slot order[e], each [gate | up | down]
    order = rng.permutation(E)
    gate_b = len(experts[0][0][0])
    expert_bytes = 2 * gate_b + len(experts[0][2][0])
    slot = np.zeros(E * expert_bytes, np.uint8)
    for e in range(E):
        slot[order[e] * expert_bytes:(order[e] + 1) * expert_bytes] = np.concatenate([m[0] for m in experts[e]])
    shared = rng.standard_normal(d).astype(np.float32)
    shared_out = rng.standard_normal((T, d)).astype(np.float32)

    g = MoeGroups(ops.device, T, E, k)
    g.reset(ops.stream)
    ops.moe_route(g.topk_ids, g.topk_w, g.counts, dev(ops, logits), T, E, k)
    ops.moe_group(g, T, E, k, bm)
    assert g.bm == (bm or {90: 64, 700: 128}[T])
    act, y, h = empty(ops, (T * k, ff)), empty(ops, (T * k, d)), dev(ops, h0)
    dslot, dmap, dx = dev(ops, slot), dev(ops, order.astype(np.int32)), dev(ops, x)
    ops.moe_gateup(act, dx, dslot, dmap, expert_bytes, g, ff, d, kind)
    ops.moe_down(y, act, dslot, dmap, expert_bytes, 2 * gate_b, g, d, ff, kind)
    ops.moe_combine(h, y, g, dev(ops, shared_out), dx, dev(ops, shared), T, d, k)

    top, w = _route(logits, k)
    want = h0.copy()
    for t in range(T):
        for s in range(k):
            (_, wg), (_, wu), (_, wd) = experts[top[t, s]]
            want[t] += w[t, s] * ((R.silu(x[t] @ wg.T) * (x[t] @ wu.T)) @ wd.T)
    want += R.sigmoid(x @ shared)[:, None] * shared_out
    close(h.download(), want)


# ---- attention ------------------------------------------------------------------------------------
def _rope_tables(positions, rope_dim, theta):
    half = rope_dim // 2
    inv = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    angle = (np.asarray(positions, np.float64)[:, None] * inv[None, :]).astype(np.float32)
    return np.cos(angle), np.sin(angle)


@pytest.mark.parametrize("hd, rope_dim, kv_f16", [(32, 8, True), (256, 64, False), (96, 32, True)])
def test_attention_over_a_prompt_after_a_cached_prefix(ops, hd, rope_dim, kv_f16):
    rng = np.random.default_rng(hd)
    nh, nkv, start, T = 4, 2, 21, 37
    qg = rng.standard_normal((T, nh, 2 * hd)).astype(np.float32)
    k_in, v_in = rng.standard_normal((2, T, nkv, hd)).astype(np.float32)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, hd))).astype(np.float32)
    cache_k, cache_v = rng.standard_normal((2, start + T, nkv, hd)).astype(np.float32)
    if kv_f16:
        cache_k, cache_v = (c.astype(np.float16).astype(np.float32) for c in (cache_k, cache_v))
    positions = np.arange(start, start + T)
    cos, sin = _rope_tables(positions, rope_dim, 1e7)
    Kc, Vc, q = dev(ops, cache_k), dev(ops, cache_v), empty(ops, (T, nh, hd))
    dqg = dev(ops, qg)
    ops.attn_qk_norm_rope(q, Kc, Vc, dqg, dev(ops, k_in), dev(ops, v_in), dev(ops, qn), dev(ops, kn), dev(ops, cos),
                          dev(ops, sin), start, T, AttnHeads(nh, nkv, hd, rope_dim), 1e-6, kv_f16)
    want_q = R.rope(R.rms_norm(qg[..., :hd], qn, 1e-6), positions, rope_dim, 1e7)
    want_k = R.rope(R.rms_norm(k_in, kn, 1e-6), positions, rope_dim, 1e7)
    want_v = v_in
    if kv_f16:
        want_k, want_v = (a.astype(np.float16).astype(np.float32) for a in (want_k, want_v))
    close(q.download(), want_q)
    keys, values = Kc.download(), Vc.download()
    np.testing.assert_array_equal(keys[:start], cache_k[:start])
    close(keys[start:], want_k, 1e-3 if kv_f16 else KERNEL_RTOL)      # f16: a rounding may flip an ulp
    close(values[start:], want_v)

    out = empty(ops, (T, nh * hd))
    ops.attn_prompt(out, q, Kc, Vc, dqg, start, T, AttnHeads(nh, nkv, hd))
    group = nh // nkv
    qh = q.download()
    scores = np.einsum("thd,hpd->htp", qh, np.repeat(keys, group, axis=1).transpose(1, 0, 2)) * hd ** -0.5
    scores = np.where(np.arange(start + T)[None, None, :] > positions[None, :, None], -np.inf, scores)
    attn = np.einsum("htp,hpd->thd", R.softmax(scores), np.repeat(values, group, axis=1).transpose(1, 0, 2))
    close(out.download(), (attn * R.sigmoid(qg[..., hd:])).reshape(T, nh * hd))



def _prompt_attention(q, keys, values, gate, start):
    """softmax(q K^T / sqrt(hd), causal) V * sigmoid(gate) in float64, over keys [0, start + T)."""
    T, nh, hd = q.shape
    n, group = start + T, nh // keys.shape[1]
    k = np.repeat(keys[:n], group, axis=1).astype(np.float64)
    v = np.repeat(values[:n], group, axis=1).astype(np.float64)
    scores = np.einsum("thd,phd->htp", q.astype(np.float64), k) * hd ** -0.5
    scores = np.where(np.arange(n)[None, None, :] > (start + np.arange(T))[None, :, None], -np.inf, scores)
    attn = np.einsum("htp,phd->thd", R.softmax(scores), v)
    return (attn / (1 + np.exp(-gate.astype(np.float64)))).reshape(T, nh * hd)


# attn_prompt's tiles: 64 query rows a block, 64-key tiles, Q / K in 32-dim chunks, V in
# 16-key chunks, each thread 4 rows x (4 of every 64) dims of the output
@pytest.mark.parametrize("hd, nh, nkv, start, T", [
    (32, 4, 2, 0, 1),          # one query, one key
    (32, 4, 1, 150, 1),        # one query after three key tiles (one KV head for four)
    (96, 4, 2, 70, 150),       # start and T off the tiles; dims 96..127 of the second group unused
    (256, 4, 2, 64, 64),       # edges on the tiles
    (256, 2, 2, 37, 200),      # four query blocks, up to four key tiles, the model's head size
    (140, 6, 2, 5, 70),        # a partial third dim group and last Q / K chunk; three heads a KV head
])
def test_attention_prompt_tiles(ops, hd, nh, nkv, start, T):
    rng = np.random.default_rng(hd + start + T)
    q = 3 * rng.standard_normal((T, nh, hd)).astype(np.float32)     # sharp rows: the rescales matter
    qg = rng.standard_normal((T + 64, nh, 2 * hd)).astype(np.float32)   # rows past T: never used
    spare = 5                       # cache rows past the prompt hold NaN: no key past a row's position is read
    keys, values = rng.standard_normal((2, start + T + spare, nkv, hd)).astype(np.float32)
    keys[start + T:] = values[start + T:] = np.nan
    out = dev(ops, np.full((T + 64, nh * hd), 7.0, np.float32))     # rows past T (to the block's end) stay
    ops.attn_prompt(out, dev(ops, q), dev(ops, keys), dev(ops, values), dev(ops, qg), start, T, AttnHeads(nh, nkv, hd))
    got = out.download()
    close(got[:T], _prompt_attention(q, keys, values, qg[:T, :, hd:], start))
    np.testing.assert_array_equal(got[T:], 7.0)


def test_attention_prompt_refuses_what_it_cannot_tile(ops):
    buf = empty(ops, (4, 2, 512))
    with pytest.raises(LaunchError, match="head_dim 288"):
        ops.attn_prompt(buf, buf, buf, buf, buf, 0, 1, AttnHeads(2, 1, 288))
    with pytest.raises(LaunchError, match="head_dim 30"):
        ops.attn_prompt(buf, buf, buf, buf, buf, 0, 1, AttnHeads(2, 1, 30))
    with pytest.raises(LaunchError, match="cache of 4 positions for 3 \\+ 2"):
        ops.attn_prompt(buf, buf, buf, buf, buf, 3, 2, AttnHeads(2, 1, 32))
    with pytest.raises(LaunchError, match="16-byte aligned"):
        ops.attn_prompt(buf, buf.at(4, (1, 2, 32)), buf, buf, buf, 0, 1, AttnHeads(2, 1, 32))

# ---- Gated DeltaNet ----------------------------------------------------------------------------------
def test_gdn_conv_and_history(ops):
    rng = np.random.default_rng(8)
    T, C, Kk = 11, 300, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    state0 = rng.standard_normal((Kk - 1, C)).astype(np.float32)
    w = rng.standard_normal((C, Kk)).astype(np.float32)
    out, state, snap = empty(ops, (T, C)), dev(ops, state0), empty(ops, (Kk - 1, C))
    dx = dev(ops, x)
    ops.gdn_conv(out, dx, state, dev(ops, w), T, C, Kk)
    ops.gdn_conv_history(snap, state, dx, 2, T, C, Kk)          # after 2 tokens: a snapshot's conv state
    ops.gdn_conv_history(state, state, dx, T, T, C, Kk)         # after all of them, in place
    ref_state = state0.copy()
    close(out.download(), R.silu(R.causal_conv(x, ref_state, w)))
    np.testing.assert_array_equal(state.download(), ref_state)
    np.testing.assert_array_equal(snap.download(), np.concatenate([state0, x])[2:2 + Kk - 1])


def _gdn_inputs(rng, T, hk, hv, dk, dv):
    C = 2 * hk * dk + hv * dv
    conv = rng.standard_normal((T, C)).astype(np.float32)
    b, a = rng.standard_normal((2, T, hv)).astype(np.float32)
    ssm_a = -np.exp(rng.standard_normal(hv)).astype(np.float32)
    dt = rng.standard_normal(hv).astype(np.float32)
    return C, conv, b, a, ssm_a, dt


def test_gdn_qk_gates(ops):
    rng = np.random.default_rng(9)
    T, hk, hv, dk, dv = 13, 3, 6, 48, 16
    C, conv, b, a, ssm_a, dt = _gdn_inputs(rng, T, hk, hv, dk, dv)
    q, k, beta, g = empty(ops, (T, hk, dk)), empty(ops, (T, hk, dk)), empty(ops, (T, hv)), empty(ops, (T, hv))
    ops.gdn_qk_gates(q, k, beta, g, dev(ops, conv), dev(ops, b), dev(ops, a), dev(ops, ssm_a), dev(ops, dt),
                     T, GDNHeads(hk, hv, dk, dv, True), C, 1e-6)
    key = hk * dk
    close(q.download(), R.l2_normalize(conv[:, :key].reshape(T, hk, dk)) * dk ** -0.5)
    close(k.download(), R.l2_normalize(conv[:, key:2 * key].reshape(T, hk, dk)))
    close(beta.download(), R.sigmoid(b))
    close(g.download(), ssm_a * R.softplus(a + dt))


def _delta_inputs(rng, T, hk, hv, dk, dv):
    q = R.l2_normalize(rng.standard_normal((T, hk, dk)).astype(np.float32)) * np.float32(dk ** -0.5)
    k = R.l2_normalize(rng.standard_normal((T, hk, dk)).astype(np.float32))
    v = rng.standard_normal((T, hv * dv)).astype(np.float32)
    beta = R.sigmoid(rng.standard_normal((T, hv)).astype(np.float32))
    g = (-0.3 * np.exp(rng.standard_normal((T, hv)))).astype(np.float32)
    S0 = (0.3 * rng.standard_normal((hv, dk, dv))).astype(np.float32)
    return q, k, v, beta, g, S0


def _key_heads(hk, hv, tiled):
    return [h % hk if tiled else h // (hv // hk) for h in range(hv)]


@pytest.mark.parametrize("tiled", [True, False])
def test_gdn_recurrent(ops, tiled):
    rng = np.random.default_rng(10)
    T, hk, hv, dk, dv = 9, 2, 4, 16, 40
    q, k, v, beta, g, S0 = _delta_inputs(rng, T, hk, hv, dk, dv)
    S, o = dev(ops, S0), empty(ops, (T, hv, dv))
    ops.gdn_recurrent(o, S, dev(ops, q), dev(ops, k), dev(ops, v), dev(ops, beta), dev(ops, g), T,
                      GDNHeads(hk, hv, dk, dv, tiled), hv * dv)
    kh = _key_heads(hk, hv, tiled)
    S_ref = S0.copy()
    want = R.delta_rule(q[:, kh], k[:, kh], v.reshape(T, hv, dv), g, beta, S_ref)
    close(o.download(), want)
    close(S.download(), S_ref)


def chunks_for(T, cuts=()):
    """Chunks of at most 64 tokens, also cut at `cuts` (snapshot boundaries)."""
    edges = sorted({0, T, *cuts, *range(CHUNK, T, CHUNK)})
    return edges[:-1], [b - a for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("T, dk, dv, cuts, tiled", [(150, 32, 40, (70,), True), (64, 128, 128, (), True),
                                                     (23, 16, 16, (5, 6), False)])
def test_gdn_chunked_equals_the_token_recurrence(ops, T, dk, dv, cuts, tiled):
    rng = np.random.default_rng(T)
    hk, hv = 2, 4
    q, k, v, beta, g, S0 = _delta_inputs(rng, T, hk, hv, dk, dv)
    starts, lengths = chunks_for(T, cuts)
    work = ChunkWork(ops.device, len(starts), hv, dk, dv)
    nc = work.set_chunks(starts, lengths)
    S, o = dev(ops, S0), empty(ops, (T, hv, dv))
    ops.gdn_chunked(o, S, dev(ops, q), dev(ops, k), dev(ops, v), dev(ops, beta), dev(ops, g), work, nc,
                    GDNHeads(hk, hv, dk, dv, tiled), hv * dv)
    kh = _key_heads(hk, hv, tiled)
    S_ref = S0.copy()
    want, starts_ref = [], []
    for s, n in zip(starts, lengths):
        starts_ref.append(S_ref.copy())
        want.append(R.delta_rule(q[s:s + n][:, kh], k[s:s + n][:, kh], v[s:s + n].reshape(n, hv, dv), g[s:s + n],
                                 beta[s:s + n], S_ref))
    close(o.download(), np.concatenate(want), CHUNK_RTOL)
    close(S.download(), S_ref, CHUNK_RTOL)
    close(work.S0.download()[:nc], np.stack(starts_ref), CHUNK_RTOL)   # the states at the chunk starts


def test_gdn_chunked_over_part_of_the_chunk_table(ops):
    """Two sequences in one pass (rows 0..99 and 100..229), one chunk table: each GDN
    call takes its sequence's chunks (ChunkWork.part, starts absolute within the pass)
    and its own state; dk = 128 (4 W slabs a chunk), dv = 24 (a partial column block)."""
    rng = np.random.default_rng(12)
    T, split, hk, hv, dk, dv = 230, 100, 1, 2, 128, 24
    q, k, v, beta, g, _ = _delta_inputs(rng, T, hk, hv, dk, dv)
    states = [(0.3 * rng.standard_normal((hv, dk, dv))).astype(np.float32) for _ in range(2)]
    starts, lengths = chunks_for(T, (split,))
    work = ChunkWork(ops.device, len(starts) + 2, hv, dk, dv)          # a table longer than the pass
    work.set_chunks(starts, lengths)
    first_b = starts.index(split)
    o = empty(ops, (T, hv, dv))
    buffers = [dev(ops, x) for x in (q, k, v, beta, g)]
    S = [dev(ops, s) for s in states]
    for (c0, c1), Sd in zip(((0, first_b), (first_b, len(starts))), S):
        ops.gdn_chunked(o, Sd, *buffers, work.part(c0, c1), c1 - c0, GDNHeads(hk, hv, dk, dv, False), hv * dv)
    got = o.download()
    for (r0, r1), S_ref, Sd in zip(((0, split), (split, T)), [s.copy() for s in states], S):
        want = R.delta_rule(q[r0:r1][:, [0, 0]], k[r0:r1][:, [0, 0]], v[r0:r1].reshape(r1 - r0, hv, dv), g[r0:r1],
                            beta[r0:r1], S_ref)
        close(got[r0:r1], want, CHUNK_RTOL)
        close(Sd.download(), S_ref, CHUNK_RTOL)


def test_to_f16_rounds_as_numpy(ops):
    """fp32 -> fp16 bits on the device, bit for bit numpy's (ties to even, subnormals, overflow)."""
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-9, 6, 1000),
                        [0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.0 ** -25, 1 + 2.0 ** -11]])
    x = x.astype(np.float32)
    out = empty(ops, x.shape, np.uint16)
    ops.to_f16(out, dev(ops, x))
    with np.errstate(over="ignore"):                   # 65520 and 1e6 overflow to inf, as they should
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out.download(), want)
