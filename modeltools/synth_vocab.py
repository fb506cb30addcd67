"""A synthetic Qwen-style vocabulary for generated test models.

`synth_tokenizer_metadata(n_vocab)` returns the `tokenizer.*` GGUF metadata of a byte-level BPE
vocabulary laid out the way llama.cpp's converter writes a Qwen3.5 one:

    ids [0, 256)             the 256 byte pieces (GPT-2 alphabet), NORMAL
    ids [256, 256 + M)       one token per merge learned from shared/data/*.txt, NORMAL
    next 26 ids              Qwen's added tokens: <|...|> ones CONTROL, <think>, <tool_call>...
                             USER_DEFINED (the converter's rule: special, or looks like <|...|>)
    up to n_vocab            "[PAD{id}]", UNUSED

The merges come from a small BPE trainer below: plain integer counting with ties broken by a
seeded BLAKE2 hash, so the result depends on nothing but the corpus and the seed.
GGUF types when written: tokens and merges string arrays, token_type an INT32 array, ids UINT32.
"""
from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

from shared.errors import ModelError
from shared.tokenizer import BYTE_TO_UNICODE, CONTROL, NORMAL, QWEN35_SPLIT, UNUSED, USER_DEFINED

DATA_DIR = Path(__file__).parent / "data"
MAX_MERGES = 2000

# Qwen's added tokens in their Qwen2.5/3/3.5 order; <|endoftext|> is the first after the BPE vocabulary.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)

# ChatML, as Qwen3 writes it; enable_thinking=false pre-fills an empty think block; an image
# part is `<|vision_start|><|image_pad|><|vision_end|>`, as Qwen3.5's template writes it.
CHAT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{- raise_exception('role must be system, user or assistant, not ' ~ message.role) }}
{%- endif %}
{%- if message.content is string %}
{%- set content = message.content %}
{%- else %}
{%- set ns = namespace(content='') %}
{%- for part in message.content %}
{%- if part.type == 'image' %}
{%- set ns.content = ns.content + '<|vision_start|><|image_pad|><|vision_end|>' %}
{%- else %}
{%- set ns.content = ns.content + part.text %}
{%- endif %}
{%- endfor %}
{%- set content = ns.content %}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def synth_tokenizer_metadata(n_vocab: int, seed: int = 0) -> dict:
    """tokenizer.* metadata of a Qwen3.5-style vocabulary of exactly `n_vocab` tokens."""
    n_fixed = 256 + len(QWEN_SPECIAL_TOKENS)
    if n_vocab < n_fixed:
        raise ModelError(f"synthetic vocabulary: n_vocab = {n_vocab} is below the {n_fixed} "
                         "byte and special tokens it must hold")
    merges = _train_merges(seed, min(MAX_MERGES, n_vocab - n_fixed))
    tokens = sorted(BYTE_TO_UNICODE.values())  # "!" first, as in Qwen's vocabulary
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:  # two merge paths may spell the same token; it is listed once
            seen.add(a + b)
            tokens.append(a + b)
    types = [NORMAL] * len(tokens)
    first_special = len(tokens)
    for text in QWEN_SPECIAL_TOKENS:
        tokens.append(text)
        types.append(CONTROL if text.startswith("<|") and text.endswith("|>") else USER_DEFINED)
    tokens.extend(f"[PAD{i}]" for i in range(len(tokens), n_vocab))
    types.extend([UNUSED] * (n_vocab - len(types)))
    special = {t: first_special + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        # As in a converted Qwen3.5 GGUF: EOS <|im_end|>, BOS <|endoftext|> (not added), PAD <|vision_pad|>.
        "tokenizer.ggml.eos_token_id": special["<|im_end|>"],
        "tokenizer.ggml.bos_token_id": special["<|endoftext|>"],
        "tokenizer.ggml.padding_token_id": special["<|vision_pad|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def _corpus_words() -> Counter:
    """Byte-level pre-tokenised words of the corpus, with their counts."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(DATA_DIR.glob("*.txt")))
    split = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return Counter(word for word, _ in split.pre_tokenize_str(text))


@lru_cache(maxsize=16)
def _train_merges(seed: int, max_merges: int) -> tuple[tuple[str, str], ...]:
    """Greedy BPE: merge the most frequent adjacent pair until `max_merges` or no pair repeats."""
    counts = _corpus_words()
    words = [list(w) for w in sorted(counts)]
    freq = [counts[w] for w in sorted(counts)]
    pair_count: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pair_count[p] += freq[i]
            where.setdefault(p, set()).add(i)

    def tiebreak(p):  # seeded, stable across Python versions and machines
        return hashlib.blake2b(f"{seed}\x00{p[0]}\x00{p[1]}".encode(), digest_size=8).digest()

    heap = [(-c, tiebreak(p), p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges, done = [], set()
    while heap and len(merges) < max_merges:
        neg, key, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry; the live count was pushed again when it changed
        if -neg < 2:
            break
        if pair in done:
            continue  # a later merge re-spelled a merged pair; it is not learned twice
        done.add(pair)
        merges.append(pair)
        changed = set()
        for i in where.pop(pair):
            _merge_word(words, freq, i, pair, pair_count, where, changed)
        for p in changed:
            if pair_count.get(p, 0) > 0:
                heapq.heappush(heap, (-pair_count[p], tiebreak(p), p))
    return tuple(merges)


def _merge_word(words, freq, i, pair, pair_count, where, changed):
    old = words[i]
    for p in zip(old, old[1:]):
        pair_count[p] -= freq[i]
        changed.add(p)
    new, j = [], 0
    while j < len(old):
        if j + 1 < len(old) and (old[j], old[j + 1]) == pair:
            new.append(old[j] + old[j + 1])
            j += 2
        else:
            new.append(old[j])
            j += 1
    words[i] = new
    for p in zip(new, new[1:]):
        pair_count[p] += freq[i]
        changed.add(p)
        where.setdefault(p, set()).add(i)
