"""The Qwen-style chat template (shared/chat_template.py, the built-in model's) on the
synthetic vocabulary: a tokenizer that renders tools, calls, results and reasoning as the
Qwen3.6 template does, for tests that need no trained model."""
from __future__ import annotations

from shared.chat_template import QWEN_STYLE_TEMPLATE
from modeltools.synth_vocab import synth_tokenizer_metadata
from shared.tokenizer import Tokenizer

__all__ = ["QWEN_STYLE_TEMPLATE", "qwen_style_metadata", "qwen_style_tokenizer"]


def qwen_style_metadata(n_vocab: int = 1024) -> dict:
    return {**synth_tokenizer_metadata(n_vocab), "tokenizer.chat_template": QWEN_STYLE_TEMPLATE}


def qwen_style_tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata(qwen_style_metadata())
