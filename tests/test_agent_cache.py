"""The prefix cache across the turns of an agent conversation: the agent episode of
`fermoe bench agent` replayed through the HTTP API on the built-in model (its chat
template swapped for a Qwen3.6-style one that renders tools, calls and reasoning), the
model's own text and reasoning sent back each turn as agents send them. From the second
turn on, only what the agent appended since the previous generation is prefilled again,
plus the generation's last token (sampled, never run)."""
from __future__ import annotations

from bench.agent import replay, summary
from bench.make_agent_episode import build
from shared.builtin import BUILTIN
from tests.gguf_edit import rewrite_gguf
from tests.http_server import HttpDaemon
from tests.qwen_template import QWEN_STYLE_TEMPLATE

GENERATED = 24
SLACK = 4          # tokens where re-encoding the model's text may differ from what it sampled


def test_each_agent_turn_prefills_only_what_was_appended(tmp_path):
    model = tmp_path / "builtin-qwen-template.gguf"
    rewrite_gguf(BUILTIN["tiny"], model, meta={"tokenizer.chat_template": QWEN_STYLE_TEMPLATE})
    daemon = HttpDaemon(model, "--block", "64", "--snapshot-mem", "256MiB")
    try:
        rows = replay(daemon.url, build(result_chars=300, notes=False), max_tokens=GENERATED,
                      request={"ignore_eos": True})
    finally:
        assert daemon.stop() == 0
    assert len(rows) == 12 and rows[0]["cached_tokens"] == 0
    for previous, row in zip(rows, rows[1:]):
        assert row["completion_tokens"] == GENERATED and row["appended_tokens"] > 0
        # the previous prompt and all but the last token of its generation came from the cache
        assert row["cached_tokens"] >= previous["prompt_tokens"] + GENERATED - SLACK, (previous, row)
    again = summary(rows)["reprefilled_beyond_appended"]
    assert len(again) == 11 and max(again) <= SLACK and sum(again) <= 2 * len(again), again
