"""OpenAI request bodies -> the coordinator's Generate message.

Sampling fields the request leaves out take the coordinator's defaults (llama.cpp's:
temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Penalties map as llama-server
maps them: `repeat_penalty` is llama.cpp's multiplicative penalty_repeat,
`frequency_penalty` and `presence_penalty` its additive penalty_freq and
penalty_present, all three over the last 64 tokens (llama-server's repeat_last_n
sets how many). Features we cannot honour are
refused by name rather than silently ignored; llama-server's own fields are
checked and mapped in llama_server.py.
"""
from __future__ import annotations

import base64
import binascii
import uuid

from shared import protocol as P
from shared.sampling import InvalidSampling, SamplingParams
from shared.tool_parser import ToolCallParser

from . import chat_params, llama_server, logprobs
from .fields import UINT64_MAX
from .schemas import APIError, ChatCompletionRequest, CompletionRequest

_SAMPLING = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def _check_common(body) -> None:
    if body.n not in (None, 1):
        raise _refuse("n", f"n = {body.n}: only one choice per request is supported")
    if body.logit_bias:
        raise _refuse("logit_bias", "logit_bias is not supported")
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
    return P.Generate(request_id=request_id, sampling=sampling, **rest, **prompt)


def _fields(body, max_tokens: int | None) -> dict:
    fields = {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    if body.top_k is not None:
        fields["top_k"] = max(body.top_k, 0)
    if body.seed is not None and body.seed > UINT64_MAX:
        raise APIError(400, f"Invalid 'seed': Expected `int` <= {UINT64_MAX}", param="seed", code="invalid_value")
    if body.seed is not None and body.seed != -1:
        fields["seed"] = body.seed
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    return llama_server.apply(body, dict(max_tokens=max_tokens, stop=stop, ignore_eos=body.ignore_eos, **fields))


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
    """The Generate of a chat request (chat_params.py checks what is chat's own)."""
    _check_common(body)
    tools = chat_params.tools(body)
    grammar = chat_params.grammar(body, tools)
    chat_params.reasoning_format(body, "deepseek")
    messages = [P.ChatMessage(role="system" if m.role == "developer" else m.role, content=_message_content(i, m),
                              reasoning_content=chat_params.reasoning(m), tool_calls=chat_params.tool_calls(i, m),
                              tool_call_id=m.tool_call_id, name=m.name)
                for i, m in enumerate(body.messages)]
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _generate(f"chatcmpl-{uuid.uuid4().hex}", body, max_tokens, messages=messages, tools=tools,
                     chat_template_kwargs=chat_params.template_kwargs(body), grammar=grammar,
                     logprobs=logprobs.requested(body, True))


def chat_parser(body: ChatCompletionRequest, msg: P.Generate, reasoning: bool, reasoning_format: str):
    """What parses the model's text for this request: its calls unless tool_choice is none."""
    parse = msg.tools if chat_params.tool_choice(body, msg.tools) != "none" else None
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
                     **{kind: prompt})


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
