"""Tokenizer, chat template and synthetic vocabulary.

Oracles: transformers' own GGUF tokenizer conversion and apply_chat_template (marked `oracle`),
and a small pure-Python transcription of llama.cpp's BPE session (regex split with the `regex`
module, merges by rank, special tokens partitioned out longest first).
"""
import hashlib

import pytest

from shared.errors import ModelError
from modeltools.synth_vocab import synth_tokenizer_metadata
from shared.tokenizer import (CONTROL, UNICODE_TO_BYTE, UNKNOWN, USER_DEFINED, BYTE_TO_UNICODE,
                              Tokenizer)

SAMPLES = [
    "Hello, world!",
    "The quick brown fox doesn't jump; it'LL wait. WE'RE done.",
    "你好，世界！今天是2026年8月13日",
    "emoji 🎉🦙 and a family 👨‍👩‍👧 and flags 🇳🇴",
    "  leading spaces\n\n\n   trailing spaces   \n\t\ttabs\r\n",
    "digits 0 12 345 6789 3.14159 1,000,000",
    "café naïve e\u0301 a\u0308 cafe\u0301",  # precomposed and combining marks
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
    "<|im_start|><|im_start|>x<|endoftext|>",
    "",
    "   ",
    "\n",
]


@pytest.fixture(scope="module")
def meta():
    return synth_tokenizer_metadata(1024)


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_metadata(meta)


# ---- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    im_start = tok.token_to_id["<|im_start|>"]
    think = tok.token_to_id["<think>"]
    ids = tok.encode("<|im_start|>user<think>")
    assert ids[0] == im_start and ids[-1] == think
    assert tok.encode("<|im_end|>") == [tok.eos_id]


def test_piece_bytes(tok):
    assert tok.piece_bytes(tok.token_to_id[BYTE_TO_UNICODE[0xF0]]) == b"\xf0"
    assert tok.piece_bytes(tok.token_to_id["Ġthe"]) == b" the"
    assert tok.piece_bytes(tok.eos_id) == b"<|im_end|>"
    assert tok.piece_bytes(tok.n_vocab - 1) == b""  # [PAD..] unused tokens render as nothing
    assert tok.decode([tok.eos_id], skip_special=True) == ""
    assert tok.decode([tok.token_to_id["<think>"]], skip_special=True) == "<think>"  # user-defined


def test_eos_ids_follow_llama_cpp_eog(tok):
    names = {tok.tokens[i] for i in tok.eos_ids}
    assert names == {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}


def test_qwen2_and_qwen35_split_differ_on_combining_marks(meta):
    q2 = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "qwen2"})
    q35 = Tokenizer.from_metadata(meta)
    text = "cafe\u0301!"
    assert q2.decode(q2.encode(text)) == q35.decode(q35.encode(text)) == text
    # qwen35 keeps U+0301 with the letters, qwen2 glues it to the "!" punctuation run
    assert reference_encode(q2, text, QWEN2_LLAMA) == q2.encode(text)
    assert reference_encode(q35, text, QWEN35_LLAMA) == q35.encode(text)


# ---- a transcription of llama.cpp's BPE, as a second oracle --------------------------------------

# llama.cpp's active patterns (llama-vocab.cpp): the contractions spelled out instead of (?i:...).
QWEN2_LLAMA = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_LLAMA = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
                r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def reference_encode(tok, text, pattern):
    regex = pytest.importorskip("regex")
    ranks = {}
    for i, m in enumerate(tok.merges):
        ranks.setdefault(tuple(m.split(" ", 1)), i)
    kinds = (CONTROL, UNKNOWN, USER_DEFINED)
    specials = sorted((t for t, k in zip(tok.tokens, tok.token_types) if k in kinds), key=len, reverse=True)
    fragments = [text]
    for sp in specials:  # partition out special tokens, longest first
        out = []
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            parts = frag.split(sp)
            for k, part in enumerate(parts):
                if k:
                    out.append(tok.token_to_id[sp])
                if part:
                    out.append(part)
        fragments = out
    ids = []
    for frag in fragments:
        if isinstance(frag, int):
            ids.append(frag)
            continue
        for word in regex.findall(pattern, frag):
            symbols = [BYTE_TO_UNICODE[b] for b in word.encode("utf-8")]
            while len(symbols) > 1:
                best = min(range(len(symbols) - 1),
                           key=lambda j: (ranks.get((symbols[j], symbols[j + 1]), 1 << 60), j))
                if (symbols[best], symbols[best + 1]) not in ranks:
                    break
                symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
            ids.extend(tok.token_to_id[s] for s in symbols)
    return ids


@pytest.mark.parametrize("text", SAMPLES)
def test_matches_llama_cpp_transcription(tok, text):
    assert tok.encode(text) == reference_encode(tok, text, QWEN35_LLAMA)


# ---- transformers as the oracle ----------------------------------------------------------------

def hf_tokenizer(meta):
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                        convert_gguf_tokenizer)
    fields = {name: meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in meta}
    backend, _ = convert_gguf_tokenizer("qwen35", fields)
    tokens = meta["tokenizer.ggml.tokens"]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
        bos_token=tokens[meta["tokenizer.ggml.bos_token_id"]],
        eos_token=tokens[meta["tokenizer.ggml.eos_token_id"]],
        pad_token=tokens[meta["tokenizer.ggml.padding_token_id"]])


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["qwen35", "qwen2"])
def test_ids_match_transformers_gguf_conversion(meta, pre):
    meta = {**meta, "tokenizer.ggml.pre": pre}
    hf = hf_tokenizer(meta)
    ours = Tokenizer.from_metadata(meta)
    for text in SAMPLES:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer with 🎉."},
    {"role": "assistant", "content": "4 🎉", "reasoning": "two and two"},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "3+3?"}]},
]

