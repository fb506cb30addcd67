"""The whole system with real processes on the tiny model: a coordinator daemon,
its CPU worker, clients over ZeroMQ. Streamed output must equal
`fermoe generate --engine cpu` (the native forward is bitwise independent of how
a prompt is chunked, so snapshots and replays change nothing)."""
from __future__ import annotations

import msgspec
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from coordinator.client import Client
from shared.errors import FermoeError
from shared import protocol as P
from shared.sampling import SamplingParams
from shared.model import Model
from tests.support.bench_keys import assert_keys_documented
from tests.support.eos_seed import seed_with_early_eos
from tests.support.sampling_cases import SEED, field_cases, option_cases
from tests.support.serving_harness import (BLOCK, Daemon, local, local_ids, local_text, run, shm_names, stop_string_at,
                                   streamed_ids, wait_until)
from tests.support.smaps import mapping_rss

LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the old GPU hums along, " * 2


MAX_REQUEST = 1 << 20           # the fuzz's oversized messages need not be 64 MiB each


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    d = Daemon(tiny_q4_path, "--max-request-size", str(MAX_REQUEST))
    yield d
    if d.proc.poll() is None:
        d.stop()


def test_stream_equals_local_generate(daemon, tiny_q4_path):
    text, done = run(daemon.addr, LONG_PROMPT, max_tokens=24, seed=11, temperature=0.8)
    assert done.finish_reason in ("length", "stop") and done.completion_tokens > 0
    assert text == local(tiny_q4_path, LONG_PROMPT, 24, seed=11)


def test_repeated_and_extended_prompts_use_the_cache(daemon, tiny_q4_path):
    prompt = "A cached prefix, long enough to span a few snapshot blocks of eight tokens each."
    first_text, first = run(daemon.addr, prompt, max_tokens=12, seed=3)
    again_text, again = run(daemon.addr, prompt, max_tokens=12, seed=3)
    assert again.cached_prompt_tokens == again.prompt_tokens == first.prompt_tokens
    assert again_text == first_text
    longer = prompt + " And then some more words to extend it."
    ext_text, ext = run(daemon.addr, longer, max_tokens=12, seed=3)
    assert ext.cached_prompt_tokens >= first.prompt_tokens // BLOCK * BLOCK > 0
    assert ext.cached_prompt_tokens < ext.prompt_tokens
    assert ext_text == local(tiny_q4_path, longer, 12, seed=3)


@pytest.mark.parametrize("generated", [13, 12, 30])
def test_the_next_turn_resumes_after_the_previous_generation(daemon, tiny_q4_path, generated):
    """Snapshots are written while decoding (at block boundaries) and where the generation
    ends, so a prompt that appends to prompt + answer prefills only what it appended: 13
    generated tokens end between blocks, 12 on a boundary (its block snapshot serves), 30
    cross more boundaries than the slots a sequence starts with."""
    with Client(daemon.addr, timeout_s=120) as c:
        prompt = [5 + (11 * i) % 300 for i in range(21)]
        msgs = list(c.generate(tokens=prompt, max_tokens=generated, ignore_eos=True, seed=generated))
        answer = streamed_ids(msgs)
        assert len(answer) == generated
        turn2 = prompt + answer + [7, 8, 9, 10, 11]
        msgs = list(c.generate(tokens=turn2, max_tokens=4, ignore_eos=True, seed=1))
    done = msgs[-1]
    # the last token sampled is never fed: the state ends one short of prompt + answer
    assert done.cached_prompt_tokens == len(prompt) + generated - 1
    assert streamed_ids(msgs) == local_ids(tiny_q4_path, turn2, 4, seed=1)


