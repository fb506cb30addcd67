"""OpenAI request bodies -> the coordinator's Generate message.

Sampling fields the request leaves out take the coordinator's defaults (llama.cpp's:
temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Penalties map as llama-server
maps them: `repeat_penalty` is llama.cpp's multiplicative penalty_repeat,
`frequency_penalty` and `presence_penalty` its additive penalty_freq and
penalty_present, all three over the last 64 tokens (llama-server's repeat_last_n
sets how many). Features we cannot honour are
refused by name rather than silently ignored; llama-server's own fields are
checked and mapped in llama_server_request.py. The other dialects' requests
(anthropic_request.py, responses_request.py, llama_server_api.py) become OpenAI's
first, and their Generate is made here.

A chat request's messages, tools, tool_choice and template settings, checked and mapped
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
- `reasoning_effort`: "none" and "minimal" are `enable_thinking: false` (vLLM maps "none" so; a
  "minimal" reasoning is none here), any other level (low, medium, high, xhigh) is `enable_thinking:
  true`, with the server's --reasoning-budget (no budget per level), unless chat_template_kwargs
  says. Without either, the server's --reasoning decides (the coordinator applies it).
- `reasoning_budget` (fermoe's own): reasoning tokens before the end of the reasoning is forced;
  -1 no limit, null the server's --reasoning-budget.
"""
from __future__ import annotations

import base64
import binascii
import json
import uuid

from shared import protocol as P
from shared.chat import RESERVED_KWARGS, function_tools
from shared.grammar import GrammarError, answer_or_calls_lark, checked_schema, json_schema_text, tool_call_lark
from shared.http_options import REASONING_FORMATS
from shared.sampling import InvalidSampling, SamplingParams
from shared.tool_parser import ToolCallParser, param_kind

from . import llama_server_request, logprobs
from .choices import MAX_CHOICES
from .fields import UINT64_MAX
from .schemas import APIError, ChatCompletionRequest, CompletionRequest

_SAMPLING = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def _check_common(body) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise _invalid("n", f"n must be in [1, {MAX_CHOICES}], got {body.n}")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options", code="invalid_value")


def _generate(request_id: str, body, max_tokens: int | None, **prompt) -> P.Generate:
    """The Generate of a request: its prompt, and the sampling fields it sets (checked
    here, where SamplingParams is made; a value out of range is this request's 400)."""
    fields = _fields(body, max_tokens)
    try:
        sampling, rest = SamplingParams.split(fields)
    except InvalidSampling as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from None
    return P.Generate(request_id=request_id, sampling=sampling, unset=_unset(body, fields), **rest, **prompt)


def _unset(body, fields: dict) -> list[str]:
    """The fields the request leaves to the server's defaults (--temp, -n, ...)."""
    unset = [name for name in SamplingParams.names() if name not in fields]
    given = (body.max_tokens, getattr(body, "max_completion_tokens", None), body.n_predict)
    return unset + (["max_tokens"] if all(v is None for v in given) else [])


