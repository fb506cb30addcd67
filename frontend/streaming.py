"""One generation's HTTP response: the coordinator's replies -> OpenAI's JSON or SSE.

The response is an ASGI callable of its own so that it owns the whole exchange:
it waits for the first reply before sending headers (a refused prompt, one longer
than the context say, is then a 400, not an error inside a 200 stream), and it
watches the connection the whole time: a client that goes away, whether before
its first token or mid-stream, has its request cancelled in the coordinator.

A streamed request waits for its first reply HEADERS_AFTER_S at most: a long prefill
(minutes for a cold agent prompt on a loaded CPU) would otherwise send nothing, and
agent clients give up on a silent connection (Claude Code after 300 s). Past that the
headers and the API's opening event go out (chat's role chunk, Messages'
message_start, Responses' response.created), then a keep-alive every KEEPALIVE_S
until the first token: an SSE comment line (`: keep-alive`), Messages' `event: ping`.
A refusal that comes after the headers is the API's error event inside the stream
(stream_error()): chat's `data: {"error": ...}` then `[DONE]`, Messages' `event: error`,
Responses' response.failed. A refusal within HEADERS_AFTER_S is its HTTP status.

Streams are framed as OpenAI frames them: for chat a first chunk carrying the
role, chunks of what each piece of text becomes (formats.py), one chunk with
`finish_reason`, the usage chunk with empty `choices` when
`stream_options.include_usage` asks for it, then `data: [DONE]`. Every body and chunk carries `system_fingerprint`; the final body
and the `finish_reason` chunk carry llama-server's `timings` (llama_server_request.py), and
with `timings_per_token` every chunk of text does.

Every request that got past its refusal is counted once in /metrics: by its own
finish reason, or as "abort" (vLLM's) with the tokens the coordinator had generated
when its client went away (the Done that answers our Cancel).
"""
from __future__ import annotations

import asyncio
import time

import msgspec

from shared import protocol as P

from .errors import RETRY_AFTER_S, APIError
from .formats import ChatFormat, TextFormat  # noqa: F401 (the formats a response takes)
from .llama_server_request import Timings

_json = msgspec.json.Encoder()
HEADERS_AFTER_S = 1.0       # a streamed request's headers wait this long at most for the first reply
KEEPALIVE_S = 5.0           # then a keep-alive this often until the first token


