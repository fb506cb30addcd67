"""The chat and agent episodes the built-in `tiny` model is trained on, made from the same
documentation as its text (tools/stdlib_text.py): a user asks what a module, class, function
or method does; the assistant reasons briefly, calls the `pydoc` tool (shared/pydoc_tool.py)
with the dotted name, reads the docstring back and answers with its first sentence.

Recipe, exactly:
  1. the files of stdlib_text.stdlib_files, but only importable module paths (no component
     starting with `_` or not an identifier; `pkg/__init__.py` is `pkg`);
  2. from each, the docstrings (ast.get_docstring) of the module, of its top-level public
     functions and classes, and of those classes' public methods: names `mod`, `mod.f`,
     `mod.C`, `mod.C.m`; kept when pydoc_tool.first_sentence of it has 12 to 240 characters;
  3. each name's split is its file's (crc32 of the relative path modulo 20: 0 held out,
     1 calibration, else training), so no held-out name nor its docstring is trained on.

`python3 tools/stdlib_chat.py OUT_DIR` writes OUT_DIR/entries.jsonl (name, kind, split,
docstring); train_tiny.py renders `episodes(...)` of it through the built-in chat template.
`--heldout FILE` also writes the held-out names, one `kind name` a line (committed as
shared/data/stdlib/heldout_names.txt, what `fermoe bench tools` asks about).

Episodes, drawn with random.Random(seed) for each entry in turn (the shares are WEIGHTS):
  tool       tools given, thinking on: question; reasoning + call; the clipped docstring as
             the tool's response; reasoning + the first sentence
  nothink    the same with thinking off (empty <think> blocks, as the template renders them)
  two        a tool episode, then a second question on another name in the same chat (the
             template strips the first exchange's reasoning)
  paste      no tools: the user pastes the docstring and asks for one sentence
  missing    a misspelt name: pydoc's "No Python documentation found" and the answer says so
  hello      tools given, a greeting: a plain answer and no call
"""
from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.chat_template import QWEN_STYLE_TEMPLATE  # noqa: E402
from shared.pydoc_tool import (NAME as TOOL_NAME, SENTENCE_CHARS, TOOL, clip, first_sentence,  # noqa: E402
                               not_found, question)
from shared.tokenizer import render_chat_template  # noqa: E402
from tools.stdlib_text import SPLITS, stdlib_files  # noqa: E402

WEIGHTS = {"tool": 50, "nothink": 15, "two": 12, "paste": 12, "missing": 6, "hello": 5}
CALL_REASONING = ["The user asks about {name}. The pydoc tool has its documentation.",
                  "{name} is a {kind} of the standard library. I will look it up with pydoc.",
                  "I should read the docstring of {name} first.",
                  "Let me check what pydoc says about {name}."]
ANSWER_REASONING = ["The docstring's first sentence answers the question.",
                    "pydoc returned the documentation of {name}; its first sentence says what it does.",
                    "The first sentence of the docstring is the answer."]
MISSING_REASONING = "pydoc found nothing under that name."
PASTE = ["Summarise this documentation in one sentence:\n\n{doc}", "What does this describe?\n\n{doc}",
         "In one sentence, what is this about?\n\n{doc}"]
GREETINGS = [("Hello!", "Hello! Ask me what a Python module, class or function does."),
             ("Hi, who are you?", "A small model that looks up Python's documentation with pydoc."),
             ("Thanks!", "You're welcome.")]


