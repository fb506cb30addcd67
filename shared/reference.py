"""The numpy reference forward: the spec every kernel is tested against.

Plain float32, one small function per op, the layer reading top to bottom as in
Hugging Face's Qwen3_5MoeDecoderLayer: h += mixer(norm1(h)); h += moe(norm2(h)).
`forward` takes any number of new tokens and carries the sequence state, so a
whole prompt at once and token-by-token decoding run the same code.
"""
from __future__ import annotations

import contextvars

import numpy as np

from .config import ModelConfig
from .ggml_types import GGMLType
from .model import Layer, Model
from .state import SequenceState

F32 = np.float32


# ---- elementwise ops -------------------------------------------------------
def silu(x):
    return x / (F32(1) + np.exp(-x))


def sigmoid(x):
    return F32(1) / (F32(1) + np.exp(-x))


def softplus(x):
    return np.logaddexp(F32(0), x).astype(F32)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rms_norm(x, weight, eps):
    """GGUF norm weights are plain multipliers (llama.cpp stored HF's 1 + w)."""
    inv = F32(1) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))
    return x * inv * weight


def l2_normalize(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + F32(eps))


# When set, activations are rounded through Q8_0 before every product with a
# Q4_0/Q8_0 weight, as the native W4A8 kernels compute: the oracle for them.
ACTIVATIONS_Q8 = contextvars.ContextVar("ACTIVATIONS_Q8", default=False)
_INTEGER_WEIGHTS = (GGMLType.Q4_0, GGMLType.Q8_0)


def linear(x, weight):
    """x [..., in] times a [out, in] weight."""
    if ACTIVATIONS_Q8.get() and weight.qtype in _INTEGER_WEIGHTS:
        from .quants import dequantize_q8_0, quantize_q8_0
        x = dequantize_q8_0(quantize_q8_0(np.ascontiguousarray(x, dtype=F32)))
    return x @ weight.f32().T


def rope_angles(positions, rope_dim, theta) -> np.ndarray:
    """The rotation angles [T, rope_dim/2] (fp32) of the positions: position x theta^(-2i/rope_dim),
    in float64 then rounded (the GPU engine uploads their cos and sin from here too)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    return (np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]).astype(F32)


# ---- M-RoPE: the (t, h, w) positions of Qwen3.5's text rotary ---------------------
#
# Every token has three positions: a text token (p, p, p), an image token (p0, p0 + row,
# p0 + col) on the merged patch grid of its image, which starts at p0; the text after an
# image goes on from p0 + max(rows, cols), so a sequence's next position runs behind its
# length by `rope delta` (SequenceState.rope_delta). Frequency pair i turns by one of the
# three (HF's apply_interleaved_mrope, llama.cpp's IMROPE): h where i % 3 == 1 and
# i < 3 * sections[1], w where i % 3 == 2 and i < 3 * sections[2], t everywhere else. With
# the three equal (all text) this is plain RoPE, bit for bit.

def mrope_streams(rope_dim: int, sections) -> np.ndarray:
    """Which position (0 t, 1 h, 2 w) turns each of the rope_dim/2 frequency pairs [int32]."""
    i = np.arange(rope_dim // 2)
    stream = np.zeros(len(i), np.int32)
    stream[(i % 3 == 1) & (i < 3 * sections[1])] = 1
    stream[(i % 3 == 2) & (i < 3 * sections[2])] = 2
    return stream


def text_positions(start: int, n: int) -> np.ndarray:
    """The (t, h, w) positions [n, 3] of n text tokens from M-RoPE position `start`."""
    return np.repeat(np.arange(start, start + n, dtype=np.int64)[:, None], 3, axis=1)


def mrope_angles(positions3, rope_dim, theta, sections) -> np.ndarray:
    """rope_angles of (t, h, w) positions [T, 3]: each pair turned by its own stream's position."""
    inv_freq = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    pos = np.asarray(positions3, np.float64)[:, mrope_streams(rope_dim, sections)]
    return (pos * inv_freq[None, :]).astype(F32)


def rope_turn(x, angle, rope_dim):
    """NeoX-style RoPE on the first rope_dim dims of each head: pairs (i, i + rope_dim/2)
    turned by angle [T, rope_dim/2]. x: [T, heads, head_dim]."""
    half = rope_dim // 2
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rope_dim]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rope_dim] = x2 * cos + x1 * sin
    return out


def rope(x, positions, rope_dim, theta):
    """RoPE at 1-D positions (text: the three M-RoPE positions equal). x: [T, heads, head_dim]."""
    return rope_turn(x, rope_angles(positions, rope_dim, theta), rope_dim)


# ---- Gated DeltaNet --------------------------------------------------------
def causal_conv(qkv, conv_state, weight):
    """Depthwise causal conv over time with the carried history of kernel-1 inputs.

    qkv [T, C]; conv_state [K-1, C] (oldest first, updated in place); weight [C, K]."""
    k = weight.shape[1]
    hist = np.concatenate([conv_state, qkv], axis=0)
    out = np.zeros_like(qkv)
    for j in range(k):
        out += hist[j:j + len(qkv)] * weight[:, j]
    conv_state[:] = hist[len(hist) - (k - 1):]
    return out


