"""A generation answered as a list of blocks: Anthropic's content blocks (thinking, text,
tool_use) and the Responses API's output items (reasoning, message, function_call) are the
same thing under two names. The chat path's tool-call parser (shared/tool_parser.py) decides
what each piece of the model's text is; Blocks only groups its events into blocks, opening
one when the kind changes, so that nothing reads the model's output a second way.

BlockResponse is the HTTP side: a GenerationResponse (streaming.py: the first reply before
the headers, the disconnect watch, the metrics) whose body and stream events an API module
shapes through four methods: whole(), opening(), event() and closing().
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared import protocol as P
from shared.tool_parser import ToolCallParser

from .streaming import GenerationResponse, send_json


@dataclass
class Block:
    index: int
    kind: str                   # "reasoning", "text" or "call"
    text: str = ""              # the reasoning or text, or a call's arguments JSON so far
    id: str | None = None       # a call's id and function name
    name: str | None = None


@dataclass
class Blocks:
    """The parser's events -> ("start", block), ("delta", block, text), ("stop", block)."""
    parser: ToolCallParser
    done: list[Block] = field(default_factory=list)
    open: Block | None = None
    reasoning_tokens: int = 0   # tokens the parser read inside the reasoning (its tags included)

    def feed(self, text: str, token: bool = False) -> list[tuple]:
        """The events of the next piece of text; `token`: it is one sampled token's."""
        before = self.parser.state
        events = self._events(self.parser.feed(text)) if text else []
        if token and "reasoning" in (before, self.parser.state):
            self.reasoning_tokens += 1
        return events

    def finish(self) -> list[tuple]:
        return self._events(self.parser.finish()) + self._close()

    def _events(self, parsed: list[tuple]) -> list[tuple]:
        out = []
        for e in parsed:
            if e[0] in ("reasoning", "content"):
                kind = "text" if e[0] == "content" else "reasoning"
                if self.open is None or self.open.kind != kind:
                    out += self._close() + self._start(Block(len(self.done), kind))
                out.append(self._delta(e[1]))
            elif e[0] == "call":
                out += self._close() + self._start(Block(len(self.done), "call", id=e[2], name=e[3]))
            elif self.open is not None and self.open.kind == "call":      # ("args", index, fragment)
                out.append(self._delta(e[2]))
        return out

    def _start(self, block: Block) -> list[tuple]:
        self.open = block
        return [("start", block)]

    def _delta(self, text: str) -> tuple:
        self.open.text += text
        return ("delta", self.open, text)

    def _close(self) -> list[tuple]:
        if self.open is None:
            return []
        block, self.open = self.open, None
        self.done.append(block)
        return [("stop", block)]

    @property
    def calls(self) -> list[Block]:
        return [b for b in self.done if b.kind == "call"]


class BlockResponse(GenerationResponse):
    """One generation as blocks; subclasses say what the body and the events look like (and
    how an error after the headers is sent, stream_error(); keepalive(), an SSE comment line
    unless they say)."""

    def __init__(self, upstream, stream, fmt, model: str, streaming: bool, metrics, parser: ToolCallParser,
                 fingerprint: str = ""):
        super().__init__(upstream, stream, fmt, model, streaming, False, metrics, fingerprint)
        self.blocks = Blocks(parser)

    # ---- what an API module defines ------------------------------------------------------------
    def whole(self, done: P.Done) -> dict:
        raise NotImplementedError

    def opening(self) -> list[bytes]:
        return []

    def event(self, e: tuple) -> list[bytes]:
        raise NotImplementedError

    def closing(self, done: P.Done) -> list[bytes]:
        raise NotImplementedError

    # ---- GenerationResponse's two ways to answer -------------------------------------------------
    async def _whole(self, msg, send) -> None:
        read = await self._read_all(msg, send)
        if read is None:
            return
        tokens, msg = read
        for t in tokens:
            self.blocks.feed(t.text, token=t.token >= 0)
        self.blocks.finish()
        await send_json(send, 200, self.whole(msg), {"x-request-id": self.rid})

    def opening_events(self) -> list[bytes]:
        return self.opening()

    async def _stream_events(self, msg, send) -> None:
        out, self.pending = self.pending, []
        while not isinstance(msg, P.Done):
            for e in self.blocks.feed(msg.text, token=msg.token >= 0):
                out += self.event(e)
            if self.stream.queue.empty() and out:           # write what has come in one send
                await self._send_events(send, out)
                out = []
            msg = await self._next()
            if self.gone:
                return
        if msg.finish_reason != "error":
            for e in self.blocks.finish():
                out += self.event(e)
        out += self.closing(msg)
        await self._send_events(send, out, more=False)
