"""A CPU worker runs one forward pass a round: a token for each of its decoding
sequences, then prompt chunks; each sequence still samples exactly what a local run
samples. The worker runs in this process; its messages to the coordinator are
collected instead of sent, and its passes recorded."""
from __future__ import annotations

import time

import pytest

from cpu_worker.worker import CPUWorker
from shared import protocol as P
from shared.generate import generate
from shared.model import Model
from shared.sampling import SamplingParams

REQUESTS = [("a", "The old GPU said", 12, 0.8, 1), ("b", "Snapshots of the recurrent state", 20, 0.0, None),
            ("c", "Tell me everything", 16, 0.8, 7)]


def _assign(model, rid, prompt, max_tokens, temperature, seed):
    return P.Assign(request_id=rid, tokens=model.tokenizer.encode(prompt), resume=[], snapshots=[],
                    max_tokens=max_tokens, sampling=SamplingParams(temperature=temperature, seed=seed),
                    ignore_eos=True)


@pytest.fixture
def worker(tiny_q4_path):
    w = CPUWorker(str(tiny_q4_path), "tcp://127.0.0.1:9", "test-worker", threads=2)  # never answered
    w.sent = []
    w.link.send = lambda msg, *frames, **how: w.sent.append(msg)
    w.passes = []                      # per pass: the number of tokens of each sequence in it
    forward_batch = w.engine.forward_batch
    w.engine.forward_batch = lambda segments: w.passes.append([len(t) for t, _ in segments]) or forward_batch(segments)
    yield w
    w.close()


def test_decoding_sequences_share_one_pass_and_sample_as_alone(worker, tiny_q4_path):
    model = worker.model
    for req in REQUESTS:
        worker.handle_assign(_assign(model, *req))
    while worker.sequences:
        worker.work_round()
    assert max(p.count(1) for p in worker.passes) == len(REQUESTS)   # all three decoded together

    finished = {m.request_id: m for m in worker.sent if isinstance(m, P.Finished)}
    for rid, prompt, max_tokens, temperature, seed in REQUESTS:
        sampled = [m.token for m in worker.sent if isinstance(m, P.Sampled) and m.request_id == rid]
        params = SamplingParams(temperature=temperature, seed=seed)
        alone = list(generate(worker.engine, model.tokenizer.encode(prompt), max_tokens, params))
        assert sampled == alone
        assert finished[rid].finish_reason == "length" and finished[rid].completion_tokens == max_tokens


def test_finished_reports_the_time_of_its_passes(worker):
    """Finished's prefill_ms and decode_ms, in milliseconds: at least the time of the
    passes the sequence was in (timed here around the engine's forward, inside the
    worker's own timing), at most the time the worker ran; one decode pass a token
    after the first (sampled from the prompt's logits)."""
    timed, forward = [], worker.engine.forward_batch        # per pass: ({(state id, position)}, seconds)

    def timing(segments):
        before, t0 = {(id(state), state.position) for _, state in segments}, time.perf_counter()
        out = forward(segments)
        timed.append((before, time.perf_counter() - t0))
        return out
    worker.engine.forward_batch = timing
    t0 = time.perf_counter()
    for req in REQUESTS:
        worker.handle_assign(_assign(worker.model, *req))
    states = {rid: (id(seq.state), len(seq.msg.tokens)) for rid, seq in worker.sequences.items()}
    while worker.sequences:
        worker.work_round()
    wall_ms = 1000 * (time.perf_counter() - t0)
    finished = {m.request_id: m for m in worker.sent if isinstance(m, P.Finished)}
    for rid, (state, n_prompt) in states.items():
        prefill = [s for positions, s in timed for sid, pos in positions if sid == state and pos < n_prompt]
        decode = [s for positions, s in timed for sid, pos in positions if sid == state and pos >= n_prompt]
        f = finished[rid]
        assert len(decode) == f.completion_tokens - 1
        assert 1000 * sum(prefill) <= f.prefill_ms <= wall_ms and 1000 * sum(decode) <= f.decode_ms <= wall_ms


def test_a_failed_pass_ends_its_sequences_and_the_worker_serves_on(worker):
    model = worker.model
    for req in REQUESTS[:2]:
        worker.handle_assign(_assign(model, *req))
    worker.work_round()                                   # the prompts
    real = worker.engine.forward_batch

    def broken(segments):
        worker.engine.forward_batch = real
        raise RuntimeError("simulated fault")
    worker.engine.forward_batch = broken
    worker.work_round()
    errors = [m for m in worker.sent if isinstance(m, P.Finished)]
    assert {m.request_id for m in errors} == {"a", "b"} and all("simulated fault" in m.error for m in errors)
    assert not worker.sequences
    worker.handle_assign(_assign(model, *REQUESTS[2]))
    while worker.sequences:
        worker.work_round()
    _assert_served_as_alone(worker, REQUESTS[2:])


