"""The allowed-token mask of a constrained sequence, computed where its sampler runs.

llguidance needs the vocabulary as byte strings. A GGUF carries no tokenizer.json, so it is
built here from our own tokenizer (shared/tokenizer.py): each token's bytes as llama.cpp's
token_to_piece gives them, a special token's prefixed with 0xFF, llguidance's marker for a
token that grammars name `<...>` and that text never matches (llguidance/llamacpp.py does the
same). Special: control tokens, and user-defined ones written `<...>` (`<tool_call>`,
`<think>`, ... are user-defined in Qwen's GGUFs). Ids past the tokenizer's list, up to the
logits' width, are empty: never allowed. End-of-generation tokens are the tokenizer's
(eos_ids): once a grammar is complete they are the only tokens allowed.

Per step: the mask is a bitmask of ceil(V/32) int32 words (llguidance fills it, GIL released),
unpacked to V booleans; disallowed logits become -inf before the sampler sees them; the
sampled token then advances the matcher. llguidance never raises on a grammar error or a
rejected token: its matcher enters an error state, which is raised here as a GrammarError
(that sequence ends with an error; the worker serves on).
"""
from __future__ import annotations

import numpy as np

from .errors import GrammarError
from .tokenizer import CONTROL, UNKNOWN, USER_DEFINED

SPECIAL_MARK = b"\xff"


def _special(tok, i: int) -> bool:
    kind, text = tok.token_types[i], tok.tokens[i]
    return kind in (CONTROL, UNKNOWN) or (kind == USER_DEFINED and text.startswith("<") and text.endswith(">"))


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: token bytes, special ids, and an encoder of text."""

    def __init__(self, tok, n_vocab: int):
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eos_ids, default=0)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(tok.n_vocab) if _special(tok, i)]
        special = set(self.special_token_ids)
        self.tokens = [(SPECIAL_MARK if i in special else b"") + tok.piece_bytes(i) for i in range(tok.n_vocab)]
        self.tokens += [b""] * (n_vocab - tok.n_vocab)

    def __call__(self, text):
        if not isinstance(text, str):      # llguidance probes bytes first; text it is
            raise TypeError("text only")
        return self._tok.encode(text, add_bos=False)


def ll_tokenizer(tok, n_vocab: int | None = None):
    """llguidance's LLTokenizer of our tokenizer, for logits `n_vocab` wide (default: the
    tokenizer's size); built once per tokenizer (about a second at a 248k vocabulary)."""
    import llguidance
    n_vocab = n_vocab or tok.n_vocab
    cache = tok.__dict__.setdefault("_ll_tokenizers", {})
    if n_vocab not in cache:
        cache[n_vocab] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok, n_vocab)),
                                                n_vocab=n_vocab, eos_token=sorted(tok.eos_ids))
    return cache[n_vocab]


class TokenMask:
    """One sequence's matcher: `apply(logits)` masks what the grammar forbids next,
    `consume(token)` advances it by the sampled token."""

    def __init__(self, lltokenizer, grammar: str):
        import llguidance
        self.matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        self._raise_on_error()
        self.n_vocab = lltokenizer.vocab_size
        self.bits = np.zeros((1, (self.n_vocab + 31) // 32), np.int32)

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """Booleans, one per token id: which may come next."""
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self.matcher, self.bits, 0)
        self._raise_on_error()
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf."""
        allowed = self.allowed()[:len(logits)]
        allowed = np.pad(allowed, (0, len(logits) - len(allowed)))     # past the grammar's vocabulary: forbidden
        if not allowed.any():
            raise GrammarError("the grammar allows no token here")
        out = np.full_like(logits, -np.inf)
        out[allowed] = logits[allowed]
        return out

    def consume(self, token: int) -> None:
        self.matcher.consume_token(int(token))
        self._raise_on_error()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()