def delta_rule(q, k, v, g, beta, S):
    """The gated delta rule, token by token, per value head (S [H, dk, dv] in place).

    S = exp(g) S; d = beta (v - S^T k); S += k d^T; o = S^T q."""
    out = np.empty_like(v)
    for t in range(len(q)):
        S *= np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hkv,hk->hv", S, k[t])
        delta = beta[t][:, None] * (v[t] - kv_mem)
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out


def delta_rule_chunked(q, k, v, g, beta, S, chunk: int = 64, cuts=()):
    """The same rule over chunks of up to `chunk` tokens (also cut at `cuts`), in the WY form
    the GPU kernels compute (native/cuda/gdn_chunk.cu); S [H, dk, dv] in place. Per head and
    chunk of n tokens (local i, j), with S0 the state entering it:

        G_i  = sum_{s<=i} g_s                        cumulative log decay (<= 0)
        A_ij = beta_i (k_i . k_j) e^(G_i - G_j)      i > j, else 0
        T    = (I + A)^-1                            unit lower triangular
        W    = T diag(beta e^G) K,   U = T diag(beta) V
        Vn   = U - W S0
        O    = diag(e^G) Q S0 + P Vn,                P_ij = (q_i . k_j) e^(G_i - G_j), i >= j
        S1   = e^(G_n) S0 + (diag(e^(G_n - G)) K)^T Vn

    Exponents are masked before they are taken, so every one is <= 0."""
    T_all = len(q)
    edges = sorted({0, T_all, *cuts, *range(chunk, T_all, chunk)})
    out = np.empty_like(v)
    for t0, t1 in zip(edges, edges[1:]):
        n = t1 - t0
        Q, K, V = (a[t0:t1].transpose(1, 0, 2) for a in (q, k, v))          # [H, n, d]
        b = beta[t0:t1].T[:, :, None]                                       # [H, n, 1]
        G = np.cumsum(g[t0:t1].T, axis=1)                                   # [H, n]
        lower = np.tril(np.ones((n, n), bool), -1)
        gap = np.where(lower | np.eye(n, dtype=bool), G[:, :, None] - G[:, None, :], 0)    # G_i - G_j, i >= j
        decay = np.where(lower | np.eye(n, dtype=bool), np.exp(gap), 0)
        A = b * np.einsum("hik,hjk->hij", K, K) * np.where(lower, decay, 0)
        Tinv = np.linalg.inv(np.eye(n) + A)
        W = Tinv @ (b * np.exp(G)[:, :, None] * K)
        U = Tinv @ (b * V)
        Vn = U - W @ S
        P = np.einsum("hik,hjk->hij", Q, K) * decay
        out[t0:t1] = (np.exp(G)[:, :, None] * (Q @ S) + P @ Vn).transpose(1, 0, 2)
        last = G[:, -1:]
        S *= np.exp(last)[:, :, None]
        S += np.einsum("hjk,hjv->hkv", np.exp(last - G)[:, :, None] * K, Vn)
    return out


def gated_deltanet(layer: Layer, x, cfg: ModelConfig, state: SequenceState):
    T = len(x)
    slot = state.gdn_slot[layer.index]
    hk, hv, dk, dv = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim
    qkv = linear(x, layer.attn_qkv)
    z = linear(x, layer.attn_gate).reshape(T, hv, dv)
    beta = sigmoid(linear(x, layer.ssm_beta))
    g = layer.ssm_a.f32() * softplus(linear(x, layer.ssm_alpha) + layer.ssm_dt.f32())

    qkv = silu(causal_conv(qkv, state.conv[slot], layer.ssm_conv1d.f32()))
    key_dim = cfg.ssm_key_dim
    q = l2_normalize(qkv[:, :key_dim].reshape(T, hk, dk)) * F32(dk ** -0.5)
    k = l2_normalize(qkv[:, key_dim:2 * key_dim].reshape(T, hk, dk))
    v = qkv[:, 2 * key_dim:].reshape(T, hv, dv)
    key_head = [cfg.key_head_of(h) for h in range(hv)]
    o = delta_rule(q[:, key_head], k[:, key_head], v, g, beta, state.ssm[slot])

    o = rms_norm(o, layer.ssm_norm.f32(), cfg.rms_eps) * silu(z)
    return linear(o.reshape(T, hv * dv), layer.ssm_out)


