"""The snapshot store's two pools on a real daemon: a conversation far longer than a small
--snapshot-mem could hold as whole snapshots (a state and a block's KV each) still resumes
every turn after the previous answer, from KV links and a few states."""
from __future__ import annotations

from coordinator.client import Client
from coordinator.memory import snapshot_pools
from shared.model import Model
from shared.state import kv_slot_nbytes, state_slot_nbytes
from tests.support.serving_harness import BLOCK, Daemon, local_ids, streamed_ids

WHOLE_SNAPSHOTS = 10    # the budget: this many whole snapshots (10 blocks of positions)
TURNS = 13
GENERATED = 6           # each answer crosses a block boundary every other turn or so
APPENDED = 5
FIRST = 45


def test_a_long_conversation_resumes_after_each_answer_in_a_small_store(tiny_q4_path):
    cfg = Model(tiny_q4_path, convert=False).config
    kv, state = kv_slot_nbytes(cfg, BLOCK), state_slot_nbytes(cfg)
    budget = WHOLE_SNAPSHOTS * (kv + state)
    old_positions = WHOLE_SNAPSHOTS * BLOCK                  # what whole snapshots of this budget cover
    daemon = Daemon(tiny_q4_path, "--snapshot-mem", str(budget))
    try:
        with Client(daemon.addr, timeout_s=120) as c:
            stats = c.status().snapshots
            assert (stats["slots"], stats["state_slots"]) == snapshot_pools(budget, kv, state)
            assert stats["state_slots"] == 4 and stats["slots"] * BLOCK > 2 * old_positions
            # the first prompt has more block boundaries than the store has states
            prompt, cached = [5 + (11 * i) % 300 for i in range(FIRST)], []
            for turn in range(TURNS):
                msgs = list(c.generate(tokens=prompt, max_tokens=GENERATED, ignore_eos=True, seed=turn))
                cached.append(msgs[-1].cached_prompt_tokens)
                answer = streamed_ids(msgs)
                assert len(answer) == GENERATED
                last_prompt = prompt
                prompt = prompt + answer + [7 + turn, 8, 9, 10, 11][:APPENDED]
            stats = c.status().snapshots
    finally:
        daemon.stop()
    # every turn after the first: the previous prompt and its answer but the last token
    # (sampled, never fed) came from the cache
    lengths = [FIRST + t * (GENERATED + APPENDED) for t in range(TURNS)]
    assert cached == [0] + [n + GENERATED - 1 for n in lengths[:-1]], cached
    assert cached[-1] > 2 * old_positions                     # the old layout ran out long before
    assert stats["states"] <= 4 < stats["entries"] and stats["misses"] == 1
    assert streamed_ids(msgs) == local_ids(tiny_q4_path, last_prompt, GENERATED, seed=TURNS - 1)