# Exercises what Hub templates lean on: namespace, tojson, loop controls, raise_exception,
# bos_token/eos_token, whitespace control under trim_blocks/lstrip_blocks, extra kwargs.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.system = m.content %}
        {% continue %}
    {% endif %}
    {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
[{{ m.role | upper }}] {{ m.content if m.content is string else m.content | tojson }}
    {%- if m.reasoning_content %} ({{ m.reasoning_content }}){% endif %}
    {% if loop.last %}{% break %}{% endif %}
{% endfor %}
{% if ns.system %}system={{ ns.system | tojson }}{% endif %}
{% if tools is defined %}tools={{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token if not add_generation_prompt }}"""


@pytest.mark.oracle
@pytest.mark.parametrize("template", ["synth", "rich"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(meta, template, add_generation_prompt):
    meta = dict(meta)
    if template == "rich":
        meta["tokenizer.chat_template"] = RICH_TEMPLATE
    hf = hf_tokenizer(meta)
    ours = Tokenizer.from_metadata(meta)
    tools = [{"type": "function", "function": {"name": "add", "description": "a <b> & c"}}]
    for kwargs in ({}, {"enable_thinking": False}, {"tools": tools}):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False,
                                          add_generation_prompt=add_generation_prompt, **kwargs)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt,
                                        **kwargs) == expected


def test_synth_chat_template_is_chatml(tok):
    text = tok.apply_chat_template(MESSAGES[:2])
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2? Answer with 🎉.<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(MESSAGES[:2], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template_is_a_model_error(meta):
    bare = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    with pytest.raises(ModelError, match="chat template"):
        Tokenizer.from_metadata(bare).apply_chat_template(MESSAGES)


# ---- streaming ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [SAMPLES[2], SAMPLES[3], SAMPLES[8], "a🦙b"])
def test_stream_decoder_pieces_join_to_decode(tok, text):
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_back_split_emoji(tok):
    ids = tok.encode("🦙")
    assert len(ids) == 4  # no merges cover it: one token per byte
    stream = tok.stream_decoder()
    assert [stream.feed(i) for i in ids] == ["", "", "", "🦙"]
    stream = tok.stream_decoder()
    assert stream.feed(ids[0]) == "" and stream.flush() == "\ufffd"  # truncated stream


# ---- synthetic vocabulary ----------------------------------------------------------------------

@pytest.mark.parametrize("n_vocab", [512, 248_320])
def test_synth_vocab_size(n_vocab):
    m = synth_tokenizer_metadata(n_vocab)
    assert len(m["tokenizer.ggml.tokens"]) == len(m["tokenizer.ggml.token_type"]) == n_vocab
    assert len(set(m["tokenizer.ggml.tokens"])) == n_vocab
    assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.pre"] == "qwen35"
    assert 200 <= len(m["tokenizer.ggml.merges"]) <= 2000
    if n_vocab > 4096:
        assert m["tokenizer.ggml.tokens"][-1] == f"[PAD{n_vocab - 1}]"
    assert set(m["tokenizer.ggml.tokens"][:256]) == set(UNICODE_TO_BYTE)
    tok = Tokenizer.from_metadata(m)
    assert tok.n_vocab == n_vocab
    assert tok.decode(tok.encode(SAMPLES[8])) == SAMPLES[8]


def test_synth_vocab_is_deterministic():
    from modeltools.synth_vocab import _train_merges
    a = synth_tokenizer_metadata(4096, seed=0)
    _train_merges.cache_clear()
    b = synth_tokenizer_metadata(4096, seed=0)
    assert a == b
    assert synth_tokenizer_metadata(4096, seed=1)["tokenizer.ggml.merges"] != a["tokenizer.ggml.merges"]
    # pinned: a change here means generated models get a different vocabulary
    digest = hashlib.sha256("\n".join(a["tokenizer.ggml.merges"]).encode()).hexdigest()
    assert digest == PINNED_MERGES_SHA256


PINNED_MERGES_SHA256 = "47d32815561b30cb8deb2c8791937e88bdc7bad0e63bc31201c8152b4cbd2439"


def test_synth_vocab_too_small():
    with pytest.raises(ModelError, match="n_vocab"):
        synth_tokenizer_metadata(100)


# ---- bad metadata ------------------------------------------------------------------------------

def test_accepts_gguf_reader_types(meta):
    # a GGUF reader may hand back numpy arrays and bytes
    np = pytest.importorskip("numpy")
    raw = {**meta, "tokenizer.ggml.token_type": np.asarray(meta["tokenizer.ggml.token_type"], np.int32),
           "tokenizer.ggml.tokens": [t.encode() for t in meta["tokenizer.ggml.tokens"]],
           "tokenizer.ggml.eos_token_id": np.uint32(meta["tokenizer.ggml.eos_token_id"])}
    tok = Tokenizer.from_metadata(raw)
    assert tok.encode(SAMPLES[8]) == Tokenizer.from_metadata(meta).encode(SAMPLES[8])


def test_unsupported_tokenizer_model(meta):
    with pytest.raises(ModelError, match="'llama'"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.model": "llama"})


def test_unsupported_pre_tokenizer(meta):
    with pytest.raises(ModelError, match="'llama3'"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "llama3"})


def test_bad_merge_is_a_model_error(meta):
    with pytest.raises(ModelError, match="merges"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.merges": ["Ġ zzzzqqq"]})
