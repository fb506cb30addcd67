"""OpenAI's API: POST /v1/chat/completions (messages rendered with the model's chat template,
by the coordinator) and /v1/completions (a prompt string or token ids); the request bodies
become a Generate in openai_request.py.
"""
from __future__ import annotations

from starlette.requests import Request

from shared import protocol as P

from . import openai_request
from .core import Server, read_body, submit
from .logprobs import Logprobs
from .schemas import ChatCompletionRequest, CompletionRequest, decode_body
from .choices import Choices, choice_generate
from .streaming import ChatFormat, GenerationResponse, TextFormat


async def chat_completions(request: Request):
    server: Server = request.app.state.server
    body = decode_body(await read_body(request), ChatCompletionRequest)
    msg = openai_request.chat_generate(body)
    fmt = openai_request.reasoning_format(body, server.settings.reasoning_format)
    thinking = await server.opens_reasoning(msg)
    return await _generate(server, body, msg,
                           lambda: ChatFormat(openai_request.chat_parser(body, msg, thinking, fmt), fmt))


async def completions(request: Request):
    server: Server = request.app.state.server
    body = decode_body(await read_body(request), CompletionRequest)
    return await _generate(server, body, openai_request.completion_generate(body), TextFormat)


async def _generate(server: Server, body, msg: P.Generate, new_format):
    """One choice's response, or with n > 1 the choices' merged (choices.py); new_format()
    makes a choice's own format (a chat's parser holds that choice's state)."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    tokenizer = None if msg.logprobs is None else await server.tokenizer()

    async def respond(m: P.Generate) -> GenerationResponse:
        fmt = new_format()
        logprobs = None if tokenizer is None else Logprobs(tokenizer, chat=isinstance(fmt, ChatFormat))
        model, upstream, stream = await submit(server, m)
        return GenerationResponse(upstream, stream, fmt, model, body.stream, include_usage,
                                  server.metrics, server.system_fingerprint, bool(body.timings_per_token), logprobs)
    first = await respond(msg)
    n = body.n or 1
    if n == 1:
        return first
    return Choices(first, lambda i: respond(choice_generate(msg, i)), n, body.stream, include_usage)

