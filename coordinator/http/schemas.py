"""OpenAI's request bodies as strict msgspec Structs, and OpenAI's error JSON.

Field names and ranges are OpenAI's; `top_k`, `min_p`, `repeat_penalty` and
`ignore_eos` are the llama-server/vLLM extensions. Unknown fields are refused, as
OpenAI refuses them ("Unrecognized request argument supplied"); fields OpenAI
defines that change nothing here (`user`, `metadata`, `store`...) are accepted,
and ones whose meaning we cannot honour (`logprobs`, `tools`, `n` > 1...) are
refused by name in params.py.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepeatPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
TopK = Annotated[int, Meta(ge=-1)]                          # vLLM's -1 and llama.cpp's 0: off
MaxTokens = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-1)]                          # -1: random, as llama.cpp's
Stop = str | Annotated[list[str], Meta(max_length=16)] | None


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's; accepted, the usage comes once at the end


class ContentPart(_Body):
    """One part of a message's content; only text parts can be served (refused by name otherwise)."""
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(_Body, kw_only=True):
    """The fields chat and text completions share."""
    model: str | None = None               # OpenAI requires it; llama-server does not: the one model
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repeat_penalty: RepeatPenalty | None = None
    seed: Seed | None = None
    stop: Stop = None
    n: int | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # accepted and without effect here: everything is cached, and nothing is stored
    cache_prompt: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Body):
    """llama-server's /tokenize."""
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    """llama-server's /detokenize."""
    tokens: list[Annotated[int, Meta(ge=0)]]


# ---- errors ----------------------------------------------------------------------
class APIError(Exception):
    """An error answered as OpenAI answers it: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 501: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$(.*)`)?")
_MISSING = re.compile(r"Object missing required field `([^`]*)`(?: - at `\$(.*)`)?")
_AT = re.compile(r"(.*) - at `\$\.?(.*)`")


def decode_body(body: bytes, kind):
    """A request body as the Struct `kind`; any defect is an APIError 400 naming it."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    except msgspec.DecodeError:
        raise APIError(400, "We could not parse the JSON body of your request. (HINT: This likely means you "
                            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
                       code="invalid_json") from None


def _field(m: re.Match) -> str:
    where = (m.group(2) or "").lstrip(".")
    return f"{where}.{m.group(1)}" if where else m.group(1)


def _validation_error(text: str) -> APIError:
    """msgspec's message in OpenAI's words, with the offending field as `param`."""
    if m := _UNKNOWN.fullmatch(text):
        return APIError(400, f"Unrecognized request argument supplied: {_field(m)}", param=_field(m),
                        code="unknown_parameter")
    if m := _MISSING.fullmatch(text):
        return APIError(400, f"Missing required parameter: '{_field(m)}'.", param=_field(m),
                        code="missing_required_parameter")
    at = _AT.fullmatch(text)
    if at:
        return APIError(400, f"Invalid '{at.group(2)}': {at.group(1)}", param=at.group(2), code="invalid_value")
    return APIError(400, f"Invalid request: {text}", code="invalid_value")
