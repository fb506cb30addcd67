"""An OpenAI Responses request -> the chat request the chat path serves.

- `instructions` is the first message, role system; `input` is a string (one user message)
  or a list of items: messages (`input_text` / `output_text` parts, and in user messages
  `input_image` parts with a base64 data: URL; role developer is system, as on chat), `function_call` items (the previous assistant turn's calls, merged into it),
  `function_call_output` items (tool messages, matched by `call_id`), and `reasoning` items
  (their `content` text, else their `summary` text, is the next assistant turn's reasoning).
- fermoe keeps no responses: `previous_response_id`, `conversation` and `item_reference`
  items are a 400 saying so (Codex sends the whole history with `store: false`); so is
  `background: true`.
- `tools`: function tools need `parameters` (OpenAI's required key; null is taken). A
  `namespace` tool (Codex's sub-agent tools: {"type": "namespace", "name": NS, "tools":
  [functions]}) becomes its functions, each named NS__NAME (flat_name): OpenAI's function-name
  alphabet ([A-Za-z0-9_-], which every chat template and the tool-call grammar take; a dot is
  not in it), the separator MCP clients use (mcp__server__tool). A call of one is answered as
  Codex's schema has it, a function_call item with `name` NAME and `namespace` NS
  (responses_api.py), and a function_call input item with a `namespace` is renamed NS__NAME
  for the template. Other kinds (Codex's web_search, custom, local_shell...) are left out
  with a log line by the chat path. `tool_choice`: auto, none, required, or {"type": "function", "name"}:
  mapped onto chat's, which honours or refuses it (forced choices need constrained decoding).
- `text.format`: text, json_object or json_schema, onto chat's response_format (the same).
- `reasoning.effort` is chat's reasoning_effort ("none": thinking off); `max_output_tokens`
  is max_tokens. Other top-level fields clients add (`include`, `prompt_cache_key`...) are
  logged and ignored, except a request for logprobs (`top_logprobs`, or `include` naming
  `message.output_text.logprobs`): refused, as they are not attributed to output items yet
  (/v1/chat/completions has them).
"""
from __future__ import annotations

import json
import logging
from typing import Any

import msgspec

from .errors import APIError
from .fields import MaxTokens, Temperature, TopP
from .schemas import ChatCompletionRequest, _validation_error, decode_object