def test_an_idle_worker_maps_the_state_slots(daemon):
    """While idle the CPU worker maps every page of the snapshot store's state slots
    (SnapshotArena.prefault), so no request's final snapshot pays for faulting them in."""
    from shared.shm_arena import _HEADER, _stride
    (name,) = shm_names(daemon.proc.pid)
    with open(f"/dev/shm/{name}", "rb") as f:
        _, _, _, _, _, state_bytes, n_states, _ = _HEADER.unpack(f.read(_HEADER.size))
    states = n_states * _stride(state_bytes)
    assert states > 0
    pid = daemon.workers[0].pid

    def rss() -> int:
        return mapping_rss(pid, lambda line: line.endswith(f"/dev/shm/{name}"))

    wait_until(lambda: rss() >= states, 60, f"the worker's mapping of {name} holding its {states} bytes of states")


def test_logprobs_are_the_models_before_sampling_modifiers(daemon, tiny_q4_path):
    """Each streamed token carries its log-probability and the n most likely tokens', from
    the logits as the model gives them (temperature and the rest left out): the values a
    local decode of the same tokens computes."""
    from cpu_worker.native_engine import NativeEngine
    from shared.sampling import logprobs_of
    prompt = [5 + (13 * i) % 300 for i in range(17)]
    with Client(daemon.addr, timeout_s=120) as c:
        msgs = list(c.generate(tokens=prompt, max_tokens=6, ignore_eos=True, seed=4, temperature=1.5, logprobs=3))
        with pytest.raises(FermoeError, match=r"logprobs must be in \[0, 20\]"):
            list(c.generate(tokens=prompt, max_tokens=1, logprobs=21))
    tokens = [m for m in msgs if isinstance(m, P.Token) and m.token >= 0]
    engine = NativeEngine(Model(str(tiny_q4_path)), threads=1)
    try:
        state = engine.new_state()
        logits = engine.forward(prompt, state, all_logits=False)[-1]
        for m in tokens:
            want, top = logprobs_of(logits, m.token, 3)
            assert m.logprob == pytest.approx(want, abs=1e-5) and m.logprob <= 0
            assert [t.token for t in m.top_logprobs] == [t for t, _ in top]
            assert [t.logprob for t in m.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-5)
            logits = engine.forward([m.token], state, all_logits=False)[-1]
    finally:
        engine.close()
    assert len(tokens) == 6


