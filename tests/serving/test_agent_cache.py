"""The prefix cache across the turns of an agent conversation: the agent episode of
`fermoe bench agent` replayed through the HTTP API on the built-in model (its chat
template swapped for a Qwen3.6-style one that renders tools, calls and reasoning), the
model's own text and reasoning sent back each turn as agents send them. From the second
turn on, only what the agent appended since the previous generation is prefilled again,
plus the generation's last token (sampled, never run)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.agent
from bench.agent import replay, summary
from shared.builtin import BUILTIN
from shared.model import Model
from tests.support.bench_keys import assert_keys_documented
from tests.support.gguf_edit import rewrite_gguf
from tests.support.http_server import HttpDaemon
from tests.support.qwen_template import QWEN_STYLE_TEMPLATE

GENERATED = 24
SLACK = 4          # tokens where re-encoding the model's text may differ from what it sampled
# bench/make_agent_episode.py's build(result_chars=300, notes=False), kept: built afresh it
# quotes this repository's files, and the tiny model's answers (which the template re-renders)
# change with every edit to them
EPISODE = Path(__file__).resolve().parent.parent / "support" / "agent_episode_small.json"


def load_episode() -> dict:
    return json.loads(EPISODE.read_text())


def test_each_agent_turn_prefills_only_what_was_appended(tmp_path):
    model = tmp_path / "builtin-qwen-template.gguf"
    rewrite_gguf(BUILTIN["tiny"], model, meta={"tokenizer.chat_template": QWEN_STYLE_TEMPLATE})
    daemon = HttpDaemon(model, "--block", "64", "--snapshot-mem", "256MiB")
    try:
        rows = replay(daemon.url, load_episode(), max_tokens=GENERATED,
                      request={"ignore_eos": True})
    finally:
        assert daemon.stop() == 0
    assert len(rows) == 12 and rows[0]["cached_tokens"] == 0
    resumed_after_the_answer = 0
    for previous, row in zip(rows, rows[1:]):
        assert row["completion_tokens"] == GENERATED and row["appended_tokens"] > 0
        # the previous prompt always comes from the cache (its end is a snapshot) ...
        assert row["cached_tokens"] >= previous["prompt_tokens"], (previous, row)
        # ... and, where the template renders the answer back as the tokens the model sampled,
        # all but the last token of its generation too. Which answers those are depends on
        # the tiny model's text, and so on the CPU's kernels: one that holds an end-of-turn
        # token it sampled past ignore_eos, or a word its tokenizer splits otherwise, is
        # rewritten from there, and the turn resumes at the last snapshot before that.
        resumed_after_the_answer += row["cached_tokens"] >= previous["prompt_tokens"] + GENERATED - SLACK
    assert resumed_after_the_answer >= 8, rows
    again = summary(rows)["reprefilled_beyond_appended"]
    assert len(again) == 11 and sorted(again)[7] <= SLACK, again
    assert_keys_documented({"fermoe": {"turns": rows, "summary": summary(rows)}}, bench.agent)


@pytest.mark.parametrize("store", [("--snapshot-mem", "256MiB"),
                                   ("--snapshot-mem", "3MiB", "--snapshot-states", "4")])
def test_a_new_user_message_that_drops_earlier_reasoning_resumes_where_that_turn_began(tmp_path, store):
    """Without preserve_thinking the template drops the reasoning of the turns before the
    last user message once a new one comes, so that prompt matches the cache only up to
    where the first answer began: the snapshot taken at its turn's start serves it, also
    in a store of four states that the agent's steps in between have cycled through many
    times (the coordinator names that turn start in each of their prompts)."""
    model = tmp_path / "builtin-qwen-template.gguf"
    rewrite_gguf(BUILTIN["tiny"], model, meta={"tokenizer.chat_template": QWEN_STYLE_TEMPLATE})
    daemon = HttpDaemon(model, "--block", "64", *store)
    episode = load_episode()
    second_request = next(i for i, t in enumerate(episode["turns"]) if i and "user" in t)
    try:
        rows = replay(daemon.url, episode, max_tokens=GENERATED,
                      request={"ignore_eos": True, "chat_template_kwargs": {"preserve_thinking": False}})
    finally:
        assert daemon.stop() == 0
    first_prompt = rows[0]["prompt_tokens"]
    turn = rows[second_request]
    assert turn["cached_tokens"] < rows[second_request - 1]["prompt_tokens"]     # the template rewrote history
    # resumed where the first answer's own text began, after its role line: the tokens of the
    # opened reasoning block are all that the first prompt has beyond it
    encode = Model(str(model)).tokenizer.encode
    opened = len(encode("<|im_start|>assistant\n<think>\n")) - len(encode("<|im_start|>assistant\n"))
    assert turn["cached_tokens"] == first_prompt - opened, (first_prompt, opened, turn)
