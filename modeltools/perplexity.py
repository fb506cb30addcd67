"""Perplexity and model comparison over a text, in llama-perplexity's convention.

llama.cpp's tools/perplexity (without --ppl-stride): the whole text is tokenised once;
it is cut into n_chunk = n_tokens // ctx windows of ctx tokens (the tail that does not
fill a window is left out); each window runs from an empty state (llama.cpp clears
its KV cache), its first token replaced by BOS when the vocabulary adds one; only the
second half is scored, so every scored token has at least ctx/2 tokens of context:
the logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1, ctx/2 - 1
tokens a window. PPL = exp(mean NLL), +/- exp(mean) * the standard error of the NLLs.
`compare` scores the same positions of two models, as llama-perplexity
--kl-divergence does: KL(A || B) = sum p_A (log p_A - log p_B) a position, and top-1
agreement ("same top p") is how often both argmaxes are the same token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.errors import FermoeError


def windows(tokens, ctx: int, bos: int | None = None) -> list[np.ndarray]:
    """The ctx-token windows llama-perplexity evaluates (at least two are needed)."""
    tokens = np.asarray(tokens, np.int64)
    if ctx < 4:
        raise FermoeError(f"--ctx {ctx}: must be at least 4")
    if len(tokens) < 2 * ctx:
        raise FermoeError(f"the text has {len(tokens)} tokens; perplexity with --ctx {ctx} needs at least "
                          f"{2 * ctx} (two windows, as llama-perplexity)")
    out = [tokens[i * ctx:(i + 1) * ctx].copy() for i in range(len(tokens) // ctx)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def scored_logprobs(engine, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-probabilities [ctx/2 - 1, vocab] of the scored positions, their targets)."""
    first = len(window) // 2
    logits = engine.forward(window, engine.new_state())
    return log_softmax(logits[first:-1]), window[first + 1:]


@dataclass
class Perplexity:
    ppl: float
    stderr: float          # of the ppl, as llama-perplexity's "+/-"
    tokens: int            # scored tokens
    windows: int

    def line(self) -> str:
        return (f"PPL = {self.ppl:.4f} +/- {self.stderr:.5f} ({self.tokens} tokens scored in "
                f"{self.windows} windows)")


def _summary(nll: np.ndarray, n_windows: int) -> Perplexity:
    mean = float(nll.mean())
    err = math.sqrt(max(float(nll.var()), 0.0) / max(len(nll) - 1, 1))
    return Perplexity(math.exp(mean), math.exp(mean) * err, len(nll), n_windows)


def _bar(n: int, desc: str, progress: bool):
    from tqdm import tqdm
    return tqdm(total=n, desc=desc, unit="window", disable=not progress)


def perplexity(engine, tokens, ctx: int = 512, bos: int | None = None, progress: bool = True) -> Perplexity:
    """The perplexity of `tokens` under `engine` (any Engine: cpu, reference, gpu)."""
    ws = windows(tokens, ctx, bos)
    nll = []
    total, count = 0.0, 0                  # the running estimate on the bar
    with _bar(len(ws), "perplexity", progress) as bar:
        for w in ws:
            logp, target = scored_logprobs(engine, w)
            nll.append(-logp[np.arange(len(target)), target])
            total, count = total + float(nll[-1].sum()), count + len(target)
            bar.update()
            bar.set_postfix(ppl=f"{math.exp(total / count):.3f}")
    return _summary(np.concatenate(nll), len(ws))


@dataclass
class Comparison:
    a: Perplexity
    b: Perplexity
    top1_agreement: float      # fraction of scored positions where A's and B's argmax agree
    kl_mean: float             # mean KL(A || B) in nats
    kl_stderr: float

    def as_dict(self) -> dict:
        return {"ppl_a": self.a.ppl, "ppl_a_stderr": self.a.stderr, "ppl_b": self.b.ppl,
                "ppl_b_stderr": self.b.stderr, "top1_agreement": self.top1_agreement,
                "kl_mean": self.kl_mean, "kl_stderr": self.kl_stderr, "tokens": self.a.tokens,
                "windows": self.a.windows}


def compare(engine_a, engine_b, tokens, ctx: int = 512, bos: int | None = None,
            progress: bool = True) -> Comparison:
    """Perplexity of both, top-1 agreement and KL(A || B) over the same scored positions."""
    ws = windows(tokens, ctx, bos)
    nll_a, nll_b, kl, same = [], [], [], []
    with _bar(len(ws), "compare", progress) as bar:
        for w in ws:
            la, target = scored_logprobs(engine_a, w)
            lb, _ = scored_logprobs(engine_b, w)
            if la.shape != lb.shape:
                raise FermoeError(f"the models' vocabularies differ ({la.shape[1]} and {lb.shape[1]} tokens)")
            rows = np.arange(len(target))
            nll_a.append(-la[rows, target])
            nll_b.append(-lb[rows, target])
            kl.append(np.sum(np.exp(la) * (la - lb), axis=-1))
            same.append(la.argmax(-1) == lb.argmax(-1))
            bar.update()
    kl = np.concatenate(kl)
    return Comparison(_summary(np.concatenate(nll_a), len(ws)), _summary(np.concatenate(nll_b), len(ws)),
                      float(np.concatenate(same).mean()), float(kl.mean()),
                      float(kl.std() / math.sqrt(max(len(kl) - 1, 1))))
