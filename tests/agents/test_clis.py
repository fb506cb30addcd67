"""Claude Code, Codex CLI and opencode, the real clients (pinned releases from npm, see
clis.py), against a daemon on the built-in model: a question, then a follow-up turn in the
same session. Each run exits 0 with the client's own output parsed; none of the client's
requests is refused (no 4xx or 5xx, no error event in a stream, no refusal in the daemon's
log); and each request finds cached what it shares with the earlier ones.

The requests pass through a recorder (bench/agent_session.py), which keeps them and their
usage. `FERMOE_RECORD_FIXTURES=1` writes them to tests/agents/fixtures/, which
test_recorded.py replays through the translation layers without the clients.

Skipped with a reason where Node or the clients are missing; failed instead where CI is set,
as .ci/run installs them.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from bench.agent_session import Recorder
from shared.builtin import BUILTIN
from shared.chat import turn_marks
from shared.model import Model
from tests.agents import clis
from tests.agents.prompts import common_prefix, generations, prompt_ids
from tests.support.http_server import HttpDaemon
from tests.support.serving_harness import BLOCK

FIXTURES = clis.Path(__file__).with_name("fixtures")
QUESTION, FOLLOW_UP = "What does json.dumps do?", "And json.loads?"
# A resumed prompt starts at a snapshot at most a block before where it parts from a cached one;
# a turn after a tool call finds the previous prompt and its generation cached, but for the
# end-of-turn tokens, which the template writes as it renders the call (`<|im_end|>` and a newline)
SLACK = BLOCK + 2


@pytest.fixture(scope="module", autouse=True)
def installed():
    missing = [name for name in clis.PINS if clis.binary(name) is None]
    if not missing:
        return
    why = (f"{', '.join(missing)} not installed in {clis.CLI_PREFIX} (python3 -m tests.agents.clis install, "
           f"which .ci/run runs, needs Node and npm{'' if shutil.which('npm') else ': npm is missing here'})")
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def served(*extra: str):
    # past the built-in model's 4096 positions (a warning in the log: its answers there are noise),
    # as the agents' prompts need; room in the store for every turn's snapshots
    d = HttpDaemon(BUILTIN["tiny"], "--max-model-len", "16384", "--snapshot-mem", "512MiB", *extra)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def daemon():
    yield from served()


@pytest.fixture(scope="module")
def greedy_daemon():
    """Greedy unless a request says otherwise (opencode and Codex send no temperature): the
    built-in model then calls opencode's tool whatever the run's paths and date in its system
    prompt, where a random draw sometimes answers without it; and it ends Codex's turns, where
    a random draw past its 4096 trained positions sometimes never ends one and runs to the end
    of the context, which Codex reports as a failed turn (max_output_tokens). (Claude Code,
    whose max_tokens is 32000, would decode a greedy loop to the end of the context.)"""
    yield from served("--temp", "0")


@pytest.fixture(scope="module")
def tokenizer():
    return Model(BUILTIN["tiny"]).tokenizer


def session(daemon, tmp_path, name: str):
    """The client's two runs through a recorder: (the runs, the records, the daemon's log lines
    written meanwhile)."""
    logged = len(daemon.log)
    with Recorder(daemon.url) as recorder:
        client = clis.CLIENTS[name](recorder.url, tmp_path / "home")
        runs = [client.run(QUESTION), client.run(FOLLOW_UP, follow_up=True)]
    if os.environ.get("FERMOE_RECORD_FIXTURES"):
        FIXTURES.mkdir(exist_ok=True)
        (FIXTURES / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recorder.records))
    for run in runs:
        assert run.returncode == 0, \
            f"{name} exited with {run.returncode}: {run.stderr[-2000:]}\n(its stdout's end: {run.stdout[-3000:]})"
    return runs, recorder.records, daemon.log[logged:]


def check_served(records: list[dict], log: list[str]) -> None:
    """Every request answered, none refused, and nothing refused in the daemon's log."""
    assert generations(records), "the client sent no generation request"
    for r in records:
        assert r["status"] < 400 and not r["errors"], (r["method"], r["path"], r["status"], r["errors"])
    refusals = [line for line in log if " -> 4" in line or " -> 5" in line]
    assert not refusals, refusals


def check_cache(records: list[dict], tokenizer) -> list[dict]:
    """Each request after the first resumes from the last point it shares with an earlier
    request where the store keeps a state: an earlier prompt's end, or a turn start the
    coordinator keeps (turn_marks), less a block; a request that continues a tool loop (its
    last message the call's result) finds the previous prompt and its generation too. Returns
    per request the prompt, cached, shared and resumable token counts."""
    rows, seen = [], []
    for i, r in enumerate(generations(records)):
        ids = prompt_ids(r, tokenizer)
        usage = r["usage"]
        assert usage and usage["prompt_tokens"] == len(ids), (usage, len(ids))  # rendered here as the daemon did
        shared = max((common_prefix(ids, earlier) for earlier in seen), default=0)
        ends = [len(e) for e in seen if len(e) <= shared and ids[:len(e)] == e]
        resumable = max([m for m in turn_marks(tokenizer, ids) if m <= shared] + ends + [0])
        row = {"prompt": len(ids), "cached": usage["cached_tokens"], "shared": shared, "resumable": resumable}
        if seen:
            assert usage["cached_tokens"] >= resumable - SLACK, (i, row)
        if i and continues_tool_loop(r):
            before = generations(records)[i - 1]["usage"]
            assert usage["cached_tokens"] >= before["prompt_tokens"] + before["completion_tokens"] - SLACK, (i, row)
        rows.append(row)
        seen.append(ids)
    return rows


def continues_tool_loop(record: dict) -> bool:
    body = record["body"]
    last = (body.get("messages") or body.get("input") or [{}])[-1]
    if last.get("role") == "tool" or last.get("type") == "function_call_output":
        return True
    content = last.get("content")
    return isinstance(content, list) and any(b.get("type") == "tool_result" for b in content)


def test_claude_code(daemon, tmp_path, tokenizer):
    runs, records, log = session(daemon, tmp_path, "claude")
    for run in runs:
        result = run.json_lines()[-1]
        assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], result
    check_served(records, log)
    assert all(r["path"] == "/v1/messages" and r["query"] == "beta=true" for r in generations(records))
    rows = check_cache(records, tokenizer)
    assert rows[-1]["cached"] > 0       # the follow-up resumed the first run's conversation


def test_codex(greedy_daemon, tmp_path, tokenizer):
    runs, records, log = session(greedy_daemon, tmp_path, "codex")
    for run in runs:
        kinds = [e.get("type") for e in run.json_lines()]
        assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, kinds
    check_served(records, log)
    first = generations(records)[0]["body"]
    assert first["input"][0]["role"] == "developer" and "instructions" not in first
    assert any(t.get("type") == "namespace" for t in first["tools"])   # flattened into functions, not refused
    rows = check_cache(records, tokenizer)
    assert rows[-1]["cached"] > 0


def test_opencode_runs_its_pydoc_tool(greedy_daemon, tmp_path, tokenizer):
    runs, records, log = session(greedy_daemon, tmp_path, "opencode")
    events = runs[0].json_lines()
    calls = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert calls and calls[0]["tool"] == "pydoc" and calls[0]["state"]["status"] == "completed", events
    assert "json" in calls[0]["state"]["output"]        # Python's own pydoc ran, in opencode's tool loop
    assert any(e.get("type") == "step_finish" for e in runs[1].json_lines())
    check_served(records, log)
    loop = [r for r in generations(records) if continues_tool_loop(r)]
    assert loop, "opencode sent the tool's result back"
    check_cache(records, tokenizer)
