"""shared/token_mask.py: the vocabulary llguidance reads (special tokens marked, the padding up to
the logits' width, the end-of-generation and BOS ids, encoding without BOS), its cache, and
how a mask is applied to logits wider than the vocabulary. The grammars' masks themselves are
tested in test_grammar.py."""
from types import SimpleNamespace

import numpy as np
import pytest

from shared.errors import GrammarError
from shared.grammar import full_grammar, json_schema_text
from shared.model import Model
from shared.token_mask import SPECIAL_MARK, TokenMask, _special, _Vocabulary, ll_tokenizer
from shared.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED


class FakeTok(SimpleNamespace):
    """What _Vocabulary reads of shared.tokenizer.Tokenizer, and the encode calls it makes."""

    def piece_bytes(self, i):
        return self.tokens[i].encode()

    def encode(self, text, add_bos=None):
        self.calls.append((text, add_bos))
        return [len(text)]


def fake(eos_id=3, eos_ids=(3, 2), bos_id=1):
    tokens = ["a", "<s>", "</s>", "<eos>", "<tool_call>", "<b", "x>", "<unk>", "\x00"]
    types = [NORMAL, CONTROL, CONTROL, CONTROL, USER_DEFINED, USER_DEFINED, USER_DEFINED, UNKNOWN, BYTE]
    return FakeTok(tokens=tokens, token_types=types, n_vocab=len(tokens), eos_id=eos_id, eos_ids=set(eos_ids),
                   bos_id=bos_id, calls=[])


def test_special_tokens_are_control_unknown_and_user_defined_in_angle_brackets():
    """Fault guarded: a user-defined token that is no `<...>` tag marked special (then no text
    could match it)."""
    tok = fake()
    assert [i for i in range(tok.n_vocab) if _special(tok, i)] == [1, 2, 3, 4, 7]


def test_the_vocabulary_llguidance_reads():
    """Each token's bytes, special ones behind 0xFF, empty ids up to the logits' width (fault:
    the marks or the padding wrong, its length off)."""
    v = _Vocabulary(fake(), 12)
    assert v.tokens == [b"a", SPECIAL_MARK + b"<s>", SPECIAL_MARK + b"</s>", SPECIAL_MARK + b"<eos>",
                        SPECIAL_MARK + b"<tool_call>", b"<b", b"x>", SPECIAL_MARK + b"<unk>", b"\x00",
                        b"", b"", b""]
    assert v.special_token_ids == [1, 2, 3, 4, 7] and (v.eos_token_id, v.bos_token_id) == (3, 1)
    assert len(_Vocabulary(fake(), 9).tokens) == 9


@pytest.mark.parametrize("eos_id, eos_ids, expected", [(3, (3, 2), 3), (None, (5, 2), 2), (None, (), 0)])
def test_the_eos_id_falls_back_to_the_smallest_end_of_generation_id(eos_id, eos_ids, expected):
    assert _Vocabulary(fake(eos_id, eos_ids), 9).eos_token_id == expected


def test_text_is_encoded_without_bos_and_bytes_are_refused():
    """llguidance encodes grammar literals through it: a BOS in front would be matched too
    (fault: add_bos left to the tokenizer's default)."""
    tok = fake()
    v = _Vocabulary(tok, 9)
    assert v("hi") == [2] and tok.calls == [("hi", False)]
    with pytest.raises(TypeError, match="^text only$"):
        v(b"hi")


@pytest.fixture(scope="module")
def tok(tiny_q4_path):
    return Model(str(tiny_q4_path)).tokenizer


def test_ll_tokenizer_is_built_once_per_width_with_the_eos_ids(tok):
    """Fault guarded: the cache missed (a second per request), the width or the end tokens not
    passed to llguidance."""
    assert ll_tokenizer(tok) is ll_tokenizer(tok, tok.n_vocab)
    wide = ll_tokenizer(tok, tok.n_vocab + 7)
    assert wide is ll_tokenizer(tok, tok.n_vocab + 7) and wide is not ll_tokenizer(tok)
    assert wide.vocab_size == tok.n_vocab + 7 and sorted(wide.eos_tokens) == sorted(tok.eos_ids)


def test_apply_on_logits_wider_than_the_vocabulary(tok):
    """Ids past the mask's width are never allowed, and the logits keep their dtype (fault: the
    padding of the mask wrong, or float16 logits turned float32)."""
    mask = TokenMask(ll_tokenizer(tok), full_grammar("json_schema", json_schema_text({"type": "integer"}), False))
    allowed = mask.allowed()
    assert allowed.dtype == bool and len(allowed) == tok.n_vocab
    logits = np.arange(tok.n_vocab + 5, dtype=np.float16)
    out = mask.apply(logits)
    assert out.dtype == np.float16 and len(out) == tok.n_vocab + 5
    assert np.array_equal(np.isfinite(out), np.concatenate([allowed, np.zeros(5, bool)]))
    assert np.array_equal(out[:tok.n_vocab][allowed], logits[:tok.n_vocab][allowed])
    first = int(np.flatnonzero(allowed)[0]) + 2                  # narrower logits: the mask's first ids
    assert np.array_equal(np.isfinite(mask.apply(np.zeros(first, np.float32))), allowed[:first])


def test_a_mask_allowing_nothing_says_so(tok):
    mask = TokenMask(ll_tokenizer(tok), full_grammar("json_schema", json_schema_text({"type": "integer"}), False))
    digits = [t for t in range(tok.n_vocab) if mask.allowed()[t]]
    with pytest.raises(GrammarError, match="^the grammar allows no token here$"):
        mask.apply(np.zeros(min(digits), np.float32))           # only ids the grammar forbids


def test_the_mask_covers_a_vocabulary_not_a_multiple_of_32(tok):
    """Fault guarded: the bitmask's words counted short (a width past 32 words' bits)."""
    mask = TokenMask(ll_tokenizer(tok, tok.n_vocab + 7), full_grammar("json_schema", "{}", False))
    assert len(mask.allowed()) == tok.n_vocab + 7


def test_a_matcher_error_is_raised_with_llguidances_reason(tok):
    mask = TokenMask(ll_tokenizer(tok), full_grammar("json_schema", json_schema_text({"type": "integer"}), False))
    with pytest.raises(GrammarError, match="^grammar: .+"):
        mask.consume(tok.encode("x", add_bos=False)[0])