def test_a_long_prompt_does_not_stall_running_generations(worker):
    """Every pass that takes a chunk of a 300-token prompt also takes the next token of
    the generation already running, and the prompt is cut at its snapshot positions that
    take a state (a KV link of the chain is written once passed, cutting nothing)."""
    model = worker.model
    worker.handle_assign(_assign(model, "a", "The old GPU said", 40, 0.8, 1))
    worker.work_round()                                   # its prompt: decoding from the next pass
    long = _assign(model, "b", "", 4, 0.8, 2)
    long.tokens = list(range(3, 303))
    worker.link.arena, worker.link.block = _Arena(), 8
    long.snapshots = [P.SnapshotRef(slot=0, state=0, position=100), P.SnapshotRef(slot=2, state=-1, position=150),
                      P.SnapshotRef(slot=1, state=1, position=200)]
    worker.handle_assign(long)
    while worker.sequences["b"].state.position < 300:
        worker.work_round()
    prefill_passes = worker.passes[1:]
    assert len(prefill_passes) == 6 and all(p[0] == 1 for p in prefill_passes)   # a decode token in each
    assert [sum(p[1:]) for p in prefill_passes] == [63, 37, 63, 37, 63, 37]       # cut at 100 and 200
    written = [m for m in worker.sent if isinstance(m, P.SnapshotWritten)]
    assert [(m.slot, m.state, m.position) for m in written] == [(0, 0, 100), (2, -1, 150), (1, 1, 200)]


def test_a_prompt_alone_prefills_in_long_passes(worker):
    model = worker.model
    long = _assign(model, "b", "", 2, 0.8, 2)
    long.tokens = list(range(3, 303))
    worker.handle_assign(long)
    while worker.sequences["b"].state.position < 300:
        worker.work_round()
    assert worker.passes == [[256], [44]]


def test_more_decoding_sequences_than_the_budget_starve_no_prompt(worker, monkeypatch):
    import cpu_worker.worker as W
    monkeypatch.setattr(W, "DECODING_PASS_TOKENS", 2)           # fewer than the decoding sequences
    model = worker.model
    for req in REQUESTS:
        worker.handle_assign(_assign(model, *req))
    worker.work_round()                                         # their prompts
    long = _assign(model, "d", "", 2, 0.8, 2)
    long.tokens = list(range(3, 40))
    worker.handle_assign(long)
    while worker.sequences["d"].state.position < len(long.tokens):
        worker.work_round()
    assert [p[-1] for p in worker.passes[1:]] == [W.MIN_PROMPT_TOKENS] * 4 + [37 - 4 * W.MIN_PROMPT_TOKENS]


class _Arena:
    """Snapshot slots in plain memory, as the shared arena hands them out."""
    def __init__(self):
        self.slots = {}

    def slot(self, i):
        return self.slots.setdefault(i, bytearray(1 << 24))      # larger than the tiny model's snapshots

    def state_slot(self, i):
        return self.slots.setdefault(("state", i), bytearray(1 << 24))

    def close(self):
        pass


def test_a_model_without_batching_still_serves(tiny_q4_path):
    """The reference engine has decode_batch too (a loop): the worker needs no special case."""
    w = CPUWorker(str(tiny_q4_path), "tcp://127.0.0.1:9", "ref-worker", threads=1, engine="reference")
    try:
        w.sent = []
        w.link.send = lambda msg, *frames, **how: w.sent.append(msg)
        for req in REQUESTS[:2]:
            w.handle_assign(_assign(Model(str(tiny_q4_path)), *req))
        while w.sequences:
            w.work_round()
        _assert_served_as_alone(w, REQUESTS[:2])
    finally:
        w.close()


def _assert_served_as_alone(worker, requests):
    """Each request ended once, at its length, without an error, having sampled (the
    tokens its text is made of) exactly what the same engine samples for it alone."""
    encode = worker.model.tokenizer.encode
    for rid, prompt, max_tokens, temperature, seed in requests:
        finished = [m for m in worker.sent if isinstance(m, P.Finished) and m.request_id == rid]
        assert len(finished) == 1, rid
        assert (finished[0].finish_reason, finished[0].error) == ("length", None), finished[0]
        assert finished[0].completion_tokens == max_tokens
        sampled = [m.token for m in worker.sent if isinstance(m, P.Sampled) and m.request_id == rid]
        params = SamplingParams(temperature=temperature, seed=seed)
        alone = list(generate(worker.engine, encode(prompt), max_tokens, params))
        assert sampled == alone, rid


