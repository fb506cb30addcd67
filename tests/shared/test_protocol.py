"""The wire messages (shared/protocol.py): a whole context fits one message, and the one
size limit names the option that raises it."""
from __future__ import annotations

import pytest

from shared import protocol as P
from shared.errors import FermoeError
from shared.sampling import SamplingParams


def test_a_whole_context_of_token_ids_fits_in_an_assign():
    tokens = [248319] * 262144                       # the largest ids of Qwen3.5's vocabulary: 5 bytes each
    msg = P.Assign(request_id="r", tokens=tokens, resume=[], snapshots=[], max_tokens=1,
                   sampling=SamplingParams(seed=1))
    data = P.encode(msg)
    assert len(data) > 1 << 20 and P.decode(data, P.TO_WORKER).tokens == tokens


def test_the_message_limit_names_the_option_that_raises_it():
    data = P.encode(P.Generate(request_id="r", prompt="x" * 5000))
    P.set_max_message_bytes(4096)
    try:
        with pytest.raises(FermoeError, match=r"the message is \d+ bytes, over the limit of 4096 bytes .*"
                                              r"--max-request-size"):
            P.decode(data, P.CLIENT_MESSAGES)
    finally:
        P.set_max_message_bytes(P.MAX_MESSAGE_BYTES)
    assert P.decode(data, P.CLIENT_MESSAGES).prompt == "x" * 5000


def test_a_snapshot_without_its_state_slot_is_a_clear_error():
    """A snapshot names its KV slot and its state slot (-1: none); a message of a build
    that knew one slot a snapshot (no `state`) is refused naming the field, never half read."""
    import msgspec
    ref = P.SnapshotRef(slot=3, state=-1, position=8)
    pairs = [(4, 1), (5, 2)]
    msg = P.Assign(request_id="r", tokens=[1] * 9, resume=[ref], snapshots=[ref], max_tokens=1,
                   sampling=SamplingParams(seed=1), decode_slots=pairs)
    back = P.decode(P.encode(msg), P.TO_WORKER)
    assert back.resume == [ref] and back.decode_slots == pairs
    old = msgspec.msgpack.encode({"type": "assign", "request_id": "r", "tokens": [1], "resume": [
        {"slot": 3, "position": 8}], "snapshots": [], "max_tokens": 1, "sampling": SamplingParams(seed=1)})
    with pytest.raises(FermoeError, match=r"invalid message: .*state.*\$\.resume\[0\]"):
        P.decode(old, P.TO_WORKER)
    written = msgspec.msgpack.encode({"type": "snapshot_written", "request_id": "r", "slot": 3})
    with pytest.raises(FermoeError, match="invalid message: .*state"):
        P.decode(written, P.FROM_WORKER)
