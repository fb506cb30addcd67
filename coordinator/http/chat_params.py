"""A chat request's messages, tools, tool_choice and template settings, checked and mapped
onto the Generate's fields; each defect is a 400 naming its field.

- `tools`: function tools reach the chat template; other kinds (Codex's web_search...) are
  left out with a warning (shared/chat.py).
- `tool_choice`: `auto` (the default with tools) renders the tools and parses the calls the
  model writes; `none` renders them and parses none (the output is content), as vLLM does.
  `required` and a named function need constrained decoding, not supported yet: refused.
  tool_choice without tools, or naming a function that is not among them, is refused.
  `parallel_tool_calls` is accepted; every call the model writes is returned.
- `response_format` json_object / json_schema need constrained decoding too: refused.
- `reasoning_effort: "none"` is `enable_thinking: false`, unless chat_template_kwargs says.
"""
from __future__ import annotations

import json

from shared import protocol as P
from shared.chat import RESERVED_KWARGS, function_tools

from .errors import APIError
from .formats import REASONING_FORMATS

LATER = "needs constrained decoding, which is not supported yet"


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def tools(body) -> list[dict] | None:
    if body.tools is None:
        return None
    for i, tool in enumerate(body.tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _invalid(f"tools[{i}]", f"tools[{i}]: a tool is an object with a `type`")
        if tool["type"] != "function":
            continue
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise _invalid(f"tools[{i}].function.name", f"tools[{i}]: a function tool needs function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _invalid(f"tools[{i}].function.parameters",
                           f"tools[{i}].function.parameters must be a JSON schema object")
    return function_tools(body.tools) or None


def tool_choice(body, function_tools: list[dict] | None) -> str:
    """"auto" or "none": whether the model's calls are parsed."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if function_tools else "none"
    if not body.tools:
        raise _invalid("tool_choice", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                                      "are specified.")
    if choice in ("auto", "none"):
        return choice
    if choice == "required":
        raise _unsupported("tool_choice", f"tool_choice 'required' {LATER}; use 'auto'")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise _invalid("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                      '{"type": "function", "function": {"name": NAME}}')
    names = [t["function"]["name"] for t in function_tools or ()]
    if name not in names:
        raise _invalid("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools "
                                      f"({', '.join(map(repr, names)) or 'no function tools'})")
    raise _unsupported("tool_choice", f"a tool_choice naming a function {LATER}; use 'auto'")


def response_format(body) -> None:
    kind = body.response_format.get("type") if body.response_format else "text"
    if kind in ("json_object", "json_schema"):
        raise _unsupported("response_format", f"response_format {kind!r} {LATER} (text only)")
    if kind != "text":
        raise _invalid("response_format", f"response_format {kind!r}: expected 'text', 'json_object' or "
                                          "'json_schema'")


def template_kwargs(body) -> dict | None:
    kwargs = dict(body.chat_template_kwargs or {})
    taken = sorted(RESERVED_KWARGS & set(kwargs))
    if taken:
        raise _invalid("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)} "
                                               "(the request's own fields)")
    if body.reasoning_effort == "none":
        kwargs.setdefault("enable_thinking", False)
    return kwargs or None


def reasoning_format(body, default: str) -> str:
    fmt = body.reasoning_format if body.reasoning_format is not None else default
    if fmt not in REASONING_FORMATS:
        raise _invalid("reasoning_format", f"reasoning_format {fmt!r}: expected one of {', '.join(REASONING_FORMATS)}")
    return fmt


def tool_calls(i: int, message) -> list[P.ToolCall] | None:
    if not message.tool_calls:
        return None
    if message.role != "assistant":
        raise _invalid(f"messages[{i}].tool_calls", f"messages[{i}]: only assistant messages have tool_calls")
    return [P.ToolCall(id=c.id, type=c.type, function=P.FunctionCall(
        name=c.function.name, arguments=_arguments(f"messages[{i}].tool_calls[{j}].function.arguments",
                                                   c.function.arguments)))
            for j, c in enumerate(message.tool_calls)]


def _arguments(param: str, args) -> dict:
    """The mapping the template renders (Qwen's iterate `arguments|items`)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise _invalid(param, f"{param} is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise _invalid(param, f"{param} must be a JSON object, not {type(args).__name__}")
    return args


def reasoning(message) -> str | None:
    return next((r for r in (message.reasoning_content, message.reasoning, message.thinking) if r is not None), None)
