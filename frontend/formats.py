"""The choices of a response, per endpoint: what each piece of generated text becomes.

/v1/completions passes text through. /v1/chat/completions runs it through the tool-call
parser (shared/tool_parser.py): reasoning goes to `reasoning_content` (with
--reasoning-format both, also to `reasoning`, vLLM's name; with `none` it stays in
`content`), calls to `tool_calls`, streamed as OpenAI streams them: a call's first delta
carries its index, id, type and name, later ones `function.arguments` fragments.
`finish_reason` is `length` when the limit cut the turn (a call it cut is closed, its
arguments valid JSON), else `tool_calls` when calls were made, else `stop`.
"""
from __future__ import annotations

from shared import protocol as P
from shared.tool_parser import ToolCallParser

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


def reason(done: P.Done) -> str:
    return FINISH_REASONS.get(done.finish_reason, done.finish_reason)


def _choice(delta: dict) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}


class ChatFormat:
    """/v1/chat/completions: one per request (its parser holds the turn's state)."""
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    prompt_param = "messages"

    def __init__(self, parser: ToolCallParser | None = None, reasoning_format: str = "deepseek"):
        self.parser = parser or ToolCallParser()
        self.both = reasoning_format == "both"

    def opening(self) -> list[dict]:
        return [_choice({"role": "assistant", "content": ""})]

    def deltas(self, text: str) -> list[dict]:
        return [_choice(d) for d in self._deltas(self.parser.feed(text))] if text else []

    @staticmethod
    def progress() -> dict:
        """The choice of a chunk that carries llama-server's prompt_progress (its own form)."""
        return _choice({"role": "assistant", "content": None})

    def closing(self, done: P.Done) -> list[dict]:
        """The last deltas, then the choice with the finish reason."""
        final = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self._reason(done)}
        return [_choice(d) for d in self._deltas(self.parser.finish())] + [final]

    def whole(self, text: str, done: P.Done) -> dict:
        content, reasoning = [], []
        for e in self.parser.feed(text) + self.parser.finish():
            (content if e[0] == "content" else reasoning if e[0] == "reasoning" else []).append(e[-1])
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.parser.calls]
        message = {"role": "assistant", "content": "".join(content) if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
            if self.both:
                message["reasoning"] = message["reasoning_content"]
        if calls:
            message["tool_calls"] = calls
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": self._reason(done)}

    def _reason(self, done: P.Done) -> str:
        r = reason(done)
        return "tool_calls" if r == "stop" and self.parser.calls else r

    def _deltas(self, events: list[tuple]) -> list[dict]:
        out = []
        for e in events:
            if e[0] == "content":
                out.append({"content": e[1]})
            elif e[0] == "reasoning":
                out.append({"reasoning_content": e[1]} | ({"reasoning": e[1]} if self.both else {}))
            elif e[0] == "call":
                out.append({"tool_calls": [{"index": e[1], "id": e[2], "type": "function",
                                            "function": {"name": e[3], "arguments": ""}}]})
            elif out and "tool_calls" in out[-1] and out[-1]["tool_calls"][0]["index"] == e[1]:
                out[-1]["tool_calls"][0]["function"]["arguments"] += e[2]
            else:
                out.append({"tool_calls": [{"index": e[1], "function": {"arguments": e[2]}}]})
        return out


class TextFormat:
    """/v1/completions."""
    object = chunk_object = "text_completion"
    prompt_param = "prompt"

    def opening(self) -> list[dict]:
        return []

    def deltas(self, text: str) -> list[dict]:
        return [self._text(text)] if text else []

    def progress(self) -> dict:
        return self._text("")

    def closing(self, done: P.Done) -> list[dict]:
        return [self._text("") | {"finish_reason": reason(done)}]

    def whole(self, text: str, done: P.Done) -> dict:
        return self._text(text) | {"finish_reason": reason(done)}

    @staticmethod
    def _text(text: str) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