log = logging.getLogger("fermoe.http")
NOT_KEPT = "fermoe keeps no responses: send the whole conversation in `input` (with store: false)"
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @classmethod
    def decode(cls, raw: bytes) -> "ResponsesRequest":
        data = decode_object(raw)
        _refuse_logprobs(data)
        unknown = sorted(set(data) - set(cls.__struct_fields__))
        if unknown:
            log.info("ignored Responses fields: %s", ", ".join(unknown))
        try:
            req = msgspec.convert({k: v for k, v in data.items() if k not in unknown}, cls)
        except msgspec.ValidationError as e:
            raise _validation_error(str(e)) from None
        if req.previous_response_id is not None:
            raise invalid("previous_response_id", NOT_KEPT)
        if req.conversation is not None:
            raise invalid("conversation", NOT_KEPT)
        if req.background:
            raise invalid("background", "background responses are not supported", "unsupported_parameter")
        return req


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _refuse_logprobs(data: dict) -> None:
    if data.get("top_logprobs") not in (None, 0, False):
        raise invalid("top_logprobs", "logprobs are not supported on /v1/responses yet (/v1/chat/completions "
                                      "has them)", "unsupported_parameter")
    include = data.get("include")
    if isinstance(include, list) and LOGPROBS_INCLUDE in include:
        raise invalid("include", f"{LOGPROBS_INCLUDE} is not supported yet (/v1/chat/completions has logprobs)",
                      "unsupported_parameter")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _input([{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input)
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.tools is not None:
        body["tools"] = [f for i, t in enumerate(req.tools) for f in _tools(i, t)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    for name, value in (("parallel_tool_calls", req.parallel_tool_calls), ("max_tokens", req.max_output_tokens),
                        ("temperature", req.temperature), ("top_p", req.top_p)):
        if value is not None:
            body[name] = value
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = _format(fmt)
    effort = (req.reasoning or {}).get("effort")
    if isinstance(effort, str):
        body["reasoning_effort"] = effort
    try:
        return msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None


def _text(param: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, "expected a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"{param}[{j}]", f"content parts of type {kind!r} are not supported here (text only; "
                                           f"input_image in user messages)", "unsupported_parameter")
        if kind not in TEXT_PARTS and kind != "refusal" or not isinstance(part.get("text", part.get("refusal")), str):
            raise invalid(f"{param}[{j}]", f"unknown content part {kind!r} (expected input_text or output_text)")
        texts.append(part.get("text", part.get("refusal")))
    return "\n".join(texts)


def _user_content(param: str, content):
    """A user message's content: its text, or, with input_image parts (base64 data: URLs;
    the server fetches nothing and keeps no files), chat's text and image_url parts in order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(param, content)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if part.get("file_id") is not None and url is None:
                raise invalid(f"{param}[{j}].file_id", "file ids are not supported (fermoe keeps no files): send "
                                                       "image_url as a base64 data: URL", "unsupported_parameter")
            if not isinstance(url, str) or not url.lower().startswith("data:"):
                raise invalid(f"{param}[{j}].image_url", "expected a base64 data: URL (data:image/png;base64,...); "
                                                         "the server fetches nothing")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text(f"{param}[{j}]", [part])})
    return parts


def _input(items: list[dict]) -> list[dict]:
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        """The assistant message a call or text joins: the last one, unless something came after it."""
        if out and out[-1]["role"] == "assistant" and not reasoning:
            return out[-1]
        out.append({"role": "assistant", "content": None})
        if reasoning:
            out[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return out[-1]

    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{param}.role", f"expected user, system, developer or assistant, got {role!r}")
            if "content" not in item:
                raise invalid(f"{param}.content", "Missing required parameter", "missing_required_parameter")
            if reasoning and role != "assistant":   # a turn that was all reasoning (Codex sends it back so)
                assistant()["content"] = ""
            if role == "user":
                out.append({"role": role, "content": _user_content(f"{param}.content", item["content"])})
                continue
            text = _text(f"{param}.content", item["content"])
            if role == "assistant":
                message = assistant()
                message["content"] = (message["content"] or "") + text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            name = _str(item, "name", param)
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = flat_name(item["namespace"], name)
            call = {"id": _str(item, "call_id", param), "type": "function",
                    "function": {"name": name, "arguments": _arguments(item, param)}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", param),
                        "content": _text(f"{param}.output", output if output is not None else "")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text(f"{param}.content", parts)
            if text:
                reasoning.append(text)
        elif kind == "item_reference":
            raise invalid(param, NOT_KEPT)
        else:
            raise invalid(f"{param}.type", f"unknown input item type {kind!r} (expected message, function_call, "
                                           "function_call_output or reasoning)")
    return out


def _str(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{param}.{name}", "Missing required parameter" if value is None else "expected a string",
                      "missing_required_parameter" if value is None else "invalid_type")
    return value


def _arguments(item: dict, param: str) -> str:
    args = _str(item, "arguments", param)
    try:
        json.loads(args or "{}")
    except json.JSONDecodeError as e:
        raise invalid(f"{param}.arguments", f"not JSON: {e}") from None
    return args


NAMESPACE_SEPARATOR = "__"


def flat_name(namespace: str, name: str) -> str:
    """The function name the model sees for function `name` of namespace tool `namespace`."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def namespaced(tools: list[dict] | None) -> dict[str, tuple[str, str]]:
    """The flat names of the namespaces' functions -> (namespace, name)."""
    out = {}
    for tool in tools or ():
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            for f in tool.get("tools") or ():
                if isinstance(f, dict) and isinstance(f.get("name"), str):
                    out[flat_name(tool["name"], f["name"])] = (tool["name"], f["name"])
    return out


def _tools(i: int, tool: dict) -> list[dict]:
    """A tool as chat's: a function, a namespace's functions, or another kind (left out)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        raise invalid(f"tools[{i}]", "a tool is an object with a `type`")
    if tool["type"] != "namespace":
        return [_tool(f"tools[{i}]", tool)]
    namespace = _str(tool, "name", f"tools[{i}]")
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise invalid(f"tools[{i}].tools", "a namespace tool needs its `tools`, a list of functions")
    out = []
    for j, f in enumerate(inner):
        where = f"tools[{i}].tools[{j}]"
        if not isinstance(f, dict) or f.get("type", "function") != "function":
            raise invalid(where, "a namespace holds function tools only")
        function = _tool(where, {"type": "function", **f})
        function["function"]["name"] = flat_name(namespace, function["function"]["name"])
        out.append(function)
    return out


def _tool(where: str, tool: dict) -> dict:
    if tool["type"] != "function":
        return {"type": tool["type"]}            # the chat path leaves it out, with a log line
    if "parameters" not in tool:
        raise invalid(f"{where}.parameters", "Missing required parameter: a function tool needs its JSON "
                                             "schema (null for none)", "missing_required_parameter")
    function = {"name": _str(tool, "name", where), "parameters": tool["parameters"] or {}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice                            # auto, none, required; chat names any other as wrong
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", "expected 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": NAME}")


def _format(fmt: dict) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid("text.format", f"expected type text, json_object or json_schema, got {kind!r}")
