"""`n` > 1 on chat and text completions: several choices of one prompt.

Each choice is a request of its own to the coordinator, answered by a GenerationResponse as
a single choice is, and this module merges their answers into OpenAI's one: `choices` with
their `index`, the usage of the prompt once and of every choice's tokens. The first choice
goes alone; the others are submitted once it has its first reply, when its prompt's snapshot
is stored, so that they resume from it instead of prefilling the prompt again, and decode in
a batch beside it. A request's seed S gives choice i the seed S + i (the same request, the
same choices); without one, each choice draws its own.

Streamed, the choices' chunks are interleaved as they come, each with its index, under the
first choice's id; one usage chunk (stream_options.include_usage) and one `[DONE]` end it.
A refusal of the first choice is the request's answer as it would be for one choice.
"""
from __future__ import annotations

import asyncio
import json
import random

import msgspec

from shared import protocol as P

from .streaming import send_json

MAX_CHOICES = 16


class Choices:
    """ASGI callable: `first`, a GenerationResponse for choice 0 (already submitted), and
    `submit(i)` making choice i's (submitting it)."""

    def __init__(self, first, submit, n: int, streaming: bool, include_usage: bool):
        self.first, self.submit, self.n = first, submit, n
        self.streaming, self.include_usage = streaming, include_usage

    async def __call__(self, scope, receive, send) -> None:
        async with Connection(receive) as connection:
            merge = Stream(send, self.first.rid, self.include_usage) if self.streaming else Whole(send)
            tasks = [asyncio.create_task(self.first(scope, connection.receive, merge.sender(0)))]
            while not (self.first.stream.answered or tasks[0].done()):      # its prompt is stored
                await asyncio.sleep(0.005)
            if self.first.stream.error is not None:     # refused: its answer is the request's, as for one
                await tasks[0]
                await merge.refusal()
                return
            for i in range(1, self.n):
                if connection.gone.is_set():
                    break
                response = await self.submit(i)
                tasks.append(asyncio.create_task(response(scope, connection.receive, merge.sender(i))))
            await asyncio.gather(*tasks)
            await merge.close()


class Connection:
    """One reader of a request's connection for the several responses that answer it: each
    is given `receive`, which returns once the client has gone."""

    def __init__(self, receive):
        self._receive, self.gone = receive, asyncio.Event()

    async def __aenter__(self) -> "Connection":
        self._watcher = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc) -> None:
        self._watcher.cancel()

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


class Whole:
    """The choices' JSON bodies, merged into one."""

    def __init__(self, send):
        self.send, self.answers = send, {}

    def sender(self, i: int):
        answer = self.answers.setdefault(i, {"status": None, "headers": [], "body": b""})

        async def capture(message):
            if message["type"] == "http.response.start":
                answer["status"], answer["headers"] = message["status"], message.get("headers", [])
            elif message["type"] == "http.response.body":
                answer["body"] += message.get("body", b"")
        return capture

    async def refusal(self) -> None:
        await self.close()

    async def close(self) -> None:
        failed = next((a for _, a in sorted(self.answers.items()) if a["status"] != 200), None)
        if failed is not None:                      # a later choice failed: its error is the answer
            await self.send({"type": "http.response.start", "status": failed["status"], "headers": failed["headers"]})
            await self.send({"type": "http.response.body", "body": failed["body"]})
            return
        bodies = [json.loads(self.answers[i]["body"]) for i in sorted(self.answers)]
        merged = bodies[0]
        merged["choices"] = [body["choices"][0] | {"index": i} for i, body in enumerate(bodies)]
        merged["usage"] = merged_usage(body.get("usage") for body in bodies)
        headers = {k.decode(): v.decode() for k, v in self.answers[0]["headers"] if k == b"x-request-id"}
        await send_json(self.send, 200, merged, headers)


class Stream:
    """The choices' server-sent events, interleaved under one id and one [DONE]."""

    def __init__(self, send, rid: str, include_usage: bool):
        self.send, self.rid, self.include_usage = send, rid, include_usage
        self.started, self.first_status, self.usages = False, None, []

    def sender(self, i: int):
        async def forward(message):
            if message["type"] == "http.response.start":
                if i == 0:
                    self.first_status = message["status"]
                if not self.started:
                    self.started = True
                    await self.send(message)
                return
            if i == 0 and self.first_status != 200:     # a refusal before the headers, as one choice's
                await self.send(message)
                return
            events = [self._event(i, raw) for raw in message.get("body", b"").split(b"\n\n") if raw]
            events = [e for e in events if e]
            if events:
                await self.send({"type": "http.response.body", "body": b"".join(events), "more_body": True})
        return forward

    def _event(self, i: int, raw: bytes) -> bytes:
        if not raw.startswith(b"data: "):
            return raw + b"\n\n"                    # a keep-alive comment
        data = raw[len(b"data: "):]
        if data == b"[DONE]":
            return b""
        chunk = json.loads(data)
        if chunk.get("choices") == [] and chunk.get("usage"):
            self.usages.append(chunk["usage"])      # sent once, merged, at the end
            return b""
        if "choices" in chunk:
            chunk["id"] = self.rid
            for choice in chunk["choices"]:
                choice["index"] = i
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    async def refusal(self) -> None:
        """Sent as it came: a 400 before the headers, or an error event and its end after them."""
        if self.first_status == 200:
            await self.close()

    async def close(self) -> None:
        events = []
        if self.include_usage and self.usages:
            events.append(b"data: " + json.dumps({"id": self.rid, "choices": [],
                                                  "usage": merged_usage(self.usages)}).encode() + b"\n\n")
        await self.send({"type": "http.response.body", "body": b"".join(events) + b"data: [DONE]\n\n",
                         "more_body": False})


def merged_usage(usages) -> dict | None:
    """The prompt once (the first choice's, with what it found cached), every choice's tokens."""
    usages = [u for u in usages if u]
    if not usages:
        return None
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    reasoning = sum((u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0) for u in usages)
    return first | {"completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion,
                    "completion_tokens_details": {"reasoning_tokens": reasoning}}


def choice_generate(msg: P.Generate, i: int) -> P.Generate:
    """Choice i's Generate: its own id and seed (the request's seed + i, or one of its own)."""
    seed = msg.sampling.seed + i if msg.sampling.seed is not None else random.getrandbits(63)
    return msgspec.structs.replace(msg, request_id=f"{msg.request_id}-{i}",
                                   sampling=msg.sampling.replace(seed=seed % 2**64),
                                   unset=[f for f in msg.unset if f != "seed"])
