"""A Hugging Face tokenizer directory -> the `tokenizer.*` GGUF keys llama.cpp writes."""
from __future__ import annotations

import json
from pathlib import Path

from shared.errors import ModelError

# llama.cpp token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
PRE_TOKENIZER = {"qwen35moe": "qwen35", "qwen3next": "qwen2"}


def _special_id(value, vocab: dict):
    """tokenizer_config.json names special tokens as strings or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return vocab.get(value) if isinstance(value, str) else None


def _chat_template(hf_dir: Path, tok_cfg: dict):
    jinja = hf_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):      # named templates: llama.cpp takes the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def hf_tokenizer_metadata(hf_dir, n_vocab: int, arch: str) -> dict:
    hf_dir = Path(hf_dir)
    path = hf_dir / "tokenizer.json"
    if not path.exists():
        raise ModelError(f"{hf_dir}: no tokenizer.json; the GGUF needs the model's tokenizer")
    tok = json.loads(path.read_text())
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise ModelError(f"{path}: tokenizer model {model.get('type')!r} is not byte-level BPE")
    vocab = dict(model["vocab"])
    types = {i: NORMAL for i in vocab.values()}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    if max(vocab.values()) >= n_vocab:
        raise ModelError(f"{path}: token id {max(vocab.values())} does not fit the model's vocab of {n_vocab}")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    token_types = [UNUSED] * n_vocab
    for text, i in vocab.items():
        tokens[i], token_types[i] = text, types[i]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    cfg_path = hf_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE_TOKENIZER[arch],
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(tok_cfg.get("add_bos_token", False)),
    }
    for key, field in (("eos_token_id", "eos_token"), ("padding_token_id", "pad_token"),
                       ("bos_token_id", "bos_token")):
        token_id = _special_id(tok_cfg.get(field), vocab)
        if token_id is not None:
            meta[f"tokenizer.ggml.{key}"] = token_id
    template = _chat_template(hf_dir, tok_cfg)
    if template:
        meta["tokenizer.chat_template"] = template
    return meta
