"""OpenAI's Responses API (what Codex CLI speaks): POST /v1/responses, a thin translation
onto the chat path.

The request becomes a chat request (responses_request.py) checked and rendered as chat's are;
the model's text goes through the same tool-call parser, grouped into output items
(blocks.py): `reasoning` (its text as `content` of type reasoning_text, no summary),
`message` (one output_text part) and `function_call` (a call of a namespace tool's function
named as Codex reads it: `name` the function's own, `namespace` the namespace's; see
responses_request.py). A reasoning item sent back in a later turn's `input` is the reasoning
of the assistant turn it precedes. Status `completed`, or `incomplete`
with reason max_output_tokens when the limit cut the turn.

Streaming sends the API's events, each with its `sequence_number`: response.created and
response.in_progress; per item output_item.added, then for reasoning and messages
content_part.added, reasoning_text.delta / output_text.delta ..., their .done and
content_part.done, for calls function_call_arguments.delta ... and .done; output_item.done;
then response.completed (or response.incomplete, or response.failed when the generation
failed), carrying the whole response with its usage. While a long prompt is prefilled,
response.created and response.in_progress go out within a second and SSE comment lines
(`: keep-alive`) every few seconds after (streaming.py); a refusal after them is
response.failed with the refusal's code (context_length_exceeded...) and message. Nothing is stored (`store` is
answered false).

Usage: `input_tokens` counts the whole prompt, `input_tokens_details.cached_tokens` the part
the prefix cache held; `reasoning_tokens` the tokens generated inside the reasoning (its
<think> and </think> included).
"""
from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import msgspec
from starlette.requests import Request

from shared import protocol as P

from . import openai_request
from .blocks import Block, BlockResponse
from .core import read_body, submit
from .responses_request import ResponsesRequest, chat_request, namespaced

ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def usage(done: P.Done, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_prompt_tokens},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _part(block: Block, text: str) -> dict:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesResponse(BlockResponse):
    def __init__(self, *args, request: ResponsesRequest, **kw):
        super().__init__(*args, **kw)
        self.request = request
        self.namespaced = namespaced(request.tools)
        self.seq = 0
        self.ids: dict[int, str] = {}

    def item_id(self, block: Block) -> str:
        if block.index not in self.ids:
            self.ids[block.index] = f"{ITEM_PREFIX[block.kind]}_{uuid.uuid4().hex}"
        return self.ids[block.index]

    def item(self, block: Block, status: str = "completed") -> dict:
        base = {"id": self.item_id(block), "status": status}
        text = block.text if status == "completed" else ""
        if block.kind == "reasoning":
            return base | {"type": "reasoning", "summary": [], "content": [_part(block, text)] if text else []}
        if block.kind == "text":
            return base | {"type": "message", "role": "assistant", "content": [_part(block, text)] if text else []}
        return base | {"type": "function_call", "call_id": block.id, "arguments": text, **self.call_name(block)}

    def call_name(self, block: Block) -> dict:
        """A call's `name`, and the `namespace` of a namespace tool's function."""
        if block.name in self.namespaced:
            namespace, name = self.namespaced[block.name]
            return {"name": name, "namespace": namespace}
        return {"name": block.name}

    def response(self, status: str, done: P.Done | None = None, error: dict | None = None) -> dict:
        r = self.request
        out = {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
               "error": error, "incomplete_details": None, "instructions": r.instructions,
               "max_output_tokens": r.max_output_tokens, "model": self.model,
               "output": [self.item(b) for b in self.blocks.done] if done is not None else [],
               "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
               "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None}, "store": False,
               "temperature": r.temperature, "text": r.text or {"format": {"type": "text"}},
               "tool_choice": r.tool_choice or "auto",
               "tools": [t for t in r.tools or () if t.get("type") == "function"], "top_p": r.top_p,
               "truncation": "disabled", "metadata": r.metadata or {}, "user": r.user, "usage": None}
        if done is not None and done.finish_reason != "error":
            out["usage"] = usage(done, self.blocks.reasoning_tokens)
            if done.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    @staticmethod
    def _status(done: P.Done) -> str:
        return {"length": "incomplete", "error": "failed"}.get(done.finish_reason, "completed")

    def whole(self, done: P.Done) -> dict:
        return self.response(self._status(done), done)

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def opening(self) -> list[bytes]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def event(self, e: tuple) -> list[bytes]:
        kind, block = e[0], e[1]
        where = {"item_id": self.item_id(block), "output_index": block.index}
        if kind == "start":
            out = [self._event("response.output_item.added", output_index=block.index,
                               item=self.item(block, "in_progress"))]
            if block.kind != "call":
                out.append(self._event("response.content_part.added", **where, content_index=0,
                                       part=_part(block, "")))
            return out
        if kind == "delta":
            if block.kind == "call":
                return [self._event("response.function_call_arguments.delta", **where, delta=e[2])]
            name = "response.reasoning_text.delta" if block.kind == "reasoning" else "response.output_text.delta"
            extra = {"logprobs": []} if block.kind == "text" else {}
            return [self._event(name, **where, content_index=0, delta=e[2], **extra)]
        if block.kind == "call":
            out = [self._event("response.function_call_arguments.done", **where, **self.call_name(block),
                               arguments=block.text)]
        else:
            name = "response.reasoning_text.done" if block.kind == "reasoning" else "response.output_text.done"
            extra = {"logprobs": []} if block.kind == "text" else {}
            out = [self._event(name, **where, content_index=0, text=block.text, **extra),
                   self._event("response.content_part.done", **where, content_index=0, part=_part(block, block.text))]
        return out + [self._event("response.output_item.done", output_index=block.index, item=self.item(block))]

    def stream_error(self, error) -> list[bytes]:
        body = {"code": error.code or "server_error", "message": error.message}
        return [self._event("response.failed", response=self.response("failed", None, body))]

    def closing(self, done: P.Done) -> list[bytes]:
        status = self._status(done)
        if status == "failed":
            error = {"code": "server_error", "message": done.error or "the request failed"}
            return [self._event("response.failed", response=self.response("failed", done, error))]
        return [self._event(f"response.{status}", response=self.response(status, done))]


async def responses(request: Request):
    server = request.app.state.server
    req = ResponsesRequest.decode(await read_body(request))
    body = chat_request(req)
    msg = openai_request.chat_generate(body)
    thinking = await server.opens_reasoning(msg)
    parser = openai_request.chat_parser(body, msg, thinking, "deepseek")
    msg = msgspec.structs.replace(msg, request_id=f"resp_{uuid.uuid4().hex}")
    model, upstream, stream = await submit(server, msg)
    response = ResponsesResponse(upstream, stream, SimpleNamespace(prompt_param="input"), model, req.stream, server.metrics, parser,
                                 server.system_fingerprint, request=req)
    response.created = int(time.time())
    return response
