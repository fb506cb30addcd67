"""A chat request's messages, tools, tool_choice and template settings, checked and mapped
onto the Generate's fields; each defect is a 400 naming its field.

- `tools`: function tools reach the chat template; other kinds (Codex's web_search...) are
  left out with a warning (shared/chat.py).
- `tool_choice`: `auto` (the default with tools) renders the tools and parses the calls the
  model writes; `none` renders them and parses none (the output is content), as vLLM does.
  `required` and a named function force a call (to any of the tools, or to that one) in the
  model's own XML format, its arguments following the tool's schema: a grammar
  (shared/grammar.py) masks every token after the reasoning. tool_choice without tools, or
  naming a function that is not among them, is refused. `parallel_tool_calls: false` forces
  exactly one call; otherwise one or more; with `auto` every call the model writes is returned.
- `response_format` json_object / json_schema (`strict` or not: the schema is always enforced)
  constrain the answer after the reasoning to JSON of that schema; with tools and tool_choice
  `auto` the answer is that JSON or tool calls. A schema llguidance cannot compile is a 400
  here; the whole grammar is compiled again by the coordinator (with the vocabulary) before the
  request is queued. response_format with a forced tool_choice is refused (they contradict).
- `reasoning_effort: "none"` is `enable_thinking: false`, unless chat_template_kwargs says.
"""
from __future__ import annotations

import json

from shared import protocol as P
from shared.chat import RESERVED_KWARGS, function_tools
from shared.grammar import GrammarError, answer_or_calls_lark, checked_schema, json_schema_text, tool_call_lark
from shared.tool_parser import param_kind

from .errors import APIError
from .formats import REASONING_FORMATS

def _invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


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
    """"auto", "none", "required", or the name of the function a call is forced to."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if function_tools else "none"
    if not body.tools:
        raise _invalid("tool_choice", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                                      "are specified.")
    if choice in ("auto", "none", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise _invalid("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                      '{"type": "function", "function": {"name": NAME}}')
    names = [t["function"]["name"] for t in function_tools or ()]
    if name not in names:
        raise _invalid("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools "
                                      f"({', '.join(map(repr, names)) or 'no function tools'})")
    return name


def response_format(body):
    """The JSON schema the answer must follow (None: free text)."""
    fmt = body.response_format
    kind = fmt.get("type") if fmt else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _invalid("response_format.json_schema", "response_format 'json_schema' needs a `json_schema` "
                                                          "object: {\"name\": ..., \"schema\": {...}}")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise _invalid("response_format.json_schema.strict", "response_format.json_schema.strict must be a "
                                                                 "boolean")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _invalid("response_format.json_schema.schema", "response_format.json_schema.schema must be a "
                                                                 "JSON schema object")
    else:
        raise _invalid("response_format", f"response_format {kind!r}: expected 'text', 'json_object' or "
                                          "'json_schema'")
    _check_schema("response_format.json_schema.schema", schema)
    return schema


def _check_schema(param: str, schema) -> None:
    try:
        checked_schema(json_schema_text(schema))
    except GrammarError as e:
        raise _invalid(param, f"{param} is not a JSON schema llguidance can follow: {e}") from None


def grammar(body, function_tools: list[dict] | None) -> P.Constraint | None:
    """The constraint of the answer: the forced tool call, the response_format, or none."""
    choice = tool_choice(body, function_tools)
    schema = response_format(body)
    parallel = body.parallel_tool_calls is not False
    if choice in ("auto", "none"):
        if schema is None:
            return None
        if choice == "none" or not function_tools:
            return P.Constraint(kind="json_schema", text=json_schema_text(schema))
        return P.Constraint(kind="lark", text=_lark(lambda: answer_or_calls_lark(schema, function_tools, parallel)))
    if schema is not None:
        raise _invalid("response_format", f"response_format {body.response_format.get('type')!r} contradicts a "
                                          "tool_choice that forces a call")
    forced = function_tools if choice == "required" else \
        [t for t in function_tools if t["function"]["name"] == choice]
    for tool in forced:
        params = tool["function"].get("parameters") or {}
        i = body.tools.index(tool) if tool in body.tools else 0
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        for name, prop in (params.get("properties") or {}).items():
            if isinstance(prop, dict) and param_kind(prop, True) != "string":
                _check_schema(f"tools[{i}].function.parameters.properties.{name}", {**defs, **prop})
    return P.Constraint(kind="lark", text=_lark(lambda: tool_call_lark(forced, parallel)))


def _lark(build) -> str:
    try:
        return build()
    except GrammarError as e:
        raise _invalid("tools", f"the tools cannot be forced: {e}") from None


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
