"""Writes bench/data/agent_episode.json, the agent episode `fermoe bench agent` replays:
what a coding agent sends an OpenAI-compatible server over 12 generations.

A ~3k-token system prompt (agent rules and this project's own developer notes), 8 tools,
two user requests, and the calls the agent makes with the results they return (files of
this repository, a few hundred tokens each). Only the assistant's calls are recorded: its
text and reasoning are whatever the served model generates, sent back as an agent sends
them, so each turn's prompt extends the last one's generation. Run once; the JSON is
committed, so figures stay comparable as the repository changes.

    python bench/make_agent_episode.py [--small OUT.json]

--small writes a shorter one instead (no developer notes, results of 300 characters), which
fits a model of a 4k context such as the built-in one.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "data" / "agent_episode.json"
RESULT_CHARS = 1600            # a tool result: the first characters of what it returns (the benchmark's)

RULES = """You are a coding agent working in a Python and C repository on the user's machine. You act
through the tools given to you and nothing else: read before you edit, keep changes small, run
the tests that cover what you changed, and report what you did in a few sentences.

Rules:
1. Never invent file contents. Read a file with read_file before you quote it or edit it.
2. Prefer edit_file with an exact old string over write_file; write_file replaces a whole file.
3. Use grep to find where a name is defined or used before you change it.
4. Run tests with run_shell, one file at a time; the whole suite takes minutes.
5. Keep the user's style: names, comment tone, line length of 120 columns.
6. When a tool fails, read its error and try a different approach; do not repeat a failing call.
7. Ask before deleting files, rewriting history or touching anything outside the repository.
8. Track multi-step work with todo_write; mark each step done when it is.
9. Answer in plain prose, no headings, at most a short list; name files as path:line.
10. If the request is ambiguous, say what you assume and go on.

The repository's developer notes follow; they describe its layout and conventions.

"""

TOOLS = [
    ("read_file", "Read a text file of the repository.",
     {"path": {"type": "string", "description": "relative to the repository root"},
      "offset": {"type": "integer", "description": "first line, 1-based"},
      "limit": {"type": "integer", "description": "lines to read"}}, ["path"]),
    ("write_file", "Create or replace a whole file.",
     {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    ("edit_file", "Replace one exact occurrence of old_string by new_string in a file.",
     {"path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"}},
     ["path", "old_string", "new_string"]),
    ("list_dir", "List a directory's entries.", {"path": {"type": "string"}}, ["path"]),
    ("grep", "Search files for a regular expression; prints path:line: text.",
     {"pattern": {"type": "string"}, "path": {"type": "string"}, "glob": {"type": "string"}}, ["pattern"]),
    ("run_shell", "Run a shell command in the repository root and return its output.",
     {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}, ["command"]),
    ("web_fetch", "Fetch a URL and return its text.", {"url": {"type": "string"}}, ["url"]),
    ("todo_write", "Replace the task list.",
     {"todos": {"type": "array", "items": {"type": "object", "properties": {
         "content": {"type": "string"}, "status": {"type": "string", "enum": ["pending", "in_progress", "done"]}},
         "required": ["content", "status"]}}}, ["todos"]),
]


def tool(name, description, properties, required) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def read(path: str, start: int = 0, chars: int = RESULT_CHARS) -> str:
    text = (ROOT / path).read_text()
    return text[start:start + chars]


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def build(result_chars: int = RESULT_CHARS, notes: bool = True) -> dict:
    """The episode; smaller results and no developer notes fit a model of a short context
    (the tests' built-in one)."""
    listing = "\n".join(sorted(p.name + ("/" if p.is_dir() else "") for p in (ROOT / "coordinator").iterdir()
                               if not p.name.startswith("__pycache__")))
    grep_hits = "\n".join(f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
                          for p in sorted((ROOT / "coordinator").glob("*.py")) + [ROOT / "cpu_worker" / "worker.py"]
                          for i, line in enumerate(p.read_text().splitlines(), 1) if "decode_slots" in line)[:result_chars]
    serving = (ROOT / "docs" / "serving.md").read_text()
    cache = serving.index("## The prefix snapshot cache")
    # Each generation: what is appended before it (a user request, or the results of the
    # previous generation's calls), then the calls the agent makes in it (none: it answers).
    turns = [
        {"user": "Decode snapshots are written silently. Add an INFO log line in the coordinator each time it "
                 "adopts one, with the request id, the position and the slot, and make sure the tests still pass.",
         "calls": [call("todo_write", todos=[{"content": "find where decode snapshots are adopted", "status":
                                              "in_progress"}, {"content": "add the log line", "status": "pending"},
                                             {"content": "run the snapshot and serving tests", "status": "pending"}])]},
        {"results": ["Todos updated (3)."], "calls": [call("list_dir", path="coordinator")]},
        {"results": [listing], "calls": [call("grep", pattern="decode_slots", path=".", glob="*.py")]},
        {"results": [grep_hits], "calls": [call("read_file", path="coordinator/requests.py", offset=330, limit=40)]},
        {"results": [read("coordinator/requests.py", (ROOT / "coordinator/requests.py").read_text().index(
            "def _adopt_decode_snapshot"), result_chars)],
         "calls": [call("read_file", path="coordinator/snapshots.py", offset=1, limit=45)]},
        {"results": [read("coordinator/snapshots.py", 0, result_chars)],
         "calls": [call("edit_file", path="coordinator/requests.py",
                        old_string="        self.index.adopt(msg.slot, tokens[:msg.position])",
                        new_string="        if self.index.adopt(msg.slot, tokens[:msg.position]):\n"
                                   "            log.info(\"request %s: decode snapshot at %d in slot %d\", req.rid, "
                                   "msg.position, msg.slot)")]},
        {"results": ["Edited coordinator/requests.py: 1 replacement."],
         "calls": [call("run_shell", command="python3 -m pytest -q tests/test_snapshots.py tests/test_serving.py -k "
                                             "'decode or next_turn'", timeout_s=600)]},
        {"results": ["..........                                                               [100%]\n"
                     "10 passed, 30 deselected in 9.81s"], "calls": []},
        {"user": "Good. Now say in docs/serving.md, in the snapshot cache section, that the coordinator logs "
                 "each decode snapshot it adopts.",
         "calls": [call("read_file", path="docs/serving.md", offset=100, limit=30)]},
        {"results": [serving[cache:cache + result_chars]],
         "calls": [call("edit_file", path="docs/serving.md", old_string="prefills only what was appended",
                        new_string="prefills only what was appended (the coordinator logs each such snapshot)")]},
        {"results": ["Edited docs/serving.md: 1 replacement."],
         "calls": [call("run_shell", command="python3 -m pytest -q tests/test_readme.py", timeout_s=600)]},
        {"results": ["....                                                                     [100%]\n"
                     "4 passed in 41.20s"], "calls": []},
    ]
    system = RULES
    if notes:
        system += (ROOT / "docs" / "development.md").read_text() + "\n" + (ROOT / "docs" / "commands.md").read_text()
    return {"system": system, "tools": [tool(*t) for t in TOOLS], "turns": turns}


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(prog="make_agent_episode")
    p.add_argument("--small", default=None, metavar="OUT", help="write the short episode there instead")
    args = p.parse_args(argv)
    episode = build(300, notes=False) if args.small else build()
    out = Path(args.small) if args.small else OUT
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(episode, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}: {len(episode['turns'])} generations, system prompt {len(episode['system'])} characters")


if __name__ == "__main__":
    main()
