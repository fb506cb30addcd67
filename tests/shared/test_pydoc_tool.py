"""The pydoc tool of the built-in model (shared/pydoc_tool.py) and the episodes it is trained
on (tools/stdlib_chat.py): what the tool answers, and that an episode's call, rendered by the
built-in template, is read back by the server's parser as the call it was."""
from __future__ import annotations

import json
import random

from shared.pydoc_tool import TOOL, clip, first_sentence, lookup, not_found
from shared.tool_parser import ToolCallParser
from tests.support.deadline import LOOPING_PARSER, deadline
from tools.stdlib_chat import episode, file_entries, misspell, render

SOURCE = '''"""Tools for frobbing.

More text."""

def frob(x):
    """Frob x twice. Then return it.

    Details."""

class Frobber:
    """A thing that frobs e.g. widgets, and more."""

    def run(self):
        """Run the frobber until it stops."""

    def _hidden(self):
        """Private, left out."""

def _private():
    """Left out too."""
'''


def test_first_sentence_and_clip():
    assert first_sentence("Frob x twice. Then return it.\n\nDetails.") == "Frob x twice."
    assert first_sentence("Serialize ``obj`` to a JSON\nformatted ``str``.\n\nMore.") == \
        "Serialize ``obj`` to a JSON formatted ``str``."
    doc = "line one\n" + "x" * 50 + "\n" + "y" * 50
    assert clip(doc, 70) == "line one\n" + "x" * 50 and clip("short", 70) == "short"
    assert clip("z" * 100, 30) == "z" * 30                  # one long line: cut at the limit


def test_lookup_runs_pydoc_and_says_when_it_finds_nothing():
    assert first_sentence(lookup("json.dumps")) == first_sentence(json.dumps.__doc__)
    assert lookup("json.dumpz") == not_found("json.dumpz")
    assert lookup("os; rm -rf /") == not_found("os; rm -rf /")     # not a dotted name: nothing imported


def test_entries_are_public_names_with_a_usable_first_sentence():
    names = [(n, k) for n, k, _ in file_entries("frobs", SOURCE)]
    assert names == [("frobs", "module"), ("frobs.frob", "function"), ("frobs.Frobber", "class"),
                     ("frobs.Frobber.run", "method")]
    assert misspell("json.dumps", random.Random(0)).startswith("json.") and misspell("json.dumps", random.Random(0)) \
        != "json.dumps"


def test_an_episodes_call_reads_back_as_the_call_it_was():
    items = [{"name": n, "kind": k, "split": "train", "doc": d} for n, k, d in file_entries("frobs", SOURCE)]
    rng = random.Random(3)
    seen = set()
    for _ in range(40):
        kind, messages, tools = episode(items[1], items, rng)
        seen.add(kind)
        text = render(messages, tools)
        turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        if kind in ("paste", "hello"):                  # answered without a call
            assert "<tool_call>" not in turn and turn.endswith(messages[-1]["content"])
            continue
        parser = ToolCallParser(tools=[TOOL], reasoning=False)
        with deadline(10, LOOPING_PARSER):
            parser.feed(turn)
            parser.finish()
        (call,) = parser.calls
        asked = messages[1]["tool_calls"][0]["function"]["arguments"]["name"]
        assert (call["name"], json.loads(call["arguments"]), call["complete"]) == ("pydoc", {"name": asked}, True)
        assert text.endswith(messages[-1]["content"] + "<|im_end|>\n")
    assert seen == {"tool", "nothink", "two", "paste", "missing", "hello"}