def _fields(body, max_tokens: int | None) -> dict:
    fields = {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    if body.top_k is not None:
        fields["top_k"] = max(body.top_k, 0)
    if body.seed is not None and body.seed > UINT64_MAX:
        raise APIError(400, f"Invalid 'seed': Expected `int` <= {UINT64_MAX}", param="seed", code="invalid_value")
    if body.seed is not None and body.seed != -1:
        fields["seed"] = body.seed
    if body.logit_bias:
        fields["logit_bias"] = object_bias(body.logit_bias)
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    return llama_server_request.apply(body, dict(max_tokens=max_tokens, stop=stop, ignore_eos=body.ignore_eos,
                                                 **fields))


def object_bias(bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias}: (id, bias) pairs, in id order."""
    if not isinstance(bias, dict):
        raise _invalid("logit_bias", 'logit_bias must be an object: {"token id": bias}')
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise _invalid("logit_bias", f"logit_bias keys are token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _invalid("logit_bias", f"logit_bias[{key!r}]: expected a number, got {value!r}")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _message_content(i: int, message) -> str | list:
    """A message's content for the Generate: its text (text parts joined by newlines), or,
    with images, its parts in order (text parts as they are, images as their bytes)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for j, part in enumerate(message.content):
        if part.type == "image_url":
            parts.append(P.ImagePart(data=data_url_bytes(f"messages[{i}].content[{j}]", part.image_url)))
        elif part.type != "text" or part.text is None:
            raise _refuse(f"messages[{i}].content[{j}]",
                          f"content parts of type {part.type!r} are not supported (text and image_url only)")
        else:
            parts.append(P.TextPart(text=part.text))
    if not any(isinstance(p, P.ImagePart) for p in parts):
        return "\n".join(p.text for p in parts)
    return parts


def data_url_bytes(param: str, image_url) -> bytes:
    """The bytes of OpenAI's image_url ({"url": ...} or the URL itself) when it is a base64
    data: URL; an http(s) URL is refused: the server fetches nothing."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise APIError(400, "image_url needs a url: a data: URL (data:image/png;base64,...)", param=param,
                       code="invalid_value")
    if url.split(":", 1)[0].lower() in ("http", "https"):
        raise APIError(400, "image_url: http(s) URLs are not fetched (the server fetches nothing); send the image "
                       "inline as a data: URL (data:image/png;base64,...)", param=param, code="invalid_value")
    head, sep, payload = url.partition(",")
    if not head.lower().startswith("data:") or not sep or not head.lower().endswith(";base64"):
        raise APIError(400, "image_url: expected a base64 data: URL (data:image/png;base64,...)", param=param,
                       code="invalid_value")
    if len(payload) > 4 * (P.MAX_IMAGE_BYTES // 3 + 1):
        raise APIError(400, f"image_url: the image is over the limit of {P.MAX_IMAGE_BYTES} bytes", param=param,
                       code="invalid_value")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "image_url: the data: URL's payload is not valid base64", param=param,
                       code="invalid_value") from None


def chat_generate(body: ChatCompletionRequest) -> P.Generate:
    """The Generate of a chat request (what is chat's own is checked below: tools ... reasoning)."""
    _check_common(body)
    chat_tools = tools(body)
    constraint = grammar(body, chat_tools)
    reasoning_format(body, "deepseek")
    messages = [P.ChatMessage(role="system" if m.role == "developer" else m.role, content=_message_content(i, m),
                              reasoning_content=reasoning(m), tool_calls=tool_calls(i, m),
                              tool_call_id=m.tool_call_id, name=m.name)
                for i, m in enumerate(body.messages)]
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _generate(f"chatcmpl-{uuid.uuid4().hex}", body, max_tokens, messages=messages, tools=chat_tools,
                     chat_template_kwargs=template_kwargs(body), grammar=constraint,
                     reasoning_budget=body.reasoning_budget,
                     logprobs=logprobs.requested(body, True), **prefill(body))


def prefill(body) -> dict:
    """Whether a final assistant message is continued (an assistant prefill): by default, as
    llama-server continues one; `add_generation_prompt: true` alone starts a new turn after it
    instead (vLLM's default); `continue_final_message: true` asks for it, and with
    `add_generation_prompt: true` too is refused, as vLLM refuses it."""
    final = body.messages[-1].role == "assistant"
    if body.continue_final_message and body.add_generation_prompt:
        raise _invalid("continue_final_message", "continue_final_message and add_generation_prompt may not both be "
                                                 "true: a final message is either continued or followed by a new turn")
    if body.continue_final_message and not final:
        raise _invalid("continue_final_message", f"continue_final_message needs a final assistant message, and the "
                                                 f"last one is {body.messages[-1].role!r}")
    if final and body.messages[-1].tool_calls:
        return {}                   # a call's turn is closed: its results, or a new turn, come next
    if body.continue_final_message or (final and body.add_generation_prompt is not True):
        return {"continue_final_message": True, "add_generation_prompt": False}
    return {"add_generation_prompt": body.add_generation_prompt is not False}


def chat_parser(body: ChatCompletionRequest, msg: P.Generate, reasoning: bool, reasoning_format: str):
    """What parses the model's text for this request: its calls unless tool_choice is none."""
    parse = msg.tools if tool_choice(body, msg.tools) != "none" else None
    return ToolCallParser(parse, reasoning, reasoning_format)


def completion_generate(body: CompletionRequest) -> P.Generate:
    _check_common(body)
    if body.echo:
        raise _refuse("echo", "echo is not supported")
    if body.suffix:
        raise _refuse("suffix", "suffix is not supported")
    if body.best_of not in (None, 1):
        raise _refuse("best_of", f"best_of = {body.best_of}: only one choice per request is supported")
    prompt = _prompt(body.prompt)
    kind = "prompt" if isinstance(prompt, str) else "tokens"
    return _generate(f"cmpl-{uuid.uuid4().hex}", body, body.max_tokens, logprobs=logprobs.requested(body, False),
                     grammar=llama_server_request.constraint(body), **{kind: prompt})


def _prompt(prompt) -> str | list[int]:
    """A string, a list of token ids, or a batch of one of either (OpenAI's four forms)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
    elif prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _refuse("prompt", f"a batch of {len(prompt)} prompts: only one prompt per request is supported")
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and abs(t) < 2**63 for t in prompt):
        raise APIError(400, "Invalid 'prompt': expected a string or a non-empty list of token ids",
                       param="prompt", code="invalid_value")
    return prompt


# ---- what is chat's own: tools, tool_choice, response_format, template settings, reasoning ----
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
    if kind == "json_object":                   # llama-server takes a schema here too
        schema = fmt.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _invalid("response_format.schema", "response_format.schema must be a JSON schema object")
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
    _check_schema("response_format.schema" if kind == "json_object" else "response_format.json_schema.schema", schema)
    return schema


def _check_schema(param: str, schema) -> None:
    try:
        checked_schema(json_schema_text(schema))
    except GrammarError as e:
        raise _invalid(param, f"{param} is not a JSON schema llguidance can follow: {e}") from None


def grammar(body, function_tools: list[dict] | None) -> P.Constraint | None:
    """The constraint of the answer: the forced tool call, the response_format, llama-server's
    grammar or json_schema, or none."""
    choice = tool_choice(body, function_tools)
    schema = response_format(body)
    own = llama_server_request.constraint(body)
    if own is not None:
        field = "grammar" if own.kind == "gbnf" else "json_schema"
        if schema is not None:
            raise _invalid(field, f"{field} and response_format: give one")
        if function_tools and choice != "none":
            raise _invalid(field, f"{field} with tools: the answer would have to be both a call and the grammar's "
                                  f"text (tool_choice 'none' leaves the tools out)")
        return own
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


REASONING_OFF = ("none", "minimal")     # reasoning_effort levels that turn thinking off


def template_kwargs(body) -> dict | None:
    kwargs = dict(body.chat_template_kwargs or {})
    taken = sorted(RESERVED_KWARGS & set(kwargs))
    if taken:
        raise _invalid("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)} "
                                               "(the request's own fields)")
    if body.reasoning_effort is not None:
        kwargs.setdefault("enable_thinking", body.reasoning_effort not in REASONING_OFF)
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
