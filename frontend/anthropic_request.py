"""An Anthropic Messages request -> the OpenAI chat request the chat path serves, and
Anthropic's error JSON.

- `system` (a string or text blocks) is the first message, role system. A `system` message
  inside `messages` (Claude Code's mid-conversation system message, beta
  `mid-conversation-system-...`: a string or text blocks) is a system message in its place,
  rendered as the chat path renders a late one (shared/chat.py: as a user message when the
  template takes only a first system message).
- A user message's `text` blocks are its text, its `image` blocks (a base64 source; a url
  source is refused: the server fetches nothing) its images, in place; each `tool_result`
  block is a `tool` message (its text; `is_error` changes nothing, the text says it), in the
  order given.
- An assistant message's `thinking` blocks are its reasoning (reasoning_content: the template
  decides where it goes), `redacted_thinking` is dropped, `text` is its content, `tool_use`
  its tool calls (`input` is the arguments object).
- `tools`: a custom tool (no `type`, or `custom`) needs `input_schema`, the function's
  parameters; Anthropic's server tools (`web_search_20250305`, `bash_...`: a `type` of their
  own) are left out with a log line, as the chat path leaves out non-function tools.
- `tool_choice`: auto -> auto, any -> required, tool -> the named function, none -> none;
  forced choices are the chat path's to honour or refuse (constrained decoding).
- `thinking`: `{"type": "enabled", "budget_tokens": N}` is `enable_thinking: true` with its
  reasoning ended (`</think>` forced) after N tokens; `adaptive` (Claude Code's) is on with the
  server's --reasoning-budget; `disabled` is `enable_thinking: false`; without it, the server's
  --reasoning decides. `output_config.effort` changes nothing here.
- `stop_sequences` are `stop`; `metadata`, `service_tier` and `cache_control` on any block
  change nothing here; other top-level fields clients add are logged and ignored, as agent
  clients send fields of newer API versions.
- Blocks fermoe cannot serve (document, search results...) and block types it does not know are a 400.
"""
from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import APIError
from .fields import INT64_MAX, MaxTokens, TopK
from .schemas import ChatCompletionRequest, _validation_error