# ---- gated attention -------------------------------------------------------
def gated_attention(layer: Layer, x, cfg: ModelConfig, state: SequenceState, rope_pos=None):
    """rope_pos: the tokens' (t, h, w) positions [T, 3]; None: text from the state's next one."""
    T, nh, nkv, hd = len(x), cfg.n_head, cfg.n_head_kv, cfg.head_dim
    slot = state.attn_slot[layer.index]
    start = state.position
    positions = np.arange(start, start + T)                   # in the sequence (the causal mask)
    if rope_pos is None:
        rope_pos = text_positions(start + state.rope_delta, T)
    angle = mrope_angles(rope_pos, cfg.rope_dim, cfg.rope_theta, cfg.rope_sections)
    # W_q gives per head [query | gate], interleaved head by head.
    qg = linear(x, layer.attn_q).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    k = linear(x, layer.attn_k).reshape(T, nkv, hd)
    v = linear(x, layer.attn_v).reshape(T, nkv, hd)
    q = rope_turn(rms_norm(q, layer.attn_q_norm.f32(), cfg.rms_eps), angle, cfg.rope_dim)
    k = rope_turn(rms_norm(k, layer.attn_k_norm.f32(), cfg.rms_eps), angle, cfg.rope_dim)
    state.kv.append(slot, k, v)
    keys, values = state.kv.view(slot)                        # [P, nkv, hd]

    group = nh // nkv
    kh = np.repeat(keys, group, axis=1).transpose(1, 0, 2)    # [nh, P, hd]
    vh = np.repeat(values, group, axis=1).transpose(1, 0, 2)
    scores = np.einsum("thd,hpd->htp", q, kh) * F32(hd ** -0.5)
    causal = np.arange(len(keys))[None, :] > positions[:, None]
    scores = np.where(causal[None], F32(-np.inf), scores)
    attn = np.einsum("htp,hpd->thd", softmax(scores), vh).reshape(T, nh * hd)
    return linear(attn * sigmoid(gate), layer.attn_output)


# ---- mixture of experts ----------------------------------------------------
def route(layer: Layer, x, cfg: ModelConfig):
    """Softmax over all experts, keep the top k, renormalise them to sum 1."""
    probs = softmax(linear(x, layer.ffn_gate_inp))
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg.n_expert_used]
    weights = np.take_along_axis(probs, top, axis=-1)
    return top, weights / weights.sum(axis=-1, keepdims=True)


def swiglu(x, gate, up, down, expert=None):
    """down(silu(gate x) * up x) for a 2-D weight triple, or one expert of 3-D ones."""
    if expert is not None:
        gate, up, down = (_ExpertView(w, expert) for w in (gate, up, down))
    return linear(silu(linear(x, gate)) * linear(x, up), down)


class _ExpertView:
    """One expert of a 3-D weight, with the interface `linear` reads."""

    def __init__(self, weight, expert):
        self.qtype, self._rows, self._e = weight.qtype, weight, expert

    def f32(self):
        return self._rows.rows(self._e)


# When set, moe() calls it with (layer index, expert, the renormalised router weights
# of the tokens routed to that expert [n], the expert's outputs for them [n, d]):
# how `fermoe prune` sees every expert's output without a second implementation.
MOE_OBSERVER = contextvars.ContextVar("MOE_OBSERVER", default=None)


def moe(layer: Layer, x, cfg: ModelConfig):
    top, weights = route(layer, x, cfg)
    observe = MOE_OBSERVER.get()
    y = np.zeros_like(x)
    for e in np.unique(top):
        tok, slot = np.nonzero(top == e)
        out = swiglu(x[tok], layer.ffn_gate_exps, layer.ffn_up_exps, layer.ffn_down_exps, expert=e)
        if observe is not None:
            observe(layer.index, int(e), weights[tok, slot], out)
        y[tok] += weights[tok, slot][:, None] * out
    if cfg.n_ff_shexp:
        shared = swiglu(x, layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp)
        y += sigmoid(x @ layer.ffn_gate_inp_shexp.f32())[:, None] * shared
    return y


# ---- the model -------------------------------------------------------------
def block(layer: Layer, h, cfg: ModelConfig, state: SequenceState, rope_pos=None):
    """One decoder layer: h += mixer(norm1(h)); h += moe(norm2(h))."""
    x = rms_norm(h, layer.attn_norm.f32(), cfg.rms_eps)
    if layer.kind == "attention":
        h = h + gated_attention(layer, x, cfg, state, rope_pos)
    else:
        h = h + gated_deltanet(layer, x, cfg, state)
    x = rms_norm(h, layer.post_attention_norm.f32(), cfg.rms_eps)
    return h + moe(layer, x, cfg)


def forward(model: Model, tokens, state: SequenceState, media=None) -> np.ndarray:
    """Advance `state` by `tokens`; return the logits of every new position [T, vocab].

    media (shared/vision/prompt.TokenMedia, for these tokens): image embeddings that
    replace some tokens' own, and every token's (t, h, w) position; the state's rope
    delta then follows the last one. Without it the tokens are text."""
    cfg = model.config
    tokens = np.asarray(tokens, dtype=np.int64)
    state.check_room(len(tokens))
    h = model.token_embd.take(tokens)
    rope_pos = None
    if media is not None:
        media.check(len(tokens), cfg.n_embd)
        h[media.rows] = media.embeds
        rope_pos = media.positions
    for layer in model.layers:
        h = block(layer, h, cfg, state, rope_pos)
    h = rms_norm(h, model.output_norm.f32(), cfg.rms_eps)
    logits = linear(h, model.output)
    state.position += len(tokens)
    if media is not None:
        state.rope_delta = media.next_position() - state.position
    state.set_logits(logits[-1])
    return logits
