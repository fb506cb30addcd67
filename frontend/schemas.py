"""OpenAI's request bodies as strict msgspec Structs, and their decoding into 400s.

Field names and ranges are OpenAI's; `top_k`, `min_p`, `repeat_penalty` and
`ignore_eos` are the llama-server/vLLM extensions, and llama-server's own fields are
declared in llama_server_request.py. Unknown fields are refused, as OpenAI refuses them
("Unrecognized request argument supplied"); fields OpenAI defines that change
nothing here (`user`, `metadata`, `store`...) are accepted, and ones whose meaning
we cannot honour (`logprobs`, `n` > 1, a forced `tool_choice`...) are refused by name in
openai_request.py.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import APIError
from .fields import Body as _Body
from .fields import INT64_MAX, Int, MaxTokens, Penalty, RepeatPenalty, Seed, Stop, Temperature, TokenId, TopK, TopP
from .llama_server_request import LlamaServerFields

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "TokenizeRequest",
           "decode_body"]


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's; accepted, the usage comes once at the end


class ContentPart(_Body):
    """One part of a message's content: text, or image_url (a data: URL; others are refused by name)."""
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"      # OpenAI's JSON text; the object itself is taken too


class ToolCall(_Body):
    """A call in an assistant message of the history."""
    function: FunctionCall
    id: str | None = None
    type: str = "function"
    index: int | None = None                     # clients that rebuild messages from stream deltas keep it


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # an assistant's reasoning under the names clients send it by (llama-server's, vLLM's, transformers')
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # what OpenAI's own replies carry, sent back by clients that keep them: no effect here
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class _Sampling(LlamaServerFields, kw_only=True):
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
    n: Int | None = None
    logprobs: Any = None
    top_logprobs: Int | None = None
    logit_bias: Any = None                 # OpenAI's object; /completion takes llama-server's lists too
    ignore_eos: bool = False
    user: str | None = None
    # accepted and without effect here: nothing is stored
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
    reasoning_effort: str | None = None         # "none", "minimal": thinking off; low... xhigh: on
    # fermoe's own: reasoning tokens before their end is forced (-1 no limit; null: the server's
    # --reasoning-budget); Anthropic's thinking.budget_tokens arrives here
    reasoning_budget: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    # vLLM's: a final assistant message is continued (llama-server's default for one) or a new
    # turn starts after it
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None


class TokenizeRequest(_Body):
    """llama-server's /tokenize."""
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    """llama-server's /detokenize."""
    tokens: list[TokenId]


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
    except RecursionError:
        raise _too_deep() from None


def decode_object(body: bytes) -> dict:
    """A request body as a plain JSON object, for endpoints that look at its fields before
    typing it; not JSON, or not an object, is a 400."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise APIError(400, "We could not parse the JSON body of your request.", code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def _too_deep() -> APIError:
    """A body nested past the JSON decoder's recursion bound (its free-form fields are bounded
    tighter still by the coordinator: protocol.MAX_NESTING)."""
    return APIError(400, "the JSON body nests arrays or objects too deeply to be parsed", code="invalid_json")


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
