"""The requests Claude Code, Codex CLI and opencode sent (tests/agents/fixtures/, recorded by
test_clis.py with FERMOE_RECORD_FIXTURES=1), replayed without the clients: through each API's
translation onto the chat path and the template, where a change of shape in a translation
layer shows as a prompt of another size than the daemon served when it was recorded; and
through `fermoe bench agent --session` against a daemon.

A fixture that no longer matches after an intended change (to the built-in model's template,
or to a translation) is recorded again with the clients: FERMOE_RECORD_FIXTURES=1 python3 -m
pytest tests/agents/test_clis.py."""
from __future__ import annotations

import pytest

from bench.agent_session import load
from shared.builtin import BUILTIN
from shared.model import Model
from tests.agents.prompts import generate_of, generations, prompt_ids

FIXTURES = {name: load(__import__("pathlib").Path(__file__).with_name("fixtures") / f"{name}.jsonl")
            for name in ("claude", "codex", "opencode")}
SYSTEM = "Answer briefly."


@pytest.fixture(scope="module")
def tokenizer():
    return Model(BUILTIN["tiny"]).tokenizer


@pytest.mark.parametrize("client", sorted(FIXTURES))
def test_each_request_renders_the_prompt_the_daemon_served(client, tokenizer):
    for i, record in enumerate(generations(FIXTURES[client])):
        assert len(prompt_ids(record, tokenizer)) == record["usage"]["prompt_tokens"], (client, i)


def rendered(record, tokenizer) -> str:
    return tokenizer.decode(prompt_ids(record, tokenizer))


def test_claude_code_requests(tokenizer):
    first, *later = generations(FIXTURES["claude"])
    assert first["query"] == "beta=true" and "mid-conversation-system" in first["headers"]["anthropic-beta"]
    msg = generate_of(first)
    # its system blocks (a billing line, the SDK's line, ours) are one system message, first; with
    # its Agent tool it sends a system message after the user's (the agent types), rendered as
    # the chat path renders a late system message: a user turn of its own
    assert [m.role for m in msg.messages] == ["system", "user", "system"] and SYSTEM in msg.messages[0].content
    late = msg.messages[2].content
    assert late.startswith("Available agent types") and f"<|im_start|>user\n{late}" in rendered(first, tokenizer)
    assert [t["function"]["name"] for t in msg.tools] == ["Agent", "Read"]
    assert first["body"]["thinking"] == {"type": "adaptive"} and msg.chat_template_kwargs == {"enable_thinking": True}
    assert msg.max_tokens == first["body"]["max_tokens"]
    # --continue: the first run's answer is the assistant turn before the follow-up (the first
    # run may have asked again after an answer that was all reasoning, as Claude Code does)
    i, follow = next((i, r) for i, r in enumerate(later) if any(m["role"] == "assistant" for m in r["body"]["messages"]))
    assert [m.role for m in generate_of(follow).messages] == ["system", "user", "system", "assistant", "user"]
    before = later[i - 1] if i else first
    assert rendered(follow, tokenizer).startswith(rendered(before, tokenizer).removesuffix("<think>\n"))


def test_codex_requests(tokenizer):
    first, second = generations(FIXTURES["codex"])
    assert [i["role"] for i in first["body"]["input"][:2]] == ["developer", "developer"]
    text = rendered(first, tokenizer)
    # its two leading developer messages are the one system turn, the prompt's first
    system_turn = text.split("<|im_end|>")[0]
    assert text.startswith("<|im_start|>system\n") and text.count("<|im_start|>system") == 1
    assert f"{SYSTEM}\n\n<skills_instructions>" in system_turn
    names = [t["function"]["name"] for t in generate_of(first).tools]
    namespace = next(t for t in first["body"]["tools"] if t["type"] == "namespace")
    assert [f"{namespace['name']}__{t['name']}" for t in namespace["tools"]] == \
        [n for n in names if n.startswith(namespace["name"] + "__")]
    assert not any(t["type"] == "web_search" for t in generate_of(first).tools)
    # `codex exec resume`: the first turn came back as a reasoning item alone, which is the
    # assistant's turn (empty, with its reasoning) between the two questions
    roles = [(m.role, m.content, bool(m.reasoning_content)) for m in generate_of(second).messages]
    assert roles[-3:] == [("user", "What does json.dumps do?", False), ("assistant", "", True),
                          ("user", "And json.loads?", False)]


def test_opencode_requests_carry_its_tool_loop(tokenizer):
    records = generations(FIXTURES["opencode"])
    assert [t["function"]["name"] for t in generate_of(records[0]).tools] == ["pydoc", "skill"]
    loop = generate_of(records[1])
    assistant, result = loop.messages[-2:]
    assert assistant.tool_calls[0].function.name == "pydoc" and assistant.reasoning_content
    assert result.role == "tool" and result.tool_call_id == assistant.tool_calls[0].id
    # the turn after the call renders the first prompt, the call as generated, and the result
    assert rendered(records[1], tokenizer).startswith(rendered(records[0], tokenizer))


def test_a_recorded_session_replays_against_the_daemon():
    from bench.agent import run_session
    out = run_session("tiny", __import__("pathlib").Path(__file__).with_name("fixtures") / "opencode.jsonl",
                      extra=["--snapshot-mem", "256MiB"])
    rows = out["fermoe"]["requests"]
    assert [r["status"] for r in rows] == [200] * len(generations(FIXTURES["opencode"]))
    assert out["fermoe"]["summary"]["failed"] == []
    for row, record in zip(rows, generations(FIXTURES["opencode"])):
        assert row["usage"]["prompt_tokens"] == record["usage"]["prompt_tokens"]
        assert row["ttft_s"] is not None and row["recorded"]["usage"] == record["usage"]
    # opencode's tool loop: the second request extends the first, so finds it cached
    assert rows[1]["usage"]["cached_tokens"] >= rows[0]["usage"]["prompt_tokens"] - 32
