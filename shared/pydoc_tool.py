"""The `pydoc` tool the built-in model was trained to call: one OpenAI function tool whose
only argument is a dotted name, answered with that object's docstring as Python's own pydoc
finds it, clipped to what a small model's context holds.

The training episodes (tools/stdlib_chat.py) and everything that runs the tool for real
(`fermoe demo --agent`, `fermoe bench tools`) share these functions, so the model sees at run
time the text it saw in training: `clip(doc)` as the tool's response, `first_sentence(doc)`
as the answer; `question(kind, name)` asks as the training episodes ask."""
from __future__ import annotations

import re

TOOL = {"type": "function", "function": {
    "name": "pydoc",
    "description": "Show the documentation of a Python module, class or function.",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string", "description": "dotted name, e.g. json.dumps"}},
        "required": ["name"]}}}
NAME = TOOL["function"]["name"]
CLIP_CHARS = 600                 # the response: the docstring up to here, cut at a line's end
SENTENCE_CHARS = (12, 240)       # a first sentence outside this is no answer to train on
QUESTIONS = {
    "module": ["What does the {name} module do?", "What is the {name} module for?", "Tell me about {name}.",
               "What is {name}?"],
    "class": ["What is {name}?", "What does the class {name} do?", "Explain {name}.", "What is {name} for?"],
    "function": ["What does {name} do?", "What does the function {name} do?", "Explain {name}.",
                 "What is {name} for?"],
    "method": ["What does {name} do?", "What does the method {name} do?", "Explain {name}.",
               "What is {name} for?"],
}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def first_sentence(doc: str) -> str:
    """The docstring's first paragraph, its lines joined, up to the first sentence end."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    m = _SENTENCE_END.search(paragraph)
    return paragraph[:m.start()] if m else paragraph


def clip(doc: str, limit: int = CLIP_CHARS) -> str:
    """The docstring up to `limit` characters, cut at the end of a line (a first line longer
    than that is cut at the limit)."""
    doc = doc.strip()
    if len(doc) <= limit:
        return doc
    cut = doc.rfind("\n", 0, limit)
    return doc[:cut if cut > 0 else limit].rstrip()


def question(kind: str, name: str, i: int = 0) -> str:
    """The `i`th way (modulo how many) the training episodes ask what a `kind` does."""
    return QUESTIONS[kind][i % len(QUESTIONS[kind])].format(name=name)


def not_found(name: str) -> str:
    return f"No Python documentation found for {name!r}."


def lookup(name: str) -> str:
    """The tool itself: the clipped docstring of `name` (pydoc.locate, then pydoc.getdoc), or
    pydoc's own words when nothing has that name. It imports the module the name is in, as
    `pydoc NAME` does, and nothing when the name is not a dotted Python name."""
    import pydoc
    if not isinstance(name, str) or not DOTTED.fullmatch(name.strip()):
        return not_found(name)
    try:
        obj = pydoc.locate(name.strip())
    except pydoc.ErrorDuringImport as e:
        return f"Importing {name.strip()!r} failed: {e.exc.__name__}."
    if obj is None:
        return not_found(name.strip())
    return clip(pydoc.getdoc(obj)) or f"{name.strip()!r} has no docstring."
