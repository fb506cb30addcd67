"""The model's tokenizer and chat template, built from GGUF metadata as llama.cpp stores it.

A GGUF carries no tokenizer.json: the vocabulary (`tokenizer.ggml.tokens`, byte-level pieces),
the merge ranks, a type per token and the name of the pre-tokenizer (`tokenizer.ggml.pre`).
We rebuild llama.cpp's byte-level BPE from those with the `tokenizers` library:

    text -> split out special tokens (control, user-defined, unknown: matched whole)
         -> each remaining fragment split by the pre-tokenizer regex
         -> bytes mapped to GPT-2's printable alphabet -> BPE merges by rank -> ids

Like llama.cpp, and unlike Hugging Face's Qwen tokenizer.json, no NFC normalisation is applied.
Decoding follows llama.cpp's token_to_piece: control/user-defined tokens render as their text,
normal tokens as their bytes, unused ones as nothing.
"""
from __future__ import annotations

import codecs
import json
from datetime import datetime
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from shared.errors import ChatTemplateError, ModelError

# Token types, as llama.cpp numbers them (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, as in llama.cpp src/llama-vocab.cpp (LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35,
# the "original regex from tokenizer.json" comments) and transformers' Qwen2/Qwen3.5 tokenizers.
# Qwen3.5 differs from Qwen2 by \p{M}: combining marks stay with their letters and out of
# punctuation runs. Digits are split one by one in both.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre names llama.cpp maps onto these two regexes.
PRE_TOKENIZER_SPLITS = {
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "qwen35": QWEN35_SPLIT,
}

# Token texts llama.cpp treats as end of generation (llama-vocab.cpp, special_eog_ids):
# the end-of-turn family plus the FIM pad/repo/file-separator tokens.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>", "<|fim_pad|>", "<|repo_name|>", "<|fim_repo|>", "<|file_sep|>",
})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_UNICODE = bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def byte_level_decode(piece: str) -> bytes:
    """Bytes of a byte-level piece; a character outside the alphabet stands for its own UTF-8."""
    out = bytearray()
    for ch in piece:
        b = UNICODE_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _meta_list(meta: dict, key: str, required: bool = True) -> list | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise ModelError(f"tokenizer metadata: missing key {key!r}")
        return None
    return list(value)


