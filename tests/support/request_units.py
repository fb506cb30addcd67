"""What the front end's in-process translation tests share: a chat or text completion request
decoded and turned into its Generate as the routes do, and a struct's set fields as plain data."""
from __future__ import annotations

import json

import msgspec

from frontend import openai_request
from frontend.schemas import ChatCompletionRequest, CompletionRequest, decode_body
from shared import protocol as P


def chat_generate(messages: list, /, **fields) -> P.Generate:
    """`messages` unless the fields give their own."""
    body = decode_body(json.dumps({"messages": messages} | fields).encode(), ChatCompletionRequest)
    return openai_request.chat_generate(body)


def completion_generate(**fields) -> P.Generate:
    body = decode_body(json.dumps({"prompt": "x"} | fields).encode(), CompletionRequest)
    return openai_request.completion_generate(body)


def set_fields(value):
    """A struct as plain data without its unset (None) fields, so that a test names only the
    fields the conversion sets."""
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if isinstance(value, dict):
        return {k: set_fields(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [set_fields(v) for v in value]
    return value
