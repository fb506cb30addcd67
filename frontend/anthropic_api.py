"""Anthropic's Messages API (what Claude Code speaks): POST /v1/messages and
/v1/messages/count_tokens, a thin translation onto the chat path.

A request becomes an OpenAI chat request (anthropic_request.py), checked and rendered as
chat's are (openai_request.chat_generate: the same template, tools, tool_choice handling); the model's
text goes through the same tool-call parser, grouped into content blocks (blocks.py):
`thinking` (with a `signature`, which fermoe does not check on the way back), `text` and
`tool_use`. `stop_reason`: `max_tokens` when the limit cut the turn, else `tool_use` when
the model called a tool, else `stop_sequence` (with `stop_sequence` set) when one of
`stop_sequences` ended it, else `end_turn`.

Usage is Anthropic's: `input_tokens` are the prompt tokens the prefix cache did not hold,
`cache_read_input_tokens` those it did. `message_start` carries them as soon as the request
is on a worker (the coordinator's Started; zeros if it still waits in the queue when the
stream opens), and `message_delta` the whole usage again at the end.

A streamed request whose prompt takes long to prefill gets its headers and `message_start`
within a second, then `event: ping` every few seconds until the first token
(streaming.py). A prompt longer than the context is refused in Anthropic's words, `prompt is
too long: N tokens > M maximum` (what clients parse to compact their context): a 400, or,
if it comes after the headers, an `event: error` with that message.

Errors are Anthropic's JSON, {"type": "error", "error": {"type", "message"}}, for every
refusal on these paths, the API key's included.
"""
from __future__ import annotations

import hashlib
import json
import uuid

import msgspec

from starlette.requests import Request
from starlette.responses import JSONResponse

from shared import protocol as P
from shared.chat import render_chat
from shared.errors import ChatTemplateError

from . import openai_request
from .anthropic_request import AnthropicError, CountTokensRequest, MessagesRequest, as_anthropic, chat_request
from .blocks import Block, BlockResponse
from .core import read_body, submit
from .errors import APIError
from .formats import ChatFormat

PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def _sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def signature(thinking: str) -> str:
    """A thinking block's `signature`: Anthropic's clients require one and send it back; fermoe
    checks none, so this only names the text it came with."""
    return "fermoe-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def stop_reason(done: P.Done, calls: bool) -> tuple[str, str | None]:
    if done.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if done.stop_reason is not None:
        return "stop_sequence", done.stop_reason
    return "end_turn", None


def usage(done: P.Done) -> dict:
    return {"input_tokens": done.prompt_tokens - done.cached_prompt_tokens, "output_tokens": done.completion_tokens,
            "cache_read_input_tokens": done.cached_prompt_tokens, "cache_creation_input_tokens": 0}


def _arguments(block: Block) -> dict:
    try:
        args = json.loads(block.text)
    except json.JSONDecodeError:          # the parser closes every call it opens; kept whole if not
        return {"_raw": block.text}
    return args if isinstance(args, dict) else {"_value": args}


def content_block(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": signature(block.text)}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.id, "name": block.name, "input": _arguments(block)}


class MessagesResponse(BlockResponse):
    def error_body(self, error: APIError) -> dict:
        return as_anthropic(error).body()

    def refusal(self, error: P.Error) -> APIError:
        """An over-long prompt in Anthropic's words, which clients parse to compact their context."""
        if error.code == "context_length_exceeded" and error.n_prompt_tokens is not None:
            return AnthropicError(400, f"prompt is too long: {error.n_prompt_tokens} tokens > {error.n_ctx} maximum",
                                  code=error.code)
        return super().refusal(error)

    def stream_error(self, error: APIError) -> list[bytes]:
        return [_sse("error", self.error_body(error))]

    def keepalive(self) -> bytes:
        return _sse("ping", {"type": "ping"})

    def _message(self, content: list, reason=(None, None), usage_: dict | None = None) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason[0], "stop_sequence": reason[1],
                "usage": usage_ or {"input_tokens": 0, "output_tokens": 0}}

    def whole(self, done: P.Done) -> dict:
        return self._message([content_block(b) for b in self.blocks.done],
                             stop_reason(done, bool(self.blocks.calls)), usage(done))

    def opening(self) -> list[bytes]:
        started = self.stream.started
        usage_ = None if started is None else {
            "input_tokens": started.prompt_tokens - started.cached_prompt_tokens, "output_tokens": 0,
            "cache_read_input_tokens": started.cached_prompt_tokens, "cache_creation_input_tokens": 0}
        return [_sse("message_start", {"type": "message_start", "message": self._message([], usage_=usage_)})]

    def event(self, e: tuple) -> list[bytes]:
        kind, block = e[0], e[1]
        if kind == "start":
            empty = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""},
                     "call": {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}}[block.kind]
            return [_sse("content_block_start", {"type": "content_block_start", "index": block.index,
                                                 "content_block": empty})]
        if kind == "delta":
            delta = {"reasoning": {"type": "thinking_delta", "thinking": e[2]},
                     "text": {"type": "text_delta", "text": e[2]},
                     "call": {"type": "input_json_delta", "partial_json": e[2]}}[block.kind]
            return [_sse("content_block_delta", {"type": "content_block_delta", "index": block.index,
                                                 "delta": delta})]
        out = []
        if block.kind == "reasoning":
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": {
                "type": "signature_delta", "signature": signature(block.text)}}))
        return out + [_sse("content_block_stop", {"type": "content_block_stop", "index": block.index})]

    def closing(self, done: P.Done) -> list[bytes]:
        if done.finish_reason == "error":
            return [_sse("error", self.error_body(APIError(500, done.error or "the request failed")))]
        reason, sequence = stop_reason(done, bool(self.blocks.calls))
        return [_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                        "stop_sequence": sequence},
                                       "usage": usage(done)}),
                _sse("message_stop", {"type": "message_stop"})]


async def messages(request: Request):
    server = request.app.state.server
    try:
        req = MessagesRequest.decode(await read_body(request))
        body = chat_request(req, stream=req.stream)
        msg = openai_request.chat_generate(body)
        thinking = await server.opens_reasoning(msg)
        parser = openai_request.chat_parser(body, msg, thinking, "deepseek")
        parser.call_id = lambda: f"toolu_{uuid.uuid4().hex[:24]}"
        msg = msgspec.structs.replace(msg, request_id=f"msg_{uuid.uuid4().hex[:24]}")
        model, upstream, stream = await submit(server, msg)
        return MessagesResponse(upstream, stream, ChatFormat(), model, body.stream, server.metrics, parser,
                                server.system_fingerprint)
    except APIError as e:
        raise as_anthropic(e) from None


async def count_tokens(request: Request):
    server = request.app.state.server
    try:
        req = CountTokensRequest.decode(await read_body(request))
        msg = openai_request.chat_generate(chat_request(req, stream=False))
        tok = await server.tokenizer()
        try:
            text = render_chat(tok, msg.messages, msg.tools, server.template_kwargs(msg.chat_template_kwargs),
                               msg.continue_final_message, msg.add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(400, str(e)) from None         # its message says whose refusal it is
        return JSONResponse({"input_tokens": len(tok.encode(text))})
    except APIError as e:
        raise as_anthropic(e) from None


__all__ = ["AnthropicError", "PATHS", "count_tokens", "messages"]
