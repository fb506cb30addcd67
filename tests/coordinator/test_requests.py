"""What the coordinator keeps about a served request (coordinator/requests.py): stop
strings as the stream is detokenised (the returned text never holds a stop string: it
ends before the first place any of them starts, whichever comes first in the list), and
the snapshot slots of a request that ended before its worker stopped."""
from __future__ import annotations

import types

import pytest

from coordinator.requests import TextStream
from shared.model import Model


@pytest.fixture(scope="module")
def tokenizer(tiny_q4_path):
    return Model(tiny_q4_path).tokenizer


def _long_piece(tokenizer) -> tuple[int, str]:
    """A token whose text is at least 4 printable characters, all different."""
    for t in range(len(tokenizer.tokens)):
        piece = tokenizer.decode([t])
        if len(piece) >= 4 and piece.isprintable() and len(set(piece)) == len(piece):
            return t, piece
    raise AssertionError("no token of 4 distinct printable characters")


def test_two_stop_strings_in_one_token_cut_at_the_earlier(tokenizer):
    token, piece = _long_piece(tokenizer)
    stream = TextStream(tokenizer, [piece[2:], piece[1:2]])       # the later one listed first
    assert stream.feed(token) == piece[:1] and stream.stopped
    assert stream.flush() == ""


def test_a_stop_string_across_tokens_is_held_back_then_cut(tokenizer):
    token, piece = _long_piece(tokenizer)
    stream = TextStream(tokenizer, [piece[-1] + piece[0]])         # the end of one, the start of the next
    shown = stream.feed(token)
    assert piece.startswith(shown) and not stream.stopped
    assert shown + stream.feed(token) == piece[:-1] and stream.stopped


def test_an_ended_requests_slots_wait_for_its_worker():
    """Slots a worker may still be writing after the request ended here are reused only
    once that worker says it stopped (or is lost), never freed at once."""
    from coordinator.requests import Unfinished
    from coordinator.snapshots import SnapshotIndex
    index = SnapshotIndex(8, block=4)
    unfinished = Unfinished(index)
    req = types.SimpleNamespace(rid="r", worker="w1", planned=index.plan(list(range(10)), 0),
                                decode_slots=index.reserve(2))
    assert index.stats()["free_slots"] == 3
    unfinished.hold(req)
    assert req.planned == req.decode_slots == [] and index.stats()["free_slots"] == 3
    unfinished.stopped("r", "w2")                          # another worker's word counts for nothing
    assert index.stats()["free_slots"] == 3
    unfinished.stopped("r", "w1")
    assert index.stats()["free_slots"] == 8
    other = types.SimpleNamespace(rid="s", worker="w1", planned=index.plan(list(range(6)), 0), decode_slots=[])
    unfinished.hold(other)
    unfinished.worker_lost("w1")
    assert index.stats()["free_slots"] == 8 and not unfinished.held
    index.check_invariants()
