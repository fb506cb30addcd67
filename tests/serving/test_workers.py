"""Workers that die, leave, join by hand without the shared arena, or talk nonsense,
each against a daemon of its own (real processes, the tiny model). A takeover is
followed on one client socket read in arrival order, so a test knows which tokens
the coordinator sent after the replacement took the request."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import zmq

from coordinator.client import Client
from shared import protocol as P
from shared.sampling import SamplingParams
from shared.model import Model
from tests.support.serving_harness import BLOCK, Daemon, OrderedClient, ThreadWorker, local_ids, run, streamed_ids, wait_until

LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the old GPU hums along, " * 2
# Tokens to generate that no test waits for (minutes at the tiny model's ~0.3 ms a
# token): a generation that long is still running whenever its worker is stopped.
ENDLESS = 100_000
AFTER = 32                   # tokens read after a takeover before the test cancels


def follow_takeover(addr, prompt, seed, interrupt, takes_over):
    """Start an ENDLESS generation; once it streams, check its worker runs it and call
    interrupt(that worker); read on until a status shows a worker for which
    takes_over(worker) running it, then AFTER tokens more, and cancel. Returns (every
    token id streamed, how many came before the kill, how many before the takeover
    was seen, the Done, the snapshot counters before and after)."""
    c = OrderedClient(addr)
    try:
        before = c.status().snapshots
        c.send(P.Generate(request_id="long", prompt=prompt, max_tokens=ENDLESS,
                          sampling=SamplingParams(seed=seed, temperature=0.8), ignore_eos=True))
        c.until(lambda m: isinstance(m, P.Token))
        running = [w for w in c.status().workers if w.running]
        assert len(running) == 1, running                 # generating when interrupted
        interrupt(running[0])
        at_kill = len(c.ids())
        wait_until(lambda: any(takes_over(w) and w.alive and w.running == 1 for w in c.status().workers),
                   30, "no worker took the request over")              # well inside the 60 s heartbeat timeout
        at_takeover = len(c.ids())      # every later token was sent after the takeover
        c.until(lambda m: len(c.ids()) >= at_takeover + AFTER)
        c.send(P.Cancel(request_id="long"))
        done = c.until(lambda m: isinstance(m, P.Done))
        return c.ids(), at_kill, at_takeover, done, before, c.status().snapshots
    finally:
        c.close()


def _assert_resumed_from_the_prompt_snapshot(model_path, ids, at_kill, done, before, after, prompt, seed):
    n_prompt = len(Model(model_path).tokenizer.encode(prompt))
    assert at_kill >= 1 and len(ids) - at_kill >= AFTER
    assert done.finish_reason == "cancelled" and done.prompt_tokens == n_prompt
    # the cache was empty: the first run missed, the replay resumed at the prompt's end from the
    # snapshot that run wrote, which is no cache hit for the client: none of its prompt was cached
    assert done.cached_prompt_tokens == 0
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (1, 0)
    assert after["hit_tokens"] == before["hit_tokens"]
    assert (after["replays"] - before["replays"], after["replay_hit_tokens"] - before["replay_hit_tokens"]) == \
        (1, n_prompt)
    # the stream went on where it was: what one run samples, no token twice or missing
    assert ids == local_ids(model_path, prompt, len(ids), temperature=0.8, seed=seed)


def test_worker_killed_mid_generation_is_replaced(tiny_q4_path):
    """kill -9 of the daemon's worker while it generates: a new worker process takes
    the request over from the prompt's snapshot and the stream goes on."""
    d = Daemon(tiny_q4_path)
    try:
        old = d.workers[0].pid
        ids, at_kill, at_takeover, done, before, after = follow_takeover(
            d.addr, LONG_PROMPT, 5, lambda w: os.kill(w.pid, signal.SIGKILL), lambda w: w.pid != old)
        _assert_resumed_from_the_prompt_snapshot(tiny_q4_path, ids, at_kill, done, before, after, LONG_PROMPT, 5)
        with pytest.raises(ProcessLookupError):
            os.kill(old, 0)
        assert any("worker cpu0.0 exited with status -9" in line for line in d.log)
    finally:
        assert d.stop() == 0


def test_a_worker_stopped_mid_generation_hands_its_request_on(tiny_q4_path):
    """A hand-started worker stopped with SIGTERM while it generates says goodbye: its
    request goes to the daemon's own worker at once (not after the heartbeat timeout),
    resumes there from the prompt's snapshot, and the stream goes on."""
    daemon, extra = Daemon(tiny_q4_path), None
    try:
        extra = subprocess.Popen([sys.executable, "-m", "cpu_worker.worker", "--connect", daemon.worker_endpoint,
                                  "--model", str(tiny_q4_path), "--threads", "1", "--worker-id", "a-by-hand"])
        with Client(daemon.addr) as c:
            wait_until(lambda: any(w.worker_id == "a-by-hand" and w.alive for w in c.status().workers),
                       60, "the worker never became ready")

        def stop(worker):               # idle workers are picked by id: a-by-hand runs it
            assert worker.worker_id == "a-by-hand"
            extra.terminate()
        ids, at_kill, at_takeover, done, before, after = follow_takeover(
            daemon.addr, LONG_PROMPT, 6, stop, lambda w: w.worker_id == "cpu0.0")
        _assert_resumed_from_the_prompt_snapshot(tiny_q4_path, ids, at_kill, done, before, after, LONG_PROMPT, 6)
        assert extra.wait(timeout=30) == 0
        assert any("worker a-by-hand left" in line for line in daemon.log)
        assert not any("worker a-by-hand died" in line for line in daemon.log)   # not the heartbeat timeout
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
        assert daemon.stop() == 0