def usage(done: P.Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": done.reasoning_tokens}}


async def send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = [(b"content-type", b"application/json")] + [(k.lower().encode(), str(v).encode())
                                                      for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": _json.encode(body)})


class GenerationResponse:
    def __init__(self, upstream, stream, fmt, model: str, streaming: bool, include_usage: bool, metrics,
                 fingerprint: str = "", timings_per_token: bool = False, logprobs=None):
        self.upstream, self.stream, self.fmt, self.model = upstream, stream, fmt, model
        self.streaming, self.include_usage, self.metrics = streaming, include_usage, metrics
        self.fingerprint, self.timings_per_token = fingerprint, timings_per_token
        self.logprobs = logprobs                    # a logprobs.Logprobs when the request asked
        self.rid = stream.request_id
        self.created = int(time.time())
        self.arrived = time.perf_counter()
        self.last_token: float | None = None
        self.timings = Timings()
        self.gone = False
        self.counted = False
        self.started = False                        # the stream's headers are sent
        self.pending: list[bytes] = []              # its opening events, not sent yet

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        try:
            first = await self._first(send)
            if self.gone:
                return
            error = None
            if isinstance(first, P.Error):           # refused: bad input the coordinator names, or no worker
                error = self.refusal(first)
            elif isinstance(first, P.Done) and first.finish_reason == "error":    # _next() has counted it
                error = _failure_error(first)
            if error is not None and self.started:
                await self._send_events(send, self.pending + self.stream_error(error), more=False)
            elif error is not None:
                await send_json(send, error.status, self.error_body(error), error.headers)
            elif self.streaming:
                if not self.started:
                    await self._start_stream(send)
                await self._stream_events(first, send)
            else:
                await self._whole(first, send)
        finally:
            watcher.cancel()
            self.upstream.cancel(self.rid, self._aborted)     # nothing to do unless it is still open

    async def _first(self, send):
        """The first reply; a streamed request's headers, opening and keep-alives meanwhile."""
        get = asyncio.ensure_future(self._next())
        wait = HEADERS_AFTER_S if self.streaming else None
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=wait)
                if done:
                    return get.result()
                if not self.started:
                    await self._start_stream(send)
                    events, self.pending = self.pending, []
                else:
                    events = [self.keepalive()]
                await self._send_events(send, events)
                wait = KEEPALIVE_S
        finally:
            get.cancel()                            # done already, unless this task is cancelled

    def refusal(self, error: P.Error) -> APIError:
        return _refusal(error, self.fmt.prompt_param)

    def error_body(self, error: APIError) -> dict:
        """An error's JSON in this API's shape (OpenAI's here; other APIs' responses override it)."""
        return error.body()

    def stream_error(self, error: APIError) -> list[bytes]:
        """An error after the stream's headers, as this API sends one (OpenAI's error object, as
        vLLM sends a failure mid-stream)."""
        return [b"data: " + _json.encode(self.error_body(error)) + b"\n\n", b"data: [DONE]\n\n"]

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def opening_events(self) -> list[bytes]:
        return [self._chunk([choice]) for choice in self.fmt.opening()]

    async def _start_stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-request-id", self.rid.encode())]})
        self.started = True
        self.pending = self.opening_events()

    async def _watch(self, receive) -> None:
        """The request body has been read: what receive() gives now is the disconnect."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if not self.upstream.cancel(self.rid, self._aborted) and self.stream.done is not None:
            self._count(self.stream.done)           # it had ended: its Done waits, unread, in the queue
        self.stream.fail("the client disconnected")

    def _aborted(self, done: P.Done) -> None:
        """The coordinator's Done for a request we cancelled (its client gone, or a failure here)."""
        self._count(done, "abort")

    def _count(self, done: P.Done, reason: str | None = None) -> None:
        if not self.counted:
            self.counted = True
            self.metrics.finished(done, time.perf_counter() - self.arrived, reason)

    async def _next(self):
        msg = await self.stream.get()
        if isinstance(msg, P.Token) and msg.token >= 0:     # token -1: the text held back at the end
            now = time.perf_counter()
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.arrived)
            else:
                self.metrics.itl.observe(now - self.last_token)
            self.last_token = now
            self.timings.token(now)
        elif isinstance(msg, P.Done) and not self.gone:
            self._count(msg)
        return msg

    # ---- one JSON body ----------------------------------------------------------
    async def _read_all(self, msg, send) -> tuple[list[P.Token], P.Done] | None:
        """Every Token up to the Done, for a one-body answer; None when there is nothing more
        to send (the client went away, or the request failed and its 500 is sent)."""
        tokens = []
        while not isinstance(msg, P.Done):
            if not isinstance(msg, P.Progress):     # (asked for by streamed requests only)
                tokens.append(msg)
                self._add_logprobs(msg)
            msg = await self._next()
            if self.gone:
                return None
        if msg.finish_reason == "error":
            await send_json(send, 500, self.error_body(_failure_error(msg)))
            return None
        return tokens, msg

    async def _whole(self, msg, send) -> None:
        read = await self._read_all(msg, send)
        if read is None:
            return
        tokens, msg = read
        text = "".join(t.text for t in tokens)
        await send_json(send, 200, self._envelope(self.fmt.object, [self._with_logprobs(self.fmt.whole(text, msg))],
                                                  usage=usage(msg), timings=self.timings.final(msg)),
                        {"x-request-id": self.rid})

    # ---- server-sent events -------------------------------------------------------
    async def _stream_events(self, msg, send) -> None:
        events, self.pending = self.pending, []
        while not isinstance(msg, P.Done):
            if isinstance(msg, P.Progress):
                events.append(self._chunk([self.fmt.progress()], prompt_progress=self.prompt_progress(msg)))
            else:
                self._add_logprobs(msg)
                for choice in self.fmt.deltas(msg.text):
                    timings = {"timings": self.timings.partial()} if self.timings_per_token else {}
                    events.append(self._chunk([self._with_logprobs(choice)], **timings))
            if self.stream.queue.empty() and events:        # write what has come in one send
                await self._send_events(send, events)
                events = []
            msg = await self._next()
            if self.gone:
                return
        events += self._closing(msg)
        await self._send_events(send, events, more=False)

    def prompt_progress(self, msg: P.Progress) -> dict:
        """llama-server's prompt_progress: the prompt's tokens, those found cached, those
        processed so far (the cached ones included), and the milliseconds it took."""
        started = self.stream.started         # (the coordinator sends it before any Progress)
        return {"total": started.prompt_tokens, "cache": started.cached_prompt_tokens, "processed": msg.processed,
                "time_ms": msg.time_ms}

    def _closing(self, done: P.Done) -> list[bytes]:
        if done.finish_reason == "error":                   # OpenAI's error object, as vLLM sends it
            events = [b"data: " + _json.encode(_failure(done)) + b"\n\n"]
        else:
            first, *rest = self.fmt.closing(done)           # the tokens no delta carried yet go with the first
            *last, final = [self._with_logprobs(first), *rest]
            timings = {"timings": self.timings.partial()} if self.timings_per_token else {}
            events = [self._chunk([c], **timings) for c in last] + [self._chunk([final], timings=self.timings.final(done))]
            if self.include_usage:
                events.append(self._chunk([], usage=usage(done)))
        return events + [b"data: [DONE]\n\n"]

    def _add_logprobs(self, msg) -> None:
        if self.logprobs is not None:
            self.logprobs.add(msg)

    def _with_logprobs(self, choice: dict) -> dict:
        """The choice, carrying the logprobs of the tokens since the last one that did."""
        if self.logprobs is None:
            return choice
        return choice | {"logprobs": self.logprobs.take()}

    def _chunk(self, choices: list, **extra) -> bytes:
        if self.include_usage:
            extra.setdefault("usage", None)
        return b"data: " + _json.encode(self._envelope(self.fmt.chunk_object, choices, **extra)) + b"\n\n"

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    async def _send_events(self, send, events: list[bytes], more: bool = True) -> None:
        await send({"type": "http.response.body", "body": b"".join(events), "more_body": more})


def _refusal(error: P.Error, prompt_param: str) -> APIError:
    """The coordinator's refusal of a request: a 400 (an over-long prompt as OpenAI's
    context_length_exceeded, with llama-server's n_prompt_tokens and n_ctx), or a 503
    when no worker is left to run it."""
    if error.code == "unavailable":                 # no worker left that can run it
        return APIError(503, error.message, code=error.code)
    if error.code == "queue_full":                  # the front end's --max-queue
        return APIError(503, error.message, code=error.code, headers={"Retry-After": RETRY_AFTER_S})
    if error.code == "context_length_exceeded":
        return APIError(400, error.message, param=prompt_param, code=error.code,
                        extra={"n_prompt_tokens": error.n_prompt_tokens, "n_ctx": error.n_ctx})
    return APIError(400, error.message, code=error.code)


def _failure_error(done: P.Done) -> APIError:
    return APIError(500, done.error or "the request failed")


def _failure(done: P.Done) -> dict:
    """OpenAI's error object for a request that ended in error."""
    return _failure_error(done).body()