def test_concurrent_clients(daemon, tiny_q4_path):
    prompts = [f"Client number {i} asks about snapshots" for i in range(4)]
    results = {}

    def client(i):
        results[i] = run(daemon.addr, prompts[i], max_tokens=16, seed=i)[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, p in enumerate(prompts):
        assert results[i] == local(tiny_q4_path, p, 16, seed=i)


def test_cancel_and_stop_strings(daemon):
    """A client cancels its own request, not another's nor one that is not there."""
    with Client(daemon.addr) as c, Client(daemon.addr, timeout_s=10) as other:
        rid = c.submit("Tell me everything", max_tokens=5000, temperature=0.8, seed=1, ignore_eos=True)
        stream = c.stream(rid)
        next(stream)
        other.cancel(rid)
        with pytest.raises(FermoeError, match=f"no running request '{rid}'"):
            list(other.stream(rid))
        c.cancel("nobody")
        with pytest.raises(FermoeError, match="no running request 'nobody'"):
            list(c.stream("nobody"))
        c.cancel(rid)
        done = [m for m in stream][-1]
        assert done.finish_reason == "cancelled" and done.completion_tokens < 5000
    full, _ = run(daemon.addr, "Stop strings", max_tokens=40, seed=2)
    stop = full[5:8]
    cut, done = run(daemon.addr, "Stop strings", max_tokens=40, seed=2, stop=[stop])
    assert done.finish_reason == "stop" and cut == full[:full.index(stop)]


def test_several_stop_strings(daemon):
    """Stop strings given together: the text ends before whichever shows first, wherever
    it stands in the list; one that never shows changes nothing."""
    params = dict(max_tokens=48, seed=12, ignore_eos=True)
    full, _ = run(daemon.addr, "Several stop strings", **params)
    early, late = stop_string_at(full, len(full) // 4), stop_string_at(full, len(full) // 2)
    cut, done = run(daemon.addr, "Several stop strings", stop=[late, "never \x07 there", early], **params)
    assert done.finish_reason == "stop" and cut == full[:full.index(early)]
    cut, done = run(daemon.addr, "Several stop strings", stop=["never \x07 there", late], **params)
    assert done.finish_reason == "stop" and cut == full[:full.index(late)] and len(cut) > full.index(early)


def test_every_finish_reason_has_its_timings_and_one_log_line(daemon, tiny_q4_path):
    """A request ended by a stop string (here, before its worker reports) has the timings
    of one that ran to its length: its prompt's prefill and its tokens' rate. The daemon
    logs one line for each finished request, saying what it was and why it ended."""
    prompt = "Timings of a request a stop string ends, on a prompt new to the cache"
    params = dict(max_tokens=40, seed=21, ignore_eos=True)
    stop = stop_string_at(local_text(tiny_q4_path, prompt, 40, seed=21), 60)    # what the daemon will stream
    cut, done = run(daemon.addr, prompt, stop=[stop], **params)
    _, whole = run(daemon.addr, "Another prompt new to the cache, which runs to its length", **params)
    assert (whole.finish_reason, done.finish_reason, done.stop_reason, whole.stop_reason) == \
        ("length", "stop", stop, None)
    for d in (whole, done):
        assert d.prefill_ms > 0 and d.decode_tok_s > 0 and d.completion_tokens > 2, d

    def logged(d, why):
        start = f"request {d.request_id} finished ({why}): prompt {d.prompt_tokens} tokens " \
                f"({d.cached_prompt_tokens} cached), {d.completion_tokens} generated; prefill "
        return [line for line in daemon.log if start in line and " tok/s; total " in line]
    wait_until(lambda: logged(done, f"stop: stop string {stop!r}") and logged(whole, "length"), 30,
               "a log line for each finished request")
    assert len(logged(whole, "length")) == 1


def test_messages_are_rendered_with_the_chat_template(daemon, tiny_q4_path):
    """`messages` become the model's chat template rendered: the very tokens of that text
    sent as a plain prompt (which is then an exact cache hit of the first request), and
    so the same answer with the same seed."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"},
                {"role": "assistant", "content": "Scattering."}, {"role": "user", "content": "Say more."}]
    templated = Model(tiny_q4_path).tokenizer.apply_chat_template(messages)
    with Client(daemon.addr, timeout_s=120) as c:
        chat = list(c.generate(messages=messages, max_tokens=12, seed=8))
        plain = list(c.generate(templated, max_tokens=12, seed=8))
    n_prompt = len(Model(tiny_q4_path).tokenizer.encode(templated))
    assert chat[-1].prompt_tokens == plain[-1].cached_prompt_tokens == plain[-1].prompt_tokens == n_prompt
    assert streamed_ids(chat) == streamed_ids(plain) == local_ids(tiny_q4_path, templated, 12, eos=True,
                                                                  temperature=0.8, seed=8)


def test_ignore_eos_streams_past_end_of_generation(daemon, tiny_q4_path):
    params = dict(max_tokens=48, temperature=0.8, seed=seed_with_early_eos(tiny_q4_path, "Tell me everything", 48, 0.8))
    with Client(daemon.addr, timeout_s=120) as c:
        obeyed = list(c.generate("Tell me everything", **params))
        ignored = list(c.generate("Tell me everything", ignore_eos=True, **params))
    assert obeyed[-1].finish_reason == "stop" and len(obeyed) - 1 < 48   # this seed samples an EOS early
    assert ignored[-1].finish_reason == "length" and len(ignored) - 1 == 48
    assert [m.token for m in ignored[:len(obeyed) - 1]] == [m.token for m in obeyed[:-1]]


def test_bad_requests_get_errors_and_the_daemon_serves_on(daemon):
    with Client(daemon.addr) as c:
        for params, problem in [(dict(prompt="x", tokens=[1]), "exactly one"),
                                (dict(tokens=[10**9]), "token ids"),
                                (dict(prompt="x", top_p=2.0), "top_p"),
                                (dict(tokens=[]), "no tokens"),
                                (dict(tokens=[1] * 262145), "longer than the model's context length of 262144")]:
            with pytest.raises(Exception, match=problem):
                list(c.generate(**params))
    assert run(daemon.addr, "still alive?", max_tokens=4, seed=0)[1].finish_reason in ("length", "stop")


def test_a_constrained_request_follows_its_grammar_and_a_bad_one_is_refused_before_queueing(daemon):
    """Generate.grammar: the coordinator compiles it (after the reasoning when the prompt leaves
    <think> open), the worker masks every token with it; one that does not compile is an Error
    with code invalid_grammar, nothing is queued, and the daemon serves on."""
    import json
    import jsonschema
    from tests.shared.test_grammar import ANSWER
    schema = P.Constraint(kind="json_schema", text=json.dumps(ANSWER))
    text, done = run(daemon.addr, "Reply in JSON:", max_tokens=200, seed=3, grammar=schema)
    assert done.finish_reason == "stop", (text, done)
    jsonschema.validate(json.loads(text), ANSWER)
    digits = P.Constraint(kind="regex", text="[0-9]{3,5}")
    text, done = run(daemon.addr, "Digits:", max_tokens=40, seed=3, temperature=1.5, grammar=digits)
    assert done.finish_reason == "stop" and text.strip().isdigit() and 3 <= len(text.strip()) <= 5, text
    text, done = run(daemon.addr, "Digits:<think>\n", max_tokens=40, seed=3, temperature=1.5, grammar=digits)
    assert not text.strip().isdigit(), text          # the reasoning the prompt opened is free text
    with Client(daemon.addr) as c:
        for bad, word in [(P.Constraint(kind="json_schema", text='{"type": "objekt"}'), "objekt"),
                          (P.Constraint(kind="lark", text="start: <nope>"), "nope")]:
            rid = c.submit("x", max_tokens=4, grammar=bad)
            reply = c._next(rid, 60)
            assert isinstance(reply, P.Error) and reply.code == "invalid_grammar" and word in reply.message, reply
        assert c.status().queued == 0
    assert run(daemon.addr, "still alive?", max_tokens=4, seed=0)[1].finish_reason in ("length", "stop")


def test_fuzz_malformed_messages(daemon):
    """A thousand and more broken messages, each answered with an Error; nobody dies."""
    import random
    rng = random.Random(0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.addr)
    shapes = [
        lambda: rng.randbytes(rng.randint(0, 64)),
        lambda: msgpack.packb(rng.choice([1, "x", None, [1, 2], {"a": 1}, 3.5])),
        lambda: msgpack.packb({"type": rng.choice(["generate", "bogus", 7, None])}),
        lambda: msgpack.packb({"type": "generate", "request_id": rng.choice([1, None, [], "r"]),
                               "max_tokens": rng.choice(["many", -1.5, None])}),
        lambda: msgpack.packb({"type": "generate", "request_id": "r", "prompt": "x", "extra": 1}),
        lambda: msgpack.packb({"type": "cancel"}),
        lambda: b"\xc1" * rng.randint(1, 10),
        lambda: msgpack.packb({"type": "generate", "request_id": "big", "prompt": "x" * (MAX_REQUEST + 1)}),
    ]
    n = 1200
    for _ in range(n):
        sock.send(rng.choice(shapes)())
    sock.send_multipart([b"two", b"frames"])
    errors = 0
    deadline = time.monotonic() + 60
    while errors < n + 1 and time.monotonic() < deadline:
        if sock.poll(1000):
            assert msgpack.unpackb(sock.recv())["type"] == "error"
            errors += 1
    sock.close()
    assert errors == n + 1
    assert daemon.proc.poll() is None
    assert run(daemon.addr, "after the storm", max_tokens=4, seed=0)[1].finish_reason in ("length", "stop")


def test_plain_msgpack_client_speaks_the_protocol(daemon, tiny_q4_path):
    """No fermoe code on the client side: a map per message, maps back. What it leaves
    out takes the documented defaults: temperature 0.8, top-k 40, top-p 0.95, min-p
    0.05, no repeat penalty (max_tokens left out, tested on a short context elsewhere,
    runs to the context's end)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.addr)
    sock.send(msgpack.packb({"type": "generate", "request_id": "plain", "prompt": "hello", "sampling": {"seed": 1},
                             "max_tokens": 128, "ignore_eos": True}))
    replies = []
    while not replies or replies[-1]["type"] != "done":
        assert sock.poll(30000)
        replies.append(msgpack.unpackb(sock.recv()))
    sock.close()
    assert replies[0]["type"] == "started" and {r["type"] for r in replies[1:-1]} == {"token"}
    assert {r["request_id"] for r in replies} == {"plain"}
    started, done, tokens = replies[0], replies[-1], [r["token"] for r in replies[1:-1] if r["token"] >= 0]
    assert set(started) == {"type", "request_id", "prompt_tokens", "cached_prompt_tokens"}
    assert (started["prompt_tokens"], started["cached_prompt_tokens"]) == (done["prompt_tokens"],
                                                                           done["cached_prompt_tokens"])
    assert done["decode_device"] == "cpu"              # no GPU worker: every step on the CPU
    assert set(done) == {"type", "request_id", "finish_reason", "error", "prompt_tokens", "cached_prompt_tokens",
                         "completion_tokens", "prefill_ms", "decode_tok_s", "stop_reason", "prefill_device",
                         "prefill_estimates_ms", "prefill_batch", "reasoning_tokens", "disk_ms", "decode_device"}
    assert done["finish_reason"] == "length" and done["completion_tokens"] == len(tokens) == 128
    assert tokens == local_ids(tiny_q4_path, "hello", 128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                               repeat_penalty=1.0, seed=1)


def test_client_that_vanishes_does_not_leak(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.addr)
    sock.send(P.encode(P.Generate(request_id="ghost", prompt="go on forever", max_tokens=100000,
                                  sampling=SamplingParams(seed=1))))
    assert sock.poll(30000)
    sock.close()
    with Client(daemon.addr) as c:
        wait_until(lambda: c.status().running == 0, 30, "the request of a client that vanished still runs")


def _snapshots_planned(n_tokens: int, start: int) -> int:
    """What a prefill of tokens [start, n_tokens) writes, as the README says: a snapshot at
    each block boundary past start, and one at the prompt's end if that is not one."""
    return n_tokens // BLOCK - start // BLOCK + (n_tokens % BLOCK > 0 and n_tokens > start)


def _snapshots_decoded(n_prompt: int, generated: int) -> int:
    """What decoding `generated` tokens after a prompt writes: a snapshot at each block
    boundary the state passes (it ends one short: the last token is never fed) and one
    where it ends if that is not one."""
    end = n_prompt + generated - 1
    return end // BLOCK - n_prompt // BLOCK + (end % BLOCK > 0)


def test_done_timings_and_snapshot_counters_make_sense(daemon, tiny_q4_path):
    """A cold prompt, the same again (resumed whole: no prefill at all), then extended
    (resumed at the end of the shorter one): Done's counts against what was streamed and
    cached, its timings within what the client waited, and status's snapshot counters
    moved by what each did. Nothing is queued, running or pinned afterwards."""
    encode = Model(tiny_q4_path).tokenizer.encode
    prompt = encode("Timing fields: a prompt new to this daemon's cache, some twenty tokens long.")
    longer = prompt + encode(" Then longer by a few more words.")
    n = 12
    # (prompt, tokens resumed, snapshots written, hits, misses)
    plan = [(prompt, 0, _snapshots_planned(len(prompt), 0) + _snapshots_decoded(len(prompt), n), 0, 1),
            (prompt, len(prompt), 0, 1, 0),           # the same tokens again: every snapshot there already
            (longer, len(prompt), _snapshots_planned(len(longer), len(prompt)) + _snapshots_decoded(len(longer), n),
             1, 0)]
    with Client(daemon.addr, timeout_s=120) as c:
        counters = [c.status().snapshots]
        for tokens, cached, written, hits, misses in plan:
            t0 = time.monotonic()
            msgs = list(c.generate(tokens=tokens, max_tokens=n, seed=1, ignore_eos=True))
            wall = time.monotonic() - t0
            counters.append(c.status().snapshots)
            done, moved = msgs[-1], {k: counters[-1][k] - counters[-2][k] for k in counters[-1]}
            assert (done.prompt_tokens, done.cached_prompt_tokens) == (len(tokens), cached)
            assert done.completion_tokens == len(streamed_ids(msgs)) == n
            if cached == len(tokens):
                assert done.prefill_ms == 0.0                   # a repeated prompt needs no prefill
            else:
                assert 0 < done.prefill_ms <= wall * 1000
            assert done.decode_tok_s >= (n - 1) / wall          # the tokens after the first came within the wait
            assert (moved["hits"], moved["misses"], moved["hit_tokens"]) == (hits, misses, cached)
            assert (moved["entries"] + moved["evictions"], moved["skipped"]) == (written, 0)
        status = c.status()
    assert status.queued == status.running == 0 and [w.running for w in status.workers] == [0]
    assert counters[-1]["pinned"] == counters[-1]["writing"] == 0


def _submit(addr, capsys, *args) -> tuple[str, str]:
    """`fermoe submit` in this process: (stdout without its final newline, stderr)."""
    from fermoe.cli import main
    assert main(["submit", "--addr", addr, "--wait", "30", *map(str, args)]) == 0
    out = capsys.readouterr()
    return out.out[:-1], out.err


def test_submit_chat_and_stop_strings(daemon, tiny_q4_path, capsys):
    """`fermoe submit --chat` sends the prompt as a user message, answered as its chat
    template rendered; `--stop` is repeatable and cuts at whichever shows first."""
    tok = Model(tiny_q4_path).tokenizer
    templated = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    out, err = _submit(daemon.addr, capsys, "--chat", "-p", "Hello", "-n", 12, "--seed", 3)
    assert out == local_text(tiny_q4_path, templated, 12, eos=True, temperature=0.8, seed=3)
    assert out != local_text(tiny_q4_path, "Hello", 12, eos=True, temperature=0.8, seed=3)   # it tells apart
    assert f"prompt {len(tok.encode(templated))} tokens" in err
    args = ("-p", "Stop strings from the command line", "-n", 48, "--seed", 4, "--ignore-eos")
    full, _ = _submit(daemon.addr, capsys, *args)
    early, late, later = (stop_string_at(full, len(full) * k // 8) for k in (2, 4, 6))
    cut, err = _submit(daemon.addr, capsys, *args, "--stop", _escaped(late), "--stop", early.replace("\\", "\\\\"),
                       "--stop", later.replace("\\", "\\\\"))
    assert cut == full[:full.index(early)] and err.startswith(f"stopped: stop string {early!r}; prompt ")
    cut, err = _submit(daemon.addr, capsys, *args, "--stop", _escaped(late), "--no-escape")
    assert cut == full and err.startswith("stopped: 48 tokens (-n); prompt ")     # no "\\x.." in the text


def _escaped(text: str) -> str:
    """text with every ASCII character written as a \\xHH escape, as a user may type it."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 128 else c for c in text)


def test_submit_escapes_its_stop_strings(daemon, tiny_q4_path, capsys):
    """--stop "\\x..": the escapes are read as -p's are (llama.cpp's), so the stop fires."""
    args = ("-p", "Escaped stop strings", "-n", 40, "--seed", 5, "--ignore-eos")
    full, _ = _submit(daemon.addr, capsys, *args)
    stop = stop_string_at(full, len(full) // 2)
    cut, err = _submit(daemon.addr, capsys, *args, "--stop", _escaped(stop))
    assert cut == full[:full.index(stop)] and err.startswith(f"stopped: stop string {stop!r}; ")


def test_submit_passes_each_sampling_option(daemon, tiny_q4_path, capsys):
    """Each sampling option of `fermoe submit`, at a value where it matters, gives what
    the sampler gives locally with it."""
    prompt, n = "Sampling options from the command line", 16
    decode = Model(tiny_q4_path).tokenizer.decode
    cases = option_cases(lambda params: local_ids(tiny_q4_path, prompt, n, **msgspec.structs.asdict(params)))
    for option, (args, ids) in cases.items():
        out, _ = _submit(daemon.addr, capsys, "-p", prompt, "-n", n, "--ignore-eos", *args)
        assert out == decode(ids), option


def test_each_sampling_field_of_a_request_reaches_the_sampler(daemon, tiny_q4_path):
    """Every sampling field of `generate` (penalties included), at a value where it
    matters, gives what the sampler gives locally with it: through coordinator, Assign
    and worker, none dropped or taken for another."""
    prompt, n = "Each sampling field over the wire", 16
    cases = field_cases(lambda params: local_ids(tiny_q4_path, prompt, n, **msgspec.structs.asdict(params)))
    with Client(daemon.addr, timeout_s=120) as c:
        for field, (value, ids) in cases.items():
            params = dict(seed=SEED) if field == "defaults" else {"seed": SEED, field: value}
            assert streamed_ids(list(c.generate(prompt, max_tokens=n, ignore_eos=True, **params))) == ids, field


def test_f32_kv_cache_served_and_resumed_from_snapshots(tiny_q4_path):
    """--kv-cache-dtype f32: the arena's slots hold f32 KV, a repeated prompt resumes
    from them, and both answers are what a local f32 run samples."""
    d = Daemon(tiny_q4_path, "--kv-cache-dtype", "f32")
    try:
        first_text, first = run(d.addr, LONG_PROMPT, max_tokens=12, seed=4)
        again_text, again = run(d.addr, LONG_PROMPT, max_tokens=12, seed=4)
        assert again.cached_prompt_tokens == first.prompt_tokens
        assert first_text == again_text == local(tiny_q4_path, LONG_PROMPT, 12, seed=4, kv="f32")
        assert first_text != local(tiny_q4_path, LONG_PROMPT, 12, seed=4, kv="f16")   # the dtypes tell apart here
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_leaves_nothing_behind(tiny_q4_path, sig):
    """`kill` or Ctrl-C: status 0, every worker process gone, the arena unlinked."""
    d = Daemon(tiny_q4_path)
    pids = [w.pid for w in d.workers]
    assert shm_names(d.proc.pid), "the snapshot arena should exist while running"
    assert d.stop(sig) == 0
    assert not shm_names(d.proc.pid)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert any("stopped" in line for line in d.log[-3:])


def test_worker_started_by_hand_adds_capacity(daemon, tiny_q4_path):
    """cpu_worker --connect: the coordinator tells it where to connect in its log (on
    loopback unless told otherwise); stopped with Ctrl-C it says goodbye."""
    with Client(daemon.addr) as c:
        before = len(c.status().workers)
    assert daemon.worker_endpoint.startswith("tcp://127.0.0.1:")
    extra = subprocess.Popen([sys.executable, "-m", "cpu_worker.worker", "--connect", daemon.worker_endpoint,
                              "--model", str(tiny_q4_path), "--threads", "1", "--worker-id", "by-hand"])
    try:
        with Client(daemon.addr) as c:
            wait_until(lambda: len(c.status().workers) != before, 60, "no worker joined")
            assert any(w.worker_id == "by-hand" for w in c.status().workers)
        rids = []
        with Client(daemon.addr) as c:
            rids = [c.submit(f"load {i}", max_tokens=8, seed=i) for i in range(6)]
            for rid in rids:
                assert list(c.stream(rid))[-1].finish_reason in ("length", "stop")
    finally:
        extra.send_signal(signal.SIGINT)    # Ctrl-C: says goodbye, the daemon forgets it at once
        assert extra.wait(timeout=30) == 0
    with Client(daemon.addr) as c:
        wait_until(lambda: not any(w.worker_id == "by-hand" for w in c.status().workers),
                   10, "the stopped worker is still listed")    # well inside the 60 s heartbeat timeout


@pytest.mark.parametrize("args, problem", [
    (["--model", "/nonexistent.gguf"], "cannot open"),
    (["--model", "tiny", "--block", "0"], "--block 0"),
    (["--model", "tiny", "--snapshot-mem", "lots"], "size 'lots'"),
    (["--model", "tiny", "--bind", "tcp://256.1.1.1:1", "--insecure"], "cannot bind"),   # off loopback: past the keys
    (["--model", "tiny", "--bind", "tcp://0.0.0.0:1"], "--bind tcp://0.0.0.0:1: not a loopback address"),
    (["--model", "tiny", "--kv-cache-dtype", "q4_0"], "--kv-cache-dtype 'q4_0'"),
    (["--model", "tiny", "--threads-per-worker", "4097"], "--threads-per-worker 4097: more than the"),
    (["--model", "tiny", "--cpu-workers-per-socket", "4097"], "--cpu-workers-per-socket 4097: node 0 has"),
])
def test_bad_options_are_refused(args, problem, tmp_path):
    run_ = subprocess.run([sys.executable, "-m", "coordinator.daemon", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "FERMOE_CACHE": str(tmp_path)})
    assert run_.returncode == 1 and problem in run_.stderr and "Traceback" not in run_.stderr


@pytest.mark.parametrize("args, problem", [
    (["--cpus", "0,4096"], "--cpus 0,4096: [4096] not among the CPUs this process may run on"),
    (["--cpus", "one"], "--cpus 'one': expected comma-separated CPU numbers"),
    (["--node", "4096"], "--node 4096: this machine's NUMA nodes are"),
    (["--threads", "4097"], "--threads 4097: more than the"),
])
def test_bad_worker_options_are_refused(tiny_q4_path, args, problem):
    run_ = subprocess.run([sys.executable, "-m", "cpu_worker.worker", "--connect", "tcp://127.0.0.1:9",
                           "--model", str(tiny_q4_path), *args], capture_output=True, text=True, timeout=60)
    assert run_.returncode == 1 and problem in run_.stderr and "Traceback" not in run_.stderr


def test_bench_serve_on_the_tiny_model(tiny_q4_path):
    from bench.serve import run as bench_serve
    out = bench_serve(str(tiny_q4_path), prompt_tokens=40, decode_tokens=4,
                      extra=["--block", str(BLOCK), "--kv-cache-dtype", "f32"])
    assert out["cached_tokens"] == {"cold": 0, "repeated": 40, "extended16": 40}
    # decode at the prompt's context, beside its floor counted with the daemon's KV type (f32 here)
    from bench.decode import bytes_per_token, kv_bytes_per_token
    model = Model(tiny_q4_path)
    at = out["decode_at_prompt"]
    assert at["context"] == 40 and at["tok_s"] > 0 and at["read_bandwidth_gb_s"] > 0
    assert at["kv_mb_per_token"] == round(kv_bytes_per_token(model, 40, "f32") / 1e6, 3) > 0
    per_token = bytes_per_token(model) + kv_bytes_per_token(model, 40, "f32")
    assert at["floor_tok_s"] == pytest.approx(at["read_bandwidth_gb_s"] * 1e9 / per_token, rel=0.01)
    assert set(out["aggregate_decode_tok_s"]) == {1, 2, 4} and min(out["aggregate_decode_tok_s"].values()) > 0
    assert out["decode_device"] == ["cpu"]
    during = out["decode_during_prefill"]
    assert during["arriving_prompts"] == len(during["arriving_ttft_s"]) == 2
    assert out["cold_burst"]["prefill_batch"] == [0] * 4 and out["cold_burst"]["prefill_device"] == ["cpu"] * 4
    # tokens read in a burst are microseconds apart: the median, rounded to 10 us, may be 0
    assert 0 <= during["running_median_gap_s"] <= during["running_max_gap_s"] and during["running_max_gap_s"] > 0
    import bench.serve
    assert_keys_documented(out, bench.serve)
