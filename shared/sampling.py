"""Token sampling as llama.cpp and vLLM users know it: temperature, top-k, top-p,
min-p and llama.cpp's penalties (repeat, frequency, presence); temperature 0 is
greedy. Seeded, so runs repeat."""
from __future__ import annotations

import math
import msgspec
import numpy as np

from .errors import FermoeError


class InvalidSampling(FermoeError, ValueError):
    """A sampling parameter out of its range (`field` names it). A ValueError too, so that
    msgspec reports it as a ValidationError when a message carrying it is decoded."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field


MAX_BIAS = 100.0                # OpenAI's bound on a logit bias
WHOLE_CONTEXT = 2**31 - 1       # repeat_last_n for llama.cpp's -1: the whole context


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How tokens are drawn, as one value: nested in the Generate a client sends and the
    Assign a worker gets, built from the command line by `fermoe generate`. Checked where
    it is made (constructed or decoded), so one that exists is valid: a bad temperature
    from a client is refused when the coordinator decodes its Generate, and nothing
    downstream checks again. llama.cpp's defaults."""
    temperature: float = 0.8
    top_k: int = 40              # 0: off
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64      # the penalties look this far back
    # OpenAI's names, applied as llama.cpp's penalties sampler applies penalty_freq and
    # penalty_present: over the same last repeat_last_n tokens, after the repeat penalty
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None      # None: the coordinator draws one when the request arrives
    # (token id, bias) added to the logits before every other sampler, as llama.cpp's logit
    # bias: a bias in [-100, 100], or -inf to ban the token
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repeat_penalty > 0, f"repeat_penalty must be > 0, got {self.repeat_penalty}"),
            (self.repeat_last_n >= 0, f"repeat_last_n must be >= 0, got {self.repeat_last_n}"),
            (self.seed is None or 0 <= self.seed < 2**64, f"seed must be in [0, 2**64), got {self.seed}"),
            (math.isfinite(self.frequency_penalty), f"frequency_penalty must be finite, got {self.frequency_penalty}"),
            (math.isfinite(self.presence_penalty), f"presence_penalty must be finite, got {self.presence_penalty}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise InvalidSampling(problem.split()[0], problem)
        for token, bias in self.logit_bias:
            if token < 0 or not (-MAX_BIAS <= bias <= MAX_BIAS or bias == -math.inf):
                raise InvalidSampling("logit_bias", f"logit_bias: token {token}: expected an id >= 0 and a bias in "
                                                    f"[-{MAX_BIAS:g}, {MAX_BIAS:g}] (or a ban), got {bias}")

    def replace(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)

    @classmethod
    def split(cls, kwargs: dict) -> tuple["SamplingParams", dict]:
        """(the sampling parameters among keyword arguments, the rest): what lets a caller
        write submit(prompt, temperature=0, max_tokens=8) with the struct built once here."""
        named = {k: kwargs[k] for k in cls.__struct_fields__ if k in kwargs}
        return cls(**named), {k: v for k, v in kwargs.items() if k not in named}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return cls.__struct_fields__


def with_defaults(sampling: SamplingParams, unset, defaults: dict) -> SamplingParams:
    """`sampling` with the fields named in `unset` (those its client left out) taken from
    `defaults` (the server's --temp, ...), where it has one."""
    chosen = {k: v for k, v in defaults.items() if k in unset}
    return sampling.replace(**chosen) if chosen else sampling


SAMPLE_STRIDE = 64      # top_k's threshold comes from every 64th logit


def top_k_order(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, largest first; equal logits by index (the k
    smallest of (-logit, index)). A threshold from a strided sample of the logits
    bounds the candidates, so one comparison over the vocabulary replaces most of a
    partition of it, the costly part at a 248k vocabulary; if fewer than k reach the
    threshold, the whole vocabulary is the candidate set."""
    sample = logits[::SAMPLE_STRIDE]
    rank = min(len(sample), 4 * -(-k // SAMPLE_STRIDE) + 8)     # ~4x the k expected above it
    threshold = np.partition(sample, len(sample) - rank)[len(sample) - rank]
    if threshold == -np.inf:
        # a grammar's mask left few tokens finite: those, then the first masked ones by index
        cand = np.flatnonzero(logits > -np.inf)
        if len(cand) < k:
            cand = np.concatenate([cand, np.flatnonzero(logits == -np.inf)[:k - len(cand)]])
    else:
        cand = np.flatnonzero(logits >= threshold)
    if len(cand) < k:
        cand = np.arange(len(logits))
    return cand[np.lexsort((cand, -logits[cand]))[:k]]


MAX_TOP_LOGPROBS = 20           # OpenAI's limit on top_logprobs


def logprobs_of(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(the log-probability of `token`, the `top` most likely tokens with theirs, most likely
    first) under the model's own distribution: the softmax of the logits before any
    sampling modifier (penalties, temperature, top-k/p, min-p), as vLLM reports them."""
    logits = np.asarray(logits, np.float32)
    m = float(logits.max())
    lse = m + float(np.log(np.sum(np.exp(logits - m), dtype=np.float64)))
    best = top_k_order(logits, top) if top else np.empty(0, np.int64)
    return float(logits[token]) - lse, [(int(t), float(logits[t]) - lse) for t in best]


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history=()) -> int:
        p = self.params
        # float64 only where it counts: the penalty, and the k survivors of top-k, widened
        # exactly from the logits as given (a float64 copy of a 248k vocabulary would
        # cost more than the rest of the sampling)
        logits = np.asarray(logits)
        if p.logit_bias:                            # first, as llama.cpp's chain applies it
            logits = logits.astype(np.float64)
            for token, bias in p.logit_bias:
                if token < len(logits):
                    logits[token] += bias
        if (p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty) and p.repeat_last_n and len(history):
            logits = logits.astype(np.float64)
            recent, counts = np.unique(np.asarray(history[-p.repeat_last_n:], dtype=np.int64), return_counts=True)
            vals = logits[recent]
            vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            logits[recent] = vals - counts * p.frequency_penalty - p.presence_penalty
        if p.temperature == 0:
            return int(np.argmax(logits))
        if p.top_k and p.top_k < len(logits):
            order = top_k_order(logits, p.top_k)    # a full sort of a 248k vocabulary would dominate a token
        else:
            order = np.argsort(-logits, kind="stable")
        top_logits = logits[order].astype(np.float64)
        probs = np.exp((top_logits - top_logits[0]) / p.temperature)
        probs /= probs.sum()
        keep = len(probs)
        if p.top_p < 1:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p) + 1))
        if p.min_p > 0:
            keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(keep, p=probs)])