def _as_text(value) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def _meta_id(meta: dict, key: str, n_vocab: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < n_vocab:
        raise ModelError(f"tokenizer metadata: {key} = {value} is outside the vocabulary of {n_vocab}")
    return value


class Tokenizer:
    """Byte-level BPE tokenizer (llama.cpp's "gpt2" model) with the file's chat template."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                 eos_id: int | None = None, bos_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None, extra_eog=()):
        if pre not in PRE_TOKENIZER_SPLITS:
            raise ModelError(f"tokenizer.ggml.pre = {pre or '(missing)'!r} is not supported "
                             f"(supported: {sorted(PRE_TOKENIZER_SPLITS)})")
        if len(token_types) != len(tokens):
            raise ModelError(f"tokenizer metadata: {len(token_types)} token types for {len(tokens)} tokens")
        self.tokens = tokens
        self.token_types = token_types
        self.merges = merges
        self.pre = pre
        self.n_vocab = len(tokens)
        self.eos_id, self.bos_id, self.pad_id = eos_id, bos_id, pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            seen = set()
            dup = next(t for t in tokens if t in seen or seen.add(t))
            raise ModelError(f"tokenizer.ggml.tokens: duplicate token {dup!r}")
        self.token_to_id = vocab
        self._hf = _build_backend(vocab, merges, tokens, token_types, PRE_TOKENIZER_SPLITS[pre])
        self.special_ids = {i for i, t in enumerate(token_types) if t in (CONTROL, UNKNOWN)}
        self.eos_ids = self._eog_ids() | set(extra_eog)
        self._piece_cache: dict[int, bytes] = {}

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from a GGUF metadata dict (keys as llama.cpp writes them)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelError(f"tokenizer.ggml.model = {model!r} is not supported "
                             "(only 'gpt2', byte-level BPE)")
        tokens = [_as_text(t) for t in _meta_list(meta, "tokenizer.ggml.tokens")]
        types = _meta_list(meta, "tokenizer.ggml.token_type", required=False)
        types = [int(t) for t in types] if types is not None else [NORMAL] * len(tokens)
        merges = [_as_text(m) for m in _meta_list(meta, "tokenizer.ggml.merges")]
        n = len(tokens)
        return cls(
            tokens, types, merges, pre=_as_text(meta.get("tokenizer.ggml.pre", "")),
            eos_id=_meta_id(meta, "tokenizer.ggml.eos_token_id", n),
            bos_id=_meta_id(meta, "tokenizer.ggml.bos_token_id", n),
            pad_id=_meta_id(meta, "tokenizer.ggml.padding_token_id", n),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=_as_text(template) if (template := meta.get("tokenizer.chat_template")) else None,
            extra_eog=[i for k in ("eot_token_id", "eom_token_id")
                       if (i := _meta_id(meta, f"tokenizer.ggml.{k}", n)) is not None],
        )

    def _eog_ids(self) -> set[int]:
        ids = {self.token_to_id[t] for t in _EOG_TEXTS if t in self.token_to_id}
        if self.eos_id is not None:
            ids.add(self.eos_id)
        return ids

    # ---- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised as such.
        BOS is prepended when `add_bos` (default: tokenizer.ggml.add_bos_token) and a BOS id exist."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def piece_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (llama.cpp token_to_piece with special=true)."""
        cached = self._piece_cache.get(token_id)
        if cached is None:
            cached = self._piece_cache[token_id] = self._piece(int(token_id))
        return cached

    def _piece(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.n_vocab}")
        text, kind = self.tokens[token_id], self.token_types[token_id]
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            return text.encode("utf-8")
        if kind == NORMAL:
            return byte_level_decode(text)
        if kind == BYTE:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])
            return byte_level_decode(text)
        return b""  # unused / undefined tokens render as nothing, as in llama.cpp

    def decode_bytes(self, ids, skip_special: bool = False) -> bytes:
        return b"".join(self.piece_bytes(i) for i in ids
                        if not (skip_special and int(i) in self.special_ids))

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. `skip_special` drops control tokens."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    # ---- chat template -----------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render tokenizer.chat_template the way transformers' apply_chat_template renders it."""
        if not self.chat_template:
            raise ModelError("the model has no chat template (tokenizer.chat_template is missing); "
                             "pass raw text instead")
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        context = {k: self.tokens[i] for k, i in names.items() if i is not None}
        context.update(kwargs)
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, **context)


def _build_backend(vocab: dict, merges: list[str], tokens: list[str], types: list[int],
                   split: str) -> _HFTokenizer:
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            raise ModelError(f"tokenizer.ggml.merges: malformed merge {m!r}")
        pairs.append((m[:cut], m[cut + 1:]))
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    except Exception as e:  # the library names the merge whose parts are not in the vocabulary
        raise ModelError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from e
    hf = _HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    # Control/unknown tokens are special, user-defined ones plain added tokens: both matched whole.
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)
    return hf


class StreamDecoder:
    """Incremental detokeniser: feed ids one at a time, get back the text that is now complete.

    Bytes of a UTF-8 sequence split across tokens are held until the sequence completes, so a
    streamed emoji never shows up as two replacement characters. `"".join(feeds) + flush()`
    equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if self.skip_special and int(token_id) in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(self.tokenizer.piece_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever is held back (an incomplete sequence becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


# ---- chat template rendering (mirrors transformers' chat_template_utils) ------------------------

def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **context) -> str:
    """Render a Hugging Face style chat template: sandboxed, trim_blocks, lstrip_blocks,
    loopcontrols, raise_exception(), strftime_now(), and a tojson that does not escape HTML."""
    import jinja2
    context = {"tools": None, "documents": None, **context}  # transformers always defines these
    messages = [_alias_reasoning(m) for m in messages]
    try:
        compiled = _compile_template(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"tokenizer.chat_template does not parse: {e} (line {e.lineno})") from e
    except jinja2.TemplateError as e:  # raise_exception() in the template: the messages are at fault
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e


def check_chat_template(template: str) -> None:
    """A ModelError naming the problem when `template` does not parse (checked at start for a
    template given on the command line)."""
    import jinja2
    try:
        _compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"the chat template does not parse: {e} (line {e.lineno})") from e


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    # transformers copies a message's reasoning under every name templates read it by
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=8)
def _compile_template(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks; render as is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
