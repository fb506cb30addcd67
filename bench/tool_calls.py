"""`fermoe bench tools [MODEL]`: how often the built-in model calls its `pydoc` tool
correctly on names it was never trained on, as JSON.

For each held-out name (shared/data/stdlib/heldout_names.txt: the names of the files
tools/stdlib_chat.py keeps out of training) the model is asked, greedily, what it does, as the
training episodes ask, with the pydoc tool offered; its answer is read by the server's own
parser (shared/tool_parser.py). Counted: a call (a parseable call to pydoc), a correct call (its
arguments exactly {"name": the name asked}). Then, for each correct call, the tool runs here
(Python's pydoc, shared/pydoc_tool.lookup) and the second turn is generated: counted when the
answer is the docstring's first sentence exactly (names whose module does not import here,
or that have no docstring, are left out of that count).

JSON keys:
  bench                   "tools"
  model                   the GGUF path of the model
  thinking                bool: the chat template's enable_thinking (--thinking)
  names                   held-out names asked about
  called                  replies with a parseable call to pydoc
  called_correctly        calls whose arguments are exactly {"name": the name asked}
  answerable              of those, names pydoc finds a docstring of here
  answered_exactly        of those, second turns that answer with the docstring's first sentence exactly
  call_rate               called over names
  correct_call_rate       called_correctly over names
  exact_answer_rate       answered_exactly over answerable (0 when none is)
  wrong_examples[]        the first 8 names not called correctly
  wrong_examples[].asked  the name asked
  wrong_examples[].got    the call's arguments, or the first 80 characters of the reply without a call
                          (free-form)
  seconds                 s: the whole run's wall time
  tokens                  prompt and generated tokens of every turn"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shared.builtin import DATA_DIR, resolve_model
from shared.chat import opens_reasoning, render_chat
from shared.options import add_threads
from shared.pydoc_tool import NAME, TOOL, first_sentence, lookup, question
from shared.sampling import SamplingParams
from shared.tool_parser import ToolCallParser

HELDOUT_NAMES = DATA_DIR / "stdlib" / "heldout_names.txt"
MAX_TOKENS = 128


def read_names(path: Path) -> list[tuple[str, str]]:
    """(kind, name) pairs of a `kind name` a line file."""
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        kind, _, name = line.partition(" ")
        if kind not in ("module", "class", "function", "method") or not name:
            raise SystemExit(f"{path}:{n}: expected 'KIND NAME', got {line!r}")
        pairs.append((kind, name))
    return pairs


class Turns:
    """Greedy turns of one model on one engine: a chat in, what the parser makes of the reply out."""

    def __init__(self, model, engine, thinking: bool):
        self.model, self.engine = model, engine
        self.kwargs = None if thinking else {"enable_thinking": False}
        self.reasoning = opens_reasoning(model.tokenizer, self.kwargs)
        self.tokens = 0

    def reply(self, messages: list[dict]) -> tuple[str, str, list[dict]]:
        """(reasoning, content, calls) of the model's reply to `messages`, pydoc offered."""
        from shared.generate import generate
        tok = self.model.tokenizer
        ids = tok.encode(render_chat(tok, messages, tools=[TOOL], chat_template_kwargs=self.kwargs))
        out = [t for t in generate(self.engine, ids, MAX_TOKENS, SamplingParams(temperature=0.0),
                                   stop_ids=tok.eos_ids) if t not in tok.eos_ids]
        self.tokens += len(ids) + len(out)
        parser = ToolCallParser(tools=[TOOL], reasoning=self.reasoning)
        events = parser.feed(tok.decode(out)) + parser.finish()
        text = {"reasoning": "", "content": ""}
        for e in events:
            if e[0] in text:
                text[e[0]] += e[1]
        return text["reasoning"], text["content"], [c for c in parser.calls if c["complete"]]


def ask(turns: Turns, i: int, kind: str, name: str) -> tuple[dict[str, bool], dict | None]:
    """What the model does with the question about `name`: which of the counts it adds to,
    and a wrong example when it does not call pydoc with exactly that name."""
    messages = [{"role": "user", "content": question(kind, name, i)}]
    reasoning, content, calls = turns.reply(messages)
    call = calls[0] if calls and calls[0]["name"] == NAME else None
    args = json.loads(call["arguments"]) if call else None
    got = dict(called=call is not None, called_correctly=False, answerable=False, answered_exactly=False)
    if args != {"name": name}:
        return got, {"asked": name, "got": args if call else (content or reasoning)[:80]}
    got["called_correctly"] = True
    response = lookup(name)
    if _is_doc(name, response):
        got["answerable"] = True
        messages += [{"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": [
                         {"type": "function", "function": {"name": NAME, "arguments": call["arguments"]}}]},
                     {"role": "tool", "content": response}]
        _, answer, _ = turns.reply(messages)
        got["answered_exactly"] = answer.strip() == first_sentence(response)
    return got, None


def rates(counts: dict[str, int], n: int) -> dict[str, float]:
    return {"call_rate": round(counts["called"] / n, 4), "correct_call_rate": round(counts["called_correctly"] / n, 4),
            "exact_answer_rate": round(counts["answered_exactly"] / max(1, counts["answerable"]), 4)}


def run(model_path: str, names: list[tuple[str, str]], thinking: bool, threads: int | None = None) -> dict:
    from cpu_worker.native_engine import NativeEngine
    from shared.model import Model
    model = Model(model_path)
    engine = NativeEngine(model, threads=threads)
    turns = Turns(model, engine, thinking)
    counts = dict(called=0, called_correctly=0, answerable=0, answered_exactly=0)
    wrong, t0 = [], time.time()
    for i, (kind, name) in enumerate(names):
        got, example = ask(turns, i, kind, name)
        for key, hit in got.items():
            counts[key] += hit
        if example is not None and len(wrong) < 8:
            wrong.append(example)
    engine.close()
    return {"bench": "tools", "model": model_path, "thinking": thinking, "names": len(names), **counts,
            **rates(counts, len(names)), "wrong_examples": wrong, "seconds": round(time.time() - t0, 1),
            "tokens": turns.tokens}


def _is_doc(name: str, response: str) -> bool:
    """Whether the tool found a docstring (not pydoc's words for a name it cannot find or import)."""
    from shared.pydoc_tool import not_found
    return response != not_found(name) and not response.startswith(f"Importing {name!r}") and \
        response != f"{name!r} has no docstring."


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="fermoe bench tools", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="tiny", help="GGUF file or built-in model (default: tiny)")
    p.add_argument("--names", type=Path, default=HELDOUT_NAMES, help="`kind name` a line (default: the "
                                                                      "built-in model's held-out names)")
    p.add_argument("--limit", type=int, default=None, help="ask about the first N names only")
    p.add_argument("--thinking", choices=["on", "off"], default="on", help="the template's enable_thinking")
    add_threads(p)
    args = p.parse_args(argv)
    names = read_names(args.names)[:args.limit]
    if not names:
        raise SystemExit(f"{args.names}: no names")
    print(json.dumps(run(resolve_model(args.model), names, args.thinking == "on", args.threads)))


if __name__ == "__main__":
    main(sys.argv[1:])