def test_a_finished_sequences_state_buffer_is_reused_by_the_next_restore(worker):
    """Restoring a large model's state into a fresh buffer is mostly page faults: a
    finished sequence's recurrent buffer is kept and the next restore copies into it."""
    model = worker.model
    worker.link.arena, worker.link.block = _Arena(), 8
    first = _assign(model, "a", "The old GPU said", 2, 0.0, 1)
    first.tokens = list(range(3, 19))
    first.snapshots = [P.SnapshotRef(slot=0, state=-1, position=8), P.SnapshotRef(slot=1, state=1, position=16)]
    worker.handle_assign(first)
    buffer = worker.sequences["a"].state.buffer
    while worker.sequences:
        worker.work_round()
    again = _assign(model, "b", "", 2, 0.0, 1)
    again.tokens, again.resume = list(range(3, 19)), first.snapshots
    worker.handle_assign(again)
    assert worker.sequences["b"].state.buffer is buffer and worker.sequences["b"].state.position == 16
    while worker.sequences:
        worker.work_round()
    assert [m.token for m in worker.sent if isinstance(m, P.Sampled) and m.request_id == "b"] == \
        [m.token for m in worker.sent if isinstance(m, P.Sampled) and m.request_id == "a"]


def test_constrained_sequences_each_follow_their_own_grammar_in_one_pass(worker):
    """A JSON answer, a forced tool call and a free sequence decode together: one forward
    pass a round for all three; each constrained one ends, at its end-of-generation token,
    with text its grammar allows; the free one samples what it samples alone; a grammar that
    does not compile ends its own sequence with an error, and the worker serves on."""
    import json

    import jsonschema

    from shared.grammar import full_grammar, json_schema_text, tool_call_lark
    from shared.tool_parser import ToolCallParser
    from tests.shared.test_grammar import ANSWER, TOOLS, WEATHER

    model = worker.model
    eos = model.tokenizer.eos_ids
    grammars = {"json": full_grammar("json_schema", json_schema_text(ANSWER), False),
                "call": full_grammar("lark", tool_call_lark(TOOLS[:1], parallel=False), False),
                "bad": full_grammar("lark", "start: <no_such_token>", False)}
    for rid, grammar in grammars.items():
        msg = _assign(model, rid, "Answer in JSON", 300, 0.8, 5)
        msg.ignore_eos, msg.grammar = False, grammar
        worker.handle_assign(msg)
    worker.handle_assign(_assign(model, *REQUESTS[1]))
    while worker.sequences:
        worker.work_round()
    assert max(p.count(1) for p in worker.passes) == 3          # json, call and the free one together
    finished = {m.request_id: m for m in worker.sent if isinstance(m, P.Finished)}
    assert finished["bad"].finish_reason == "error" and "no_such_token" in finished["bad"].error
    sampled = {rid: [m.token for m in worker.sent if isinstance(m, P.Sampled) and m.request_id == rid]
               for rid in finished}
    for rid in ("json", "call"):
        assert finished[rid].finish_reason == "stop" and sampled[rid][-1] in eos, rid
    jsonschema.validate(json.loads(model.tokenizer.decode(sampled["json"][:-1])), ANSWER)
    parser = ToolCallParser(TOOLS)
    events = parser.feed(model.tokenizer.decode(sampled["call"][:-1])) + parser.finish()
    assert [e[3] for e in events if e[0] == "call"] == ["get_weather"]
    jsonschema.validate(json.loads("".join(e[2] for e in events if e[0] == "args")), WEATHER)
    _assert_served_as_alone(worker, [REQUESTS[1]])


def test_a_resume_without_a_state_slot_fails_that_sequence_alone(worker):
    """The last snapshot of a resume must name its state slot: one that does not ends
    its sequence with an error saying so; the worker serves on."""
    model = worker.model
    worker.link.arena, worker.link.block = _Arena(), 8
    bad = _assign(model, "bad", "", 2, 0.0, 1)
    bad.tokens, bad.resume = list(range(3, 19)), [P.SnapshotRef(slot=0, state=-1, position=8)]
    worker.handle_assign(bad)
    (finished,) = [m for m in worker.sent if isinstance(m, P.Finished)]
    assert finished.finish_reason == "error" and "state slot of the last" in finished.error
    worker.handle_assign(_assign(model, "ok", "The old GPU said", 2, 0.0, 1))
    while worker.sequences:
        worker.work_round()
    assert [m.request_id for m in worker.sent if isinstance(m, P.Finished)] == ["bad", "ok"]