log = logging.getLogger("fermoe.http")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}
SERVED_BLOCKS = {"system": ("text",), "user": ("text", "image", "tool_result"), "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}
UNSERVED_BLOCKS = ("document", "search_result", "container_upload", "server_tool_use",
                   "web_search_tool_result")


class AnthropicError(APIError):
    def body(self) -> dict:
        return {"type": "error", "error": {"type": ERROR_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}


def as_anthropic(e: APIError) -> AnthropicError:
    if isinstance(e, AnthropicError):
        return e
    message = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
    return AnthropicError(e.status, message, e.param, e.code, e.headers)


def invalid(where: str, message: str) -> AnthropicError:
    return AnthropicError(400, f"{where}: {message}", param=where)


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class _Lenient(msgspec.Struct, kw_only=True):
    @classmethod
    def decode(cls, raw: bytes):
        try:
            data = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise AnthropicError(400, "the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise AnthropicError(400, "the request body must be a JSON object")
        unknown = sorted(set(data) - set(cls.__struct_fields__))
        if unknown:
            log.info("ignored %s fields: %s", cls.__name__, ", ".join(unknown))
        try:
            return msgspec.convert({k: v for k, v in data.items() if k not in unknown}, cls)
        except msgspec.ValidationError as e:
            raise as_anthropic(_validation_error(str(e))) from None


class CountTokensRequest(_Lenient, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: MaxTokens
    stop_sequences: Annotated[list[str], Meta(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def chat_request(req: CountTokensRequest, stream: bool) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": _system(req.system) + _messages(req.messages), "stream": stream}
    if req.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None and req.tools:      # Anthropic takes a choice without tools; chat does not
        body.update(_tool_choice(req.tool_choice))
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise invalid("thinking.type", f"expected 'enabled', 'disabled' or 'adaptive', got {kind!r}")
        body["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
        if kind == "enabled":
            budget = req.thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise invalid("thinking.budget_tokens", f"thinking.budget_tokens: expected an integer >= 0, "
                                                        f"got {budget!r}")
            if budget > INT64_MAX:
                raise invalid("thinking.budget_tokens", f"expected an integer <= {INT64_MAX}, got {budget}")
            body["reasoning_budget"] = budget
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    try:
        return msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise as_anthropic(_validation_error(str(e))) from None


def _text_of(where: str, blocks, what: str) -> str:
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise invalid(f"{where}.{j}", f"{what} holds text blocks only, not {kind!r}")
        texts.append(b["text"])
    return "\n".join(texts)


def _system(system) -> list[dict]:
    if system is None:
        return []
    text = _text_of("system", system, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: list[Message]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        for j, b in enumerate(blocks):
            kind = b.get("type")
            if kind in UNSERVED_BLOCKS:
                raise invalid(f"messages.{i}.content.{j}", f"{kind} blocks are not supported (text only)")
            if kind not in SERVED_BLOCKS[m.role]:
                raise invalid(f"messages.{i}.content.{j}.type", f"unknown block type {kind!r} in {'an' if m.role == 'assistant' else 'a'} {m.role} message "
                                                                f"(expected one of {', '.join(SERVED_BLOCKS[m.role])})")
        if m.role == "system":
            out.append({"role": "system", "content": _text_of(f"messages.{i}.content", blocks, "a system message")})
        else:
            out += _user(i, blocks) if m.role == "user" else [_assistant(i, blocks)]
    return out


def _field(where: str, block: dict, name: str, kind: type):
    value = block.get(name)
    if not isinstance(value, kind):
        raise invalid(f"{where}.{name}", f"Field required ({kind.__name__})" if value is None else
                      f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _user(i: int, blocks: list[dict]) -> list[dict]:
    out, parts = [], []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b["type"] == "text":
            parts.append({"type": "text", "text": _field(where, b, "text", str)})
            continue
        if b["type"] == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_data_url(where, b)}})
            continue
        if parts:
            out.append({"role": "user", "content": parts})
            parts = []
        content = b.get("content", "")
        out.append({"role": "tool", "tool_call_id": _field(where, b, "tool_use_id", str),
                    "content": _text_of(f"{where}.content", content if content is not None else "", "tool_result")})
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _image_data_url(where: str, block: dict) -> str:
    """An image block's base64 source as the data: URL the chat path takes; a url source is
    refused (the server fetches nothing)."""
    source = _field(where, block, "source", dict)
    kind = source.get("type")
    if kind == "url":
        raise invalid(f"{where}.source", "url image sources are not fetched (the server fetches nothing); send "
                                         "the image as a base64 source")
    if kind != "base64":
        raise invalid(f"{where}.source.type", f"expected 'base64', got {kind!r}")
    media_type = _field(f"{where}.source", source, "media_type", str)
    if not media_type.startswith("image/"):
        raise invalid(f"{where}.source.media_type", f"expected an image/* type, got {media_type!r}")
    return f"data:{media_type};base64,{_field(f'{where}.source', source, 'data', str)}"


def _assistant(i: int, blocks: list[dict]) -> dict:
    reasoning, texts, calls = [], [], []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b["type"] == "thinking":
            reasoning.append(_field(where, b, "thinking", str))
        elif b["type"] == "text":
            texts.append({"type": "text", "text": _field(where, b, "text", str)})
        elif b["type"] == "tool_use":
            calls.append({"id": _field(where, b, "id", str), "type": "function", "function": {
                "name": _field(where, b, "name", str), "arguments": _field(where, b, "input", dict)}})
    message: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(i: int, tool: dict) -> dict:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        return {"type": kind}                          # a server tool: the chat path leaves it out, logged
    where = f"tools.{i}"
    schema = tool.get("input_schema")
    if schema is None:
        raise invalid(f"{where}.input_schema", "Field required: a custom tool needs its input_schema")
    if not isinstance(schema, dict):
        raise invalid(f"{where}.input_schema", "must be a JSON schema object")
    function = {"name": _field(where, tool, "name", str), "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict) -> dict:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        return out | {"tool_choice": kind}
    if kind == "any":
        return out | {"tool_choice": "required"}
    if kind == "tool":
        return out | {"tool_choice": {"type": "function", "function": {"name": _field("tool_choice", choice, "name",
                                                                                         str)}}}
    raise invalid("tool_choice.type", f"expected 'auto', 'any', 'tool' or 'none', got {kind!r}")
