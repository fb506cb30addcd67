"""Several prompts in one llama-server /completion request: a response each, answered as one.

Each prompt is a request of its own to the coordinator (submitted together: they queue and
decode side by side as separate requests would), answered by its CompletionResponse, whose
bodies and chunks carry its prompt's `index`. Whole, the answer is the JSON array of theirs in
prompt order, as llama-server answers it; a prompt refused or failed makes its error the
request's answer. Streamed, their chunks are interleaved as they come under one set of
headers; a prompt refused after the stream began sends its error as a `data:` line of its own.
"""
from __future__ import annotations

import asyncio
import json

from .choices import Connection
from .streaming import send_json

MAX_PROMPTS = 64


class PromptBatch:
    """ASGI callable over `responses` (CompletionResponses, already submitted)."""

    def __init__(self, responses: list, streaming: bool):
        self.responses, self.streaming = responses, streaming

    async def __call__(self, scope, receive, send) -> None:
        async with Connection(receive) as connection:
            merge = _Stream(send) if self.streaming else _Whole(send, len(self.responses))
            await asyncio.gather(*(r(scope, connection.receive, merge.sender(i)) for i, r in enumerate(self.responses)))
            await merge.close()


class _Whole:
    def __init__(self, send, n: int):
        self.send = send
        self.answers = [{"status": None, "headers": [], "body": b""} for _ in range(n)]

    def sender(self, i: int):
        answer = self.answers[i]

        async def capture(message):
            if message["type"] == "http.response.start":
                answer["status"], answer["headers"] = message["status"], message.get("headers", [])
            else:
                answer["body"] += message.get("body", b"")
        return capture

    async def close(self) -> None:
        failed = next((a for a in self.answers if a["status"] != 200), None)
        if failed is not None:
            await self.send({"type": "http.response.start", "status": failed["status"], "headers": failed["headers"]})
            await self.send({"type": "http.response.body", "body": failed["body"]})
            return
        await send_json(self.send, 200, [json.loads(a["body"]) for a in self.answers])


class _Stream:
    def __init__(self, send):
        self.send, self.started = send, False
        self.refused: dict[int, bytes] = {}         # a prompt answered with an error status: its body

    def sender(self, i: int):
        async def forward(message):
            if message["type"] == "http.response.start":
                if message["status"] != 200:
                    self.refused[i] = b""
                    return
                await self._start()
            elif i in self.refused:
                self.refused[i] += message.get("body", b"")
                if not message.get("more_body"):
                    await self._start()
                    await self._body(b"data: " + self.refused[i] + b"\n\n")
            elif message.get("body"):
                await self._body(message["body"])
        return forward

    async def _start(self) -> None:
        if not self.started:
            self.started = True
            await self.send({"type": "http.response.start", "status": 200,
                             "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                         (b"cache-control", b"no-cache")]})

    async def _body(self, body: bytes) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def close(self) -> None:
        await self._start()
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