def module_name(rel: str) -> str | None:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") or not p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def file_entries(mod: str, source: str) -> list[tuple[str, str, str]]:
    """(name, kind, docstring) of a module, its public top-level functions and classes and
    those classes' public methods, in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = [(mod, "module", ast.get_docstring(tree))]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            is_class = isinstance(node, ast.ClassDef)
            out.append((f"{mod}.{node.name}", "class" if is_class else "function", ast.get_docstring(node)))
            for m in node.body if is_class else ():
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("_"):
                    out.append((f"{mod}.{node.name}.{m.name}", "method", ast.get_docstring(m)))
    return [(n, k, d) for n, k, d in out if d and SENTENCE_CHARS[0] <= len(first_sentence(d)) <= SENTENCE_CHARS[1]]


def entries(root: Path) -> list[dict]:
    out, seen = [], set()
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        mod = module_name(rel)
        if mod is None:
            continue
        split = SPLITS.get(zlib.crc32(rel.encode()) % 20, "train")
        for name, kind, doc in file_entries(mod, path.read_text(encoding="utf-8", errors="replace")):
            if name not in seen:
                seen.add(name)
                out.append({"name": name, "kind": kind, "split": split, "doc": doc})
    return out


def misspell(name: str, rng: random.Random) -> str:
    """The name with one letter of its last part doubled: a name pydoc will not find."""
    head, _, last = name.rpartition(".")
    i = rng.randrange(len(last))
    return (head + "." if head else "") + last[:i + 1] + last[i:]


def _lookup_turns(e: dict, rng: random.Random, think: bool, name: str | None = None) -> list[dict]:
    """The question, the call, the tool's response and the answer about entry `e` (or the
    misspelt `name`, which pydoc does not find)."""
    asked = name or e["name"]
    found = name is None
    r1 = rng.choice(CALL_REASONING).format(name=asked, kind=e["kind"]) if think else ""
    if found:
        r2, answer, response = (rng.choice(ANSWER_REASONING).format(name=asked) if think else "",
                                first_sentence(e["doc"]), clip(e["doc"]))
    else:
        r2, answer, response = (MISSING_REASONING if think else "",
                                f"pydoc has no documentation for {asked}.", not_found(asked))
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"name": asked}}}
    return [{"role": "user", "content": question(e["kind"], asked, rng.randrange(4))},
            {"role": "assistant", "content": "", "reasoning_content": r1, "tool_calls": [call]},
            {"role": "tool", "content": response},
            {"role": "assistant", "content": answer, "reasoning_content": r2}]


def episode(e: dict, pool: list[dict], rng: random.Random) -> tuple[str, list[dict], bool]:
    """(kind, messages, tools given) of one episode about entry `e`; `pool` gives the second
    name of a two-question chat."""
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    if kind == "paste":
        ask = rng.choice(PASTE).format(doc=clip(e["doc"]))
        return kind, [{"role": "user", "content": ask},
                      {"role": "assistant", "content": first_sentence(e["doc"]),
                       "reasoning_content": "The first sentence of the text says it." if rng.random() < 0.5 else ""}
                      ], False
    if kind == "hello":
        ask, answer = rng.choice(GREETINGS)
        return kind, [{"role": "user", "content": ask}, {"role": "assistant", "content": answer,
                                                          "reasoning_content": "A greeting: no lookup needed."}], True
    if kind == "missing":
        return kind, _lookup_turns(e, rng, think=rng.random() < 0.7, name=misspell(e["name"], rng)), True
    if kind == "two":
        other = pool[rng.randrange(len(pool))]
        return kind, _lookup_turns(e, rng, think=True) + _lookup_turns(other, rng, think=rng.random() < 0.7), True
    return kind, _lookup_turns(e, rng, think=kind == "tool"), True


def render(messages: list[dict], tools: bool) -> str:
    return render_chat_template(QWEN_STYLE_TEMPLATE, messages, add_generation_prompt=False,
                                tools=[TOOL] if tools else None)


def episodes(items: list[dict], seed: int = 0, rounds: int = 1) -> list[str]:
    """Rendered episodes: `rounds` passes over `items`, one episode for each in each pass."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        for e in items:
            _, messages, tools = episode(e, items, rng)
            out.append(render(messages, tools))
    return out


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--heldout", type=Path, help="also write the held-out names here, one `kind name` a line")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    items = entries(Path(sysconfig.get_paths()["stdlib"]))
    with open(args.out / "entries.jsonl", "w", encoding="utf-8") as f:
        for e in items:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
    if args.heldout:
        args.heldout.write_text("".join(f"{e['kind']} {e['name']}\n" for e in items if e["split"] == "heldout"))
    counts = {s: sum(e["split"] == s for e in items) for s in ("train", "calib", "heldout")}
    print(f"entries: {counts} (Python {sys.version.split()[0]})", file=sys.stderr)


if __name__ == "__main__":
    main()
