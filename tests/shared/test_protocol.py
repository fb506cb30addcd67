"""The wire messages (shared/protocol.py): a whole context fits one message, and the one
size limit names the option that raises it."""
from __future__ import annotations

import re

import pytest

from shared import protocol as P
from shared.errors import FermoeError
from shared.sampling import SamplingParams
from tests.support import frame_fuzz


def test_a_whole_context_of_token_ids_fits_in_an_assign():
    tokens = [248319] * 262144                       # the largest ids of Qwen3.5's vocabulary: 5 bytes each
    msg = P.Assign(request_id="r", tokens=tokens, resume=[], snapshots=[], max_tokens=1,
                   sampling=SamplingParams(seed=1))
    data = P.encode(msg)
    assert len(data) > 1 << 20 and P.decode(data, P.TO_WORKER).tokens == tokens


def test_the_message_limit_names_the_option_that_raises_it():
    """A message of exactly the limit is decoded, one byte less of limit refuses it. Fault
    guarded: `>=` for `>` refused a request of exactly --max-request-size bytes."""
    data = P.encode(P.Generate(request_id="r", prompt="x" * 5000))
    try:
        P.set_max_message_bytes(len(data))
        assert P.decode(data, P.CLIENT_MESSAGES).prompt == "x" * 5000
        P.set_max_message_bytes(len(data) - 1)
        with pytest.raises(FermoeError, match=rf"^the message is {len(data)} bytes, over the limit of {len(data) - 1} "
                                              r"bytes \(the coordinator's --max-request-size raises it\)$"):
            P.decode(data, P.CLIENT_MESSAGES)
        P.set_max_message_bytes(4096)
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


@pytest.mark.parametrize("kind, messages", [
    (P.CLIENT_MESSAGES, frame_fuzz.client_messages()), (P.FROM_WORKER, frame_fuzz.worker_messages()),
    (P.TO_WORKER, frame_fuzz.coordinator_messages()), (P.CLIENT_REPLIES, frame_fuzz.coordinator_replies())])
def test_no_frame_raises_anything_but_a_protocol_error(kind, messages):
    """Fault guarded: the request id of a frame of 100,000 nested arrays was read by an
    untyped decode, whose RecursionError killed the coordinator's loop; any decode of
    bytes from another process may only answer a message or a ProtocolError."""
    def check(what, frames):
        try:
            P.decode(frames[0], kind)
        except P.ProtocolError:
            pass
        rid = P.request_id_of(frames[0])
        assert rid is None or isinstance(rid, str), what
    assert frame_fuzz.fuzz(messages, rounds=3, send=check) > 0


def test_deep_free_form_fields_are_refused_by_name_at_the_limit():
    """tools, chat_template_kwargs and a call's arguments are the client's own JSON:
    MAX_NESTING containers deep is taken, one more is refused naming the field."""
    def nested(levels):
        value = 1
        for _ in range(levels):
            value = [value]
        return value
    inside = P.MAX_NESTING - 2                  # the field's list and its first dict
    ok = P.Generate(request_id="r", prompt="x", tools=[{"x": nested(inside)}])
    assert P.decode(P.encode(ok), P.CLIENT_MESSAGES).tools == ok.tools
    for msg, field in [
            (P.Generate(request_id="r", prompt="x", tools=[{"x": nested(inside + 1)}]), "tools"),
            (P.Generate(request_id="r", prompt="x", chat_template_kwargs={"x": nested(inside + 2)}),
             "chat_template_kwargs"),
            (P.Generate(request_id="r", messages=[P.ChatMessage(role="assistant", tool_calls=[P.ToolCall(
                function=P.FunctionCall(name="f", arguments={"x": nested(inside + 2)}))])]),
             "messages[0].tool_calls[0].function.arguments")]:
        with pytest.raises(P.ProtocolError, match=rf"`{re.escape(field)}` nests containers deeper than "
                                                  rf"{P.MAX_NESTING} levels"):
            P.decode(P.encode(msg), P.CLIENT_MESSAGES)


def test_the_request_id_of_a_broken_message_is_read_where_it_can_be():
    good = frame_fuzz.pack_map([("type", b"\xa8generate"), ("request_id", b"\xa1r"), ("max_tokens", b"\xa4many")])
    assert P.request_id_of(good) == "r"
    assert P.request_id_of(frame_fuzz.deep()) is None
    assert P.request_id_of(frame_fuzz.pack_map([("request_id", b"\x07")])) is None
