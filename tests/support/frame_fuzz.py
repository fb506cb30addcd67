"""Hostile and careless frames made from valid messages, for the fuzz test of every
socket that decodes bytes from another process: deep nesting, huge integers, wrong
types, truncated, empty, 8 MiB, unknown types and fields, extra frames.

Messages are built as raw MessagePack (a map's items packed one by one), because a
nesting of 100,000 arrays is past what any packer will write, and that is the point."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import msgpack

from shared import protocol as P

DEEP = 100_000                       # arrays nested inside each other: past any decoder's recursion
HUGE_INTS = [2**64 - 1, 2**63, -2**63, 2**32, -1]
WRONG = [None, True, 3.5, "text", b"bytes", [1, [2]], {"k": {"k": 1}}]
EIGHT_MIB = 8 << 20


def deep(levels: int = DEEP) -> bytes:
    return b"\x91" * levels + b"\xc0"


def pack_map(items: list[tuple[str, bytes]]) -> bytes:
    """A map of already packed values (map32 header: any count)."""
    return b"\xdf" + len(items).to_bytes(4, "big") + b"".join(msgpack.packb(k) + v for k, v in items)


def fields_of(msg) -> list[tuple[str, bytes]]:
    """A message's (field, packed value) pairs, its "type" first."""
    return [(k, msgpack.packb(v)) for k, v in msgpack.unpackb(P.encode(msg), raw=False).items()]


def mutants(msg, rng: random.Random) -> Iterator[tuple[str, list[bytes]]]:
    """(what was done, the frames) for one valid message: each kind of fault once, a
    field chosen at random where the fault is in one field."""
    items = fields_of(msg)
    data = P.encode(msg)
    field = rng.randrange(1, len(items)) if len(items) > 1 else 0

    def with_value(value: bytes, at: int = field) -> bytes:
        return pack_map([(k, value if i == at else v) for i, (k, v) in enumerate(items)])

    yield "nested 100,000 deep at the top", [deep()]
    yield f"nested 100,000 deep in {items[field][0]}", [with_value(deep())]
    yield "nested 100,000 deep in an unknown field", [pack_map(items + [("x-extra", deep())])]
    yield f"nested 100 deep in {items[field][0]}", [with_value(b"\x81\xa1k" + deep(100))]
    yield f"huge integer in {items[field][0]}", [with_value(msgpack.packb(rng.choice(HUGE_INTS)))]
    yield f"wrong type in {items[field][0]}", [with_value(msgpack.packb(rng.choice(WRONG)))]
    yield "truncated", [data[:rng.randrange(len(data))]]
    yield "empty", [b""]
    yield "8 MiB of garbage", [rng.randbytes(64) * (EIGHT_MIB // 64)]
    yield f"8 MiB string in {items[field][0]}", [with_value(msgpack.packb("x" * EIGHT_MIB))]
    yield "unknown type", [with_value(msgpack.packb("no-such-message"), at=0)]
    yield "unknown field", [pack_map(items + [("x-extra", msgpack.packb(1))])]
    yield "missing fields", [pack_map(items[:1])]
    yield "a claimed length past the end", [b"\xdd\xff\xff\xff\xff" + data[:8]]
    yield "extra frames", [data, b"extra", b"more"]


def fuzz(messages: list, rounds: int, send: Callable[[str, list[bytes]], None], seed: int = 0) -> int:
    """Send `rounds` rounds of every mutant of every message; the number of sends."""
    rng, n = random.Random(seed), 0
    for _ in range(rounds):
        for msg in messages:
            for what, frames in mutants(msg, rng):
                send(f"{type(msg).__name__}: {what}", frames)
                n += 1
    return n


# ---- one valid message of each type, by the socket that receives it --------------------
def client_messages(request_id: str = "fuzz") -> list:
    """What a client sends the coordinator (max_tokens 1: a mutant that stays valid runs briefly)."""
    call = P.ToolCall(function=P.FunctionCall(name="pydoc", arguments={"name": "json"}), id="c1")
    return [P.Generate(request_id=f"{request_id}-p", prompt="Return the", max_tokens=1),
            P.Generate(request_id=f"{request_id}-t", tokens=[5, 6, 7], max_tokens=1, logprobs=2),
            P.Generate(request_id=f"{request_id}-m", max_tokens=1, tools=[{"type": "function", "function": {
                "name": "pydoc", "parameters": {"type": "object"}}}], chat_template_kwargs={"enable_thinking": False},
                messages=[P.ChatMessage(role="user", content="hi"),
                          P.ChatMessage(role="assistant", content="", tool_calls=[call]),
                          P.ChatMessage(role="tool", content="json: JSON", tool_call_id="c1")]),
            P.Cancel(request_id=f"{request_id}-p"), P.Status()]


def worker_messages(request_id: str = "fuzz") -> list:
    """What a worker sends the coordinator, less Hello (the fuzzing worker joins with a real one)."""
    return [P.Attached(arena=False), P.Heartbeat(running=0),
            P.Sampled(request_id=request_id, token=3, prefill_ms=1.0, top_logprobs=[P.TokenLogprob(token=1, logprob=-1.0)]),
            P.SnapshotWritten(request_id=request_id, slot=0, state=0, position=8),
            P.Finished(request_id=request_id, finish_reason="stop", prefill_ms=1.0, decode_ms=1.0, completion_tokens=1),
            P.Prefilled(request_id=request_id, prefill_ms=1.0), P.Error(message="fuzz", request_id=request_id),
            P.HybridMailbox(mailbox="fermoe_fuzz_mailbox")]


def coordinator_messages(request_id: str = "fuzz") -> list:
    """What the coordinator sends a worker, less Shutdown (a valid one ends it) and Welcome."""
    ref = P.SnapshotRef(slot=0, state=0, position=8)
    return [P.Assign(request_id=request_id, tokens=[5, 6, 7], resume=[], snapshots=[ref], max_tokens=1,
                     sampling=P.SamplingParams(seed=1), decode_slots=[(1, 1)]),
            P.Prefill(request_id=request_id, tokens=[5, 6, 7], resume=[ref], snapshots=[]),
            P.Stop(request_id=request_id), P.DecodeSlots(request_id=request_id, slots=[(2, -1)]),
            P.HybridPeer(worker_id="cpu-fuzz", mailbox="fermoe_no_such_mailbox", pid=1), P.HybridReady(pid=1),
            P.HybridLost()]


def coordinator_replies(request_id: str = "fuzz") -> list:
    """What the coordinator sends a client."""
    return [P.Token(request_id=request_id, token=3, text="x", logprob=-0.5),
            P.Done(request_id=request_id, finish_reason="length", completion_tokens=1),
            P.Error(message="fuzz", request_id=request_id, code="x"),
            P.StatusReply(model="m", workers=[P.WorkerInfo(worker_id="w", pid=1, threads=1, running=0, alive=True)],
                          queued=0, running=0, snapshots={"slots": 1})]
