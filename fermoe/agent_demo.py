"""`fermoe demo --agent`: a real tool loop through a running coordinator. The question goes
out with the `pydoc` tool offered; what the model writes is read by the server's own parser
(reasoning, content, tool calls); each call runs here with Python's own pydoc
(shared/pydoc_tool.lookup) and its result goes back as a tool message, until the model
answers without a call or MAX_ROUNDS replies have been made. Greedy throughout."""
from __future__ import annotations

import json
import sys

from shared.pydoc_tool import TOOL, lookup
from shared.tool_parser import ToolCallParser

MAX_ROUNDS = 4
LABELS = {"reasoning": "think", "content": "answer"}


class _Printer:
    """The reply as it streams: `think: ...` and `answer: ...` lines, one label a change of channel."""

    def __init__(self, out):
        self.out, self.channel = out, None

    def text(self, channel: str, text: str) -> None:
        if channel != self.channel:
            self.out.write(("\n" if self.channel else "") + f"{LABELS[channel]}: ")
            self.channel = channel
        self.out.write(text)
        self.out.flush()

    def line(self, text: str) -> None:
        self.out.write(("\n" if self.channel else "") + text + "\n")
        self.out.flush()
        self.channel = None

    def end(self) -> None:
        """Ends a reply's last line."""
        if self.channel:
            self.out.write("\n")
            self.out.flush()
            self.channel = None


def run(client, question: str, max_tokens: int | None, reasoning: bool, summary, out=sys.stdout) -> int:
    """The loop; returns how many tool calls were run. `reasoning`: whether the template leaves
    the reply inside a <think> block (shared.chat.opens_reasoning); `summary(done)`: the line
    written to stderr after each reply."""
    messages = [{"role": "user", "content": question}]
    printer, calls_run = _Printer(out), 0
    printer.line(f"user: {question}")
    for _ in range(MAX_ROUNDS):
        parser = ToolCallParser(tools=[TOOL], reasoning=reasoning)
        text = {"reasoning": "", "content": ""}
        done = None
        rid = client.submit(messages=messages, tools=[TOOL], max_tokens=max_tokens, temperature=0.0)
        for msg in client.stream(rid):
            if hasattr(msg, "text"):
                events = parser.feed(msg.text)
            else:
                done, events = msg, parser.finish()
            for event in events:
                if event[0] in text:
                    text[event[0]] += event[1]
                    printer.text(event[0], event[1])
        calls = [c for c in parser.calls if c["complete"]]
        for call in calls:
            printer.line(f"call: {call['name']} {call['arguments']}")
        printer.end()
        print(summary(done), file=sys.stderr)
        if not calls:
            return calls_run
        messages.append({"role": "assistant", "content": text["content"], "reasoning_content": text["reasoning"],
                         "tool_calls": [{"id": c["id"], "type": "function",
                                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                                        for c in calls]})
        for call in calls:
            name = json.loads(call["arguments"]).get("name", "") if call["name"] == TOOL["function"]["name"] else ""
            result = lookup(name) if name else f"no tool named {call['name']!r}"
            calls_run += 1
            first, _, rest = result.partition("\n")
            printer.line(f"tool: {first}" + (f" (+{rest.count(chr(10)) + 1} lines)" if rest else ""))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return calls_run