def test_a_worker_without_the_arena_gets_snapshots_as_frames(tiny_q4_path):
    """A worker without the shared arena (cpu_worker --no-shared-memory, as on another
    host), here in a thread of the test so that what it runs is seen: it serves requests
    itself, resumes from the snapshots that come as frames after its Assign (a repeated
    prompt with no prefill at all, an extended one prefilling only its new tokens), and
    sends back the ones it writes, which the daemon's own worker then resumes from
    without a prefill once it is gone. It is alive and listed until then. Idle workers
    are picked by id: "a-remote" before the daemon's "cpu0.0"."""
    daemon, remote = Daemon(tiny_q4_path), None
    encode = Model(tiny_q4_path).tokenizer.encode
    cached = encode("A prompt long enough to cross a few snapshot blocks of eight tokens.")
    try:
        expected, first = run(daemon.addr, tokens=cached, max_tokens=8, seed=9)     # cpu0.0, alone: cached now
        remote = ThreadWorker(daemon.worker_endpoint, tiny_q4_path, "a-remote", shared_memory=False)
        with Client(daemon.addr, timeout_s=60) as c:
            wait_until(lambda: any(w.worker_id == "a-remote" and w.alive for w in c.status().workers),
                       60, "the worker never became ready")

            def on_remote(tokens, seed):
                msgs = list(c.generate(tokens=tokens, max_tokens=8, seed=seed))
                rid = msgs[-1].request_id
                assert [m.request_id for m, _ in remote.assigns][-1] == rid and rid in remote.decoded
                assert streamed_ids(msgs) == local_ids(tiny_q4_path, tokens, 8, eos=True, temperature=0.8, seed=seed)
                return msgs, remote.prefilled(rid)

            msgs, prefilled = on_remote(cached, 9)                    # repeated: resumed from frames
            assert "".join(m.text for m in msgs[:-1]) == expected
            assert (msgs[-1].cached_prompt_tokens, msgs[-1].prefill_ms, prefilled) == (len(cached), 0.0, [])
            assign, frames = remote.assigns[-1]
            # the KV of its blocks and of its end, then the end's state
            assert frames == len(assign.resume) + 1 == len(cached) // BLOCK + (len(cached) % BLOCK > 0) + 1

            longer = cached + encode(" And then some more words to extend it.")
            msgs, prefilled = on_remote(longer, 3)                    # extended: only the new tokens run
            assert msgs[-1].cached_prompt_tokens == len(cached)
            assert prefilled[0][0] == len(cached) and sum(n for _, n in prefilled) == len(longer) - len(cached)

            fresh = encode("Another prompt, new to the cache, that remote prefills and snapshots.")
            msgs, prefilled = on_remote(fresh, 2)                     # cold: remote writes the snapshots
            assert msgs[-1].cached_prompt_tokens == 0 and sum(n for _, n in prefilled) == len(fresh)
            listed = [w for w in c.status().workers if w.worker_id == "a-remote"]
            assert remote.crash is None and remote.thread.is_alive()
            assert [(w.alive, w.pid) for w in listed] == [(True, os.getpid())]
            remote.stop()                                             # goodbye: cpu0.0 is left
            wait_until(lambda: [w.worker_id for w in c.status().workers] == ["cpu0.0"], 10, "a-remote is still listed")
        again_text, again = run(daemon.addr, tokens=fresh, max_tokens=8, seed=2)
        assert (again.cached_prompt_tokens, again.prefill_ms) == (len(fresh), 0.0)
        assert again_text == "".join(m.text for m in msgs[:-1])
        assert any("a-remote has no access to the snapshot arena" in line for line in daemon.log)
    finally:
        if remote is not None:
            remote.stop()
        assert daemon.stop() == 0


def test_broken_worker_frames_are_logged_and_the_daemon_serves_on(tiny_q4_path):
    """On the worker endpoint: a snapshot of the wrong size for a request the sender
    does not run, garbage, data frames on a message that takes none. (A daemon of its
    own: the rogue stays registered until its heartbeats time out.)"""
    d = Daemon(tiny_q4_path)
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"rogue")
        sock.connect(d.worker_endpoint)
        fingerprint = Model(tiny_q4_path).fingerprint
        sock.send(P.encode(P.Hello(worker_id="rogue", pid=1, threads=1, fingerprint=fingerprint)))
        sock.send(P.encode(P.Attached(arena=False)))
        sock.send_multipart([P.encode(P.SnapshotWritten(request_id="nobody", slot=0, state=0)), b"short"])
        sock.send(b"\x00\xc1garbage")
        sock.send_multipart([P.encode(P.Heartbeat(running=0)), b"unexpected data"])
        wait_until(lambda: any("rogue sent a bad message: Heartbeat came with 1 data frames" in line for line in d.log),
                   30, "the last message handled")            # before the socket closes (it lingers 0 s)
        sock.close()
        assert d.proc.poll() is None
        assert run(d.addr, "after the rogue", max_tokens=4, seed=0)[1].finish_reason in ("length", "stop")
        assert any("rogue sent a bad message" in line for line in d.log)
    finally:
        assert d.stop() == 0
