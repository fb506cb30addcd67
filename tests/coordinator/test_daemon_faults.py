"""The daemon's fault handling (and what needs no worker process), in this process: a real Coordinator (coordinator/daemon.py)
runs its event loop in a thread; its workers are DEALER sockets of the test that say
(or leave unsaid) what each case needs, or real worker processes. The timeouts are
patched short: what is tested is what the daemon does when they run out, not their
length. A fake worker's numbers (tokens, timings) are its own, so the client's side of
each case is known exactly."""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import zmq

import coordinator.daemon as daemon
import coordinator.supervisor as supervisor
from coordinator.client import Client
from coordinator.options import parse_options
from shared import protocol as P
from tests.support.serving_harness import free_port, local_ids, wait_until

TIMEOUT_S = 1.0           # the patched heartbeat timeout: long enough that a beating worker beats within it
BEAT_S = 0.1              # how often the test's live fake workers beat
HEARD_S = 10.0            # for the daemon to handle what a worker sent (a busy machine is slow)


class FakeSupervisor:
    """No processes: records which workers the daemon asked to restart."""
    plan: dict = {}
    all_given_up = False
    asleep = False

    def __init__(self):
        self.restarted = []

    def start_all(self):
        pass

    def reap(self):
        return []

    def restart(self, wid):
        self.restarted.append(wid)

    def stop_all(self):
        pass


@contextmanager
def running_coordinator(model_path, *extra, fake_supervisor=True, worker_model=None):
    """The daemon for model_path; its real workers (fake_supervisor False) are started
    on worker_model if given (the path each start reads). coord.heard: the [worker id,
    message] frames it has handled, in order (what a test waits on)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    coord = daemon.Coordinator(parse_options(["--model", str(model_path), "--bind", addr, "--threads-per-worker",
                                              "1", "--snapshot-mem", "0", *extra]))
    coord.addr = addr
    if fake_supervisor:
        coord.supervisor = FakeSupervisor()
    if worker_model is not None:
        coord.opts.model_path = worker_model
    coord.heard, handle = [], coord.handle_worker_frames

    def recording(frames):
        handle(frames)
        coord.heard.append(frames[:2])
    coord.handle_worker_frames = recording
    loop = threading.Thread(target=coord.event_loop, daemon=True)
    loop.start()
    try:
        yield coord
    finally:
        coord.stopping = True
        loop.join(10)
        coord.shutdown()


class FakeWorker:
    """A worker as the daemon sees one: a DEALER socket that joins (Hello, Attached) and
    beats every BEAT_S until told to go silent. Its own thread owns the socket, so it
    beats however slowly the test runs; the test sends and receives through queues."""

    def __init__(self, coord, wid, kind="cpu"):
        self.coord, self.wid, self.beating, self.running = coord, wid, True, True
        self.outbox, self.inbox = queue.Queue(), queue.Queue()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, wid.encode())
        self.sock.connect(coord.worker_endpoint)
        self.send(P.Hello(worker_id=wid, pid=os.getpid(), threads=1, fingerprint=coord.model.fingerprint, kind=kind))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.welcome = self.recv()
        assert isinstance(self.welcome, P.Welcome)
        self.send(P.Attached(arena=False))

    def _run(self):
        last_beat = 0.0
        while self.running:
            while not self.outbox.empty():
                self.sock.send(P.encode(self.outbox.get()))
            if self.beating and time.monotonic() - last_beat >= BEAT_S:
                self.sock.send(P.encode(P.Heartbeat(running=0)))
                last_beat = time.monotonic()
            if self.sock.poll(10):
                self.inbox.put(P.decode(self.sock.recv_multipart()[0], P.TO_WORKER))
        self.sock.close()

    def send(self, msg):
        self.outbox.put(msg)

    def send_heard(self, *msgs):
        """Send msgs; return once the coordinator has handled the last of them."""
        mark = len(self.coord.heard)
        for msg in msgs:
            self.send(msg)
        last = [self.wid.encode(), P.encode(msgs[-1])]
        wait_until(lambda: last in self.coord.heard[mark:], HEARD_S, f"{self.wid}'s {type(msgs[-1]).__name__} handled")

    def go_silent(self):
        """No heartbeat from now on (messages the test sends still go out)."""
        self.beating = False

    def recv(self, timeout_s=10.0):
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.wid}: nothing from the coordinator within {timeout_s} s") from None

    def close(self):
        self.running = False
        self.thread.join(10)


def _listed(client):
    return {w.worker_id for w in client.status().workers}


def test_a_silent_worker_is_dropped_after_the_heartbeat_timeout_and_its_request_replayed(tiny_q4_path, monkeypatch,
                                                                                          caplog):
    """A worker that stops talking (hung, its host gone) counts as dead once WORKER_TIMEOUT_S
    pass without a message, not before; a worker that beats stays however long it idles.
    The silent one's request is replayed on the other with the same seed and tokens, and
    the client gets each token once: the replay's re-sampled ones are not sent again, and
    what the dropped one says late is ignored."""
    monkeypatch.setattr(daemon, "WORKER_TIMEOUT_S", TIMEOUT_S)
    caplog.set_level(logging.INFO, logger="fermoe.coordinator")
    with running_coordinator(tiny_q4_path) as coord, Client(coord.addr, timeout_s=30) as client:
        silent, beating = FakeWorker(coord, "a-silent"), FakeWorker(coord, "b-beating")
        try:
            wait_until(lambda: sum(w.alive for w in client.status().workers) == 2, HEARD_S, "both workers alive")
            rid = client.submit("The old GPU said", max_tokens=5, seed=11, ignore_eos=True)
            first = silent.recv()                  # idle workers are picked by id: a-silent
            assert isinstance(first, P.Assign) and first.request_id == rid
            silent.go_silent()
            went_silent = time.monotonic()         # before its last messages: the daemon hears them later
            for token in (40, 41, 42):
                silent.send(P.Sampled(request_id=rid, token=token))
            stream = client.stream(rid)
            assert [next(stream).token for _ in range(3)] == [40, 41, 42]
            replay = beating.recv(timeout_s=TIMEOUT_S + 10)
            waited = time.monotonic() - went_silent
            assert isinstance(replay, P.Assign) and replay.request_id == rid
            assert (replay.tokens, replay.sampling, replay.max_tokens) == (first.tokens, first.sampling, first.max_tokens)
            assert waited >= TIMEOUT_S, f"dropped after {waited:.2f} s of silence"
            assert coord.supervisor.restarted == ["a-silent"]
            assert _listed(client) == {"b-beating"}          # idle far longer than the timeout, but beating
            # what the dropped worker still says is ignored: no token, no end for its request
            # heard before the replay's tokens, as when it was only slow
            silent.send_heard(P.Sampled(request_id=rid, token=99),
                              P.Finished(request_id=rid, finish_reason="error", prefill_ms=0.0, decode_ms=0.0,
                                         completion_tokens=4, error="late"),
                              P.Attached(arena=False))
            for token in (40, 41, 42, 43, 44):       # the replay samples the same tokens again, then new ones
                beating.send(P.Sampled(request_id=rid, token=token, prefill_ms=5.0 if token == 40 else None))
            beating.send(P.Finished(request_id=rid, finish_reason="length", prefill_ms=5.0, decode_ms=10.0,
                                    completion_tokens=5))
            rest = list(stream)
        finally:
            silent.close()
            beating.close()
    assert [m.token for m in rest[:-1] if m.token >= 0] == [43, 44]
    done = rest[-1]
    assert (done.finish_reason, done.completion_tokens, done.cached_prompt_tokens) == ("length", 5, 0)
    # the timings are those of the attempt that finished: the prefill its first token reported (not
    # its Finished's), and its tokens as they came (the test sent them at once: fast)
    assert done.prefill_ms == 5.0 and done.decode_tok_s > 0
    assert done.prompt_tokens == len(first.tokens)
    assert any("worker a-silent died" in r.getMessage() for r in caplog.records)


def test_a_late_reply_for_a_cancelled_request_is_not_taken_for_its_successor(tiny_q4_path):
    """A request cancelled on one worker and sent again under the same id runs on
    another; what the first worker still sends for the old one (it had not seen the
    Stop yet) reaches neither the client nor the new request."""
    with running_coordinator(tiny_q4_path) as coord, Client(coord.addr, timeout_s=30) as client:
        first, second = FakeWorker(coord, "a-first"), FakeWorker(coord, "b-second")
        try:
            wait_until(lambda: sum(w.alive for w in client.status().workers) == 2, HEARD_S, "both workers alive")
            client.submit("The old GPU said", request_id="r", max_tokens=5, seed=1)
            assert first.recv().request_id == "r"
            client.cancel("r")
            assert list(client.stream("r"))[-1].finish_reason == "cancelled"
            assert isinstance(first.recv(), P.Stop)
            client.submit("Keeps a-first busy", request_id="other", max_tokens=5, seed=1)
            assert first.recv().request_id == "other"
            client.submit("The old GPU said", request_id="r", max_tokens=2, seed=1)
            assert second.recv().request_id == "r"
            # sent before it read the Stop; heard before the new run's replies
            first.send_heard(P.Sampled(request_id="r", token=99),
                             P.Finished(request_id="r", finish_reason="cancelled", prefill_ms=0.0, decode_ms=0.0,
                                        completion_tokens=1))
            for token in (40, 41):
                second.send(P.Sampled(request_id="r", token=token))
            second.send(P.Finished(request_id="r", finish_reason="length", prefill_ms=1.0, decode_ms=1.0,
                                   completion_tokens=2))
            msgs = list(client.stream("r"))
        finally:
            first.close()
            second.close()
    assert [m.token for m in msgs[:-1] if m.token >= 0] == [40, 41]
    assert (msgs[-1].finish_reason, msgs[-1].completion_tokens) == ("length", 2)


def test_a_request_whose_workers_keep_dying_fails_after_max_attempts(tiny_q4_path):
    """Each worker that takes the request leaves mid-way; after MAX_ATTEMPTS of them the
    request ends with an error naming the cause, and a worker joining later gets nothing."""
    with running_coordinator(tiny_q4_path) as coord, Client(coord.addr, timeout_s=30) as client:
        rid = client.submit("The old GPU said", max_tokens=5, seed=2)
        for attempt in range(1, daemon.MAX_ATTEMPTS + 1):
            worker = FakeWorker(coord, f"w{attempt}")
            msg = worker.recv()
            assert isinstance(msg, P.Assign) and msg.request_id == rid, attempt
            worker.send(P.Goodbye())             # heard before the socket closes (it lingers 0 s)
            wait_until(lambda: worker.wid not in coord.workers, HEARD_S, f"{worker.wid} gone")
            worker.close()
        done = list(client.stream(rid))[-1]
        assert done.finish_reason == "error"
        assert done.error == f"worker w{daemon.MAX_ATTEMPTS} died {daemon.MAX_ATTEMPTS} times running this request"
        late = FakeWorker(coord, "late")
        with pytest.raises(AssertionError, match="nothing from the coordinator"):
            late.recv(timeout_s=0.5)
        assert client.status().queued == client.status().running == 0
        late.close()


def test_a_worker_back_under_its_id_gets_its_old_requests_again(tiny_q4_path):
    """Fault guarded: a worker process that comes back under the same id before the
    heartbeat timeout (restarted by hand or by its host: `cpu_worker --worker-id`) replaced
    the old one's view, and the request the old process ran stayed the daemon's, on a
    worker that never heard of it: nothing ended it, and its client waited for ever. The
    new process's Hello drops the old one first: the request is replayed, here on it, and
    streams each token once."""
    with running_coordinator(tiny_q4_path) as coord, Client(coord.addr, timeout_s=30) as client:
        old = FakeWorker(coord, "w")
        rid = client.submit("The old GPU said", max_tokens=3, seed=5, ignore_eos=True)
        first = old.recv()
        assert isinstance(first, P.Assign) and first.request_id == rid
        old.send_heard(P.Sampled(request_id=rid, token=40))
        old.close()                              # gone without a Goodbye
        time.sleep(0.5)                          # the daemon's socket lets the id go with the connection
        new = FakeWorker(coord, "w")
        try:
            replay = new.recv()
            assert isinstance(replay, P.Assign) and replay.request_id == rid
            assert (replay.tokens, replay.sampling, replay.max_tokens) == (first.tokens, first.sampling, 3)
            for token in (40, 41, 42):               # the replay samples the sent token again, then new ones
                new.send(P.Sampled(request_id=rid, token=token))
            new.send(P.Finished(request_id=rid, finish_reason="length", prefill_ms=1.0, decode_ms=1.0,
                                completion_tokens=3))
            msgs = list(client.stream(rid))
        finally:
            new.close()
    assert [m.token for m in msgs[:-1] if m.token >= 0] == [40, 41, 42]
    assert (msgs[-1].finish_reason, msgs[-1].completion_tokens) == ("length", 3)


def test_requests_are_refused_at_once_when_every_worker_was_given_up(tiny_q4_path, tmp_path, monkeypatch, caplog):
    """Real worker processes that cannot start (their model is gone): the supervisor
    restarts each MAX_RESTARTS times, then gives up; the queued request, and any that
    come after, are refused with code "unavailable" and the reason, the status says it,
    and the log says it once."""
    monkeypatch.setattr(supervisor, "MAX_RESTARTS", 1)           # two starts: the count is not what is tested
    caplog.set_level(logging.INFO, logger="fermoe.coordinator")
    gone = str(tmp_path / "moved-away.gguf")
    with running_coordinator(tiny_q4_path, fake_supervisor=False, worker_model=gone) as coord, \
            Client(coord.addr, timeout_s=20) as c:
        first = c.submit("queued while the workers fail", max_tokens=4)
        refusals = [c._next(first, 20)]
        started = time.monotonic()
        refusals += [c._next(c.submit("sent after the give-up", max_tokens=4), 20) for _ in range(3)]
        assert time.monotonic() - started < 5          # at once, not after a client's timeout
        status = c.status()
        assert not status.workers and status.queued == 0 and status.unavailable == daemon.NO_DECODER
    for refusal in refusals:
        assert isinstance(refusal, P.Error) and (refusal.code, refusal.message) == ("unavailable", daemon.NO_DECODER)
    messages = [r.getMessage() for r in caplog.records]
    n_workers = len(supervisor.worker_plan(coord.opts))
    assert sum(m.startswith("started worker") for m in messages) == n_workers * (supervisor.MAX_RESTARTS + 1)
    assert sum("not restarting it" in m for m in messages) == n_workers
    assert sum(m.startswith(daemon.NO_DECODER) for m in messages) == 1


def test_the_front_end_answers_503_with_the_reason_when_no_worker_is_left(tiny_q4_path, tmp_path, monkeypatch):
    import httpx
    monkeypatch.setattr(supervisor, "MAX_RESTARTS", 0)
    url = f"http://127.0.0.1:{free_port()}"
    with running_coordinator(tiny_q4_path, "--http", url.removeprefix("http://"), fake_supervisor=False,
                             worker_model=str(tmp_path / "gone.gguf")):
        def health():
            try:
                return httpx.get(f"{url}/health", timeout=5)
            except httpx.HTTPError:
                return None                             # the front end is still starting
        answer = wait_until(lambda: (r := health()) is not None and "given up" in r.text and r, 60,
                            "/health saying why")
        assert answer.status_code == 503 and answer.json()["error"]["message"] == daemon.NO_DECODER
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert time.monotonic() - started < 5
        assert r.status_code == 503 and r.json()["error"]["message"] == daemon.NO_DECODER, r.text


def test_a_gpu_worker_alone_does_not_keep_requests_waiting(tiny_q4_path):
    """Fault guarded: with every CPU worker given up, a GPU worker still listed kept the
    daemon from seeing that nothing could decode, and requests waited for the client's
    timeout while /health said ok. A CPU worker that joins by hand serves again."""
    with running_coordinator(tiny_q4_path) as coord, Client(coord.addr, timeout_s=20) as c:
        coord.supervisor.plan, coord.supervisor.all_given_up = {"cpu-0": None}, True
        gpu = FakeWorker(coord, "gpu-0", kind="gpu")
        wait_until(lambda: "gpu-0" in coord.workers and coord.unavailable, HEARD_S, "the GPU worker joined")
        refusal = c._next(c.submit("nobody decodes this", max_tokens=4), 10)
        assert isinstance(refusal, P.Error) and refusal.code == "unavailable", refusal
        cpu = FakeWorker(coord, "by-hand")
        wait_until(lambda: "by-hand" in coord.workers and not coord.unavailable, HEARD_S, "the CPU worker joined")
        gpu.close(), cpu.close()


def test_a_hung_worker_process_is_killed_replaced_and_its_request_resumed(tiny_q4_path, monkeypatch):
    """A real worker stopped with SIGSTOP (hung: alive, silent) is declared dead after the
    heartbeat timeout, killed and restarted; its request resumes on the new process from
    its prompt's snapshot and streams what one uninterrupted run samples."""
    monkeypatch.setattr(daemon, "WORKER_TIMEOUT_S", 3.0)      # 3x the worker's 1 s heartbeat: a busy one keeps it
    params = dict(max_tokens=100_000, temperature=0.8, seed=4, ignore_eos=True)   # minutes: never ends by itself
    prompt = "A worker that hangs in the middle of a long generation"
    with running_coordinator(tiny_q4_path, "--snapshot-mem", "32MiB", "--block", "8",
                             fake_supervisor=False) as coord, Client(coord.addr, timeout_s=60) as c:
        old = c.wait_ready(60).workers[0].pid
        before = c.status().snapshots
        rid = c.submit(prompt, **params)
        stream = c.stream(rid)
        tokens = [next(stream).token]
        os.kill(old, signal.SIGSTOP)
        while True:
            tokens.append(next(stream).token)
            if len(tokens) >= 16 and any(w.pid != old and w.running == 1 for w in c.status().workers):
                break
        for _ in range(16):
            tokens.append(next(stream).token)
        c.cancel(rid)
        rest = list(stream)
        tokens += [m.token for m in rest[:-1] if m.token >= 0]
        done = rest[-1]
        after = c.status().snapshots
        with pytest.raises(ProcessLookupError):      # killed, not left hanging
            os.kill(old, 0)
    # the replay resumed from the snapshots the first attempt wrote: the client's prompt was not cached,
    # and the replay's lookup is no cache hit
    assert done.finish_reason == "cancelled" and done.cached_prompt_tokens == 0
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (0, 1)
    assert after["replays"] - before["replays"] == 1 and after["replay_hit_tokens"] > before["replay_hit_tokens"]
    assert done.prefill_ms == 0.0 and done.decode_tok_s > 0       # the replay's: resumed at the prompt's end
    assert tokens == local_ids(tiny_q4_path, prompt, len(tokens), temperature=params["temperature"],
                               seed=params["seed"])


def _serve_one(client, worker, prompt):
    """A request the fake worker answers with one token: its Assign."""
    rid = client.submit(prompt, max_tokens=1, seed=1)
    assign = worker.recv()
    worker.send(P.Sampled(request_id=rid, token=40))
    worker.send(P.Finished(request_id=rid, finish_reason="length", prefill_ms=1.0, decode_ms=0.0,
                           completion_tokens=1))
    assert list(client.stream(rid))[-1].cached_prompt_tokens == 0
    return assign


@pytest.mark.parametrize("snapshot_mem", ["0", "1MiB"])
def test_snapshot_mem_0_means_no_cache(tiny_q4_path, snapshot_mem):
    """--snapshot-mem 0: no arena, and no request is told to resume or to write a
    snapshot; with a budget, a prompt of several blocks plans its snapshots."""
    prompt = "A prompt that spans a few blocks of eight tokens, or more than that."
    with running_coordinator(tiny_q4_path, "--snapshot-mem", snapshot_mem, "--block", "8") as coord, \
            Client(coord.addr, timeout_s=30) as client:
        worker = FakeWorker(coord, "w")
        try:
            assigns = [_serve_one(client, worker, prompt) for _ in range(2)]
        finally:
            worker.close()
    n_blocks = len(coord.tokenizer.encode(prompt)) // 8
    if snapshot_mem == "0":
        assert (worker.welcome.arena, worker.welcome.n_slots) == ("", 0)
        assert all(a.resume == [] and a.snapshots == [] for a in assigns)
    else:
        assert worker.welcome.n_slots > 0 and len(assigns[0].snapshots) >= n_blocks > 1


def test_the_daemon_binds_to_loopback_by_default(tiny_q4_path):
    """Clients on 127.0.0.1:5557, workers on a free loopback port, unless told otherwise."""
    opts = parse_options(["--model", str(tiny_q4_path)])
    assert (opts.bind, opts.worker_bind) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:*")
    from fermoe.cli import build_parser
    from coordinator.client import DEFAULT_ADDR
    assert build_parser().parse_args(["submit", "-p", "x"]).addr == DEFAULT_ADDR == opts.bind


def test_the_snapshot_store_defaults_to_a_share_of_this_host(tiny_q4_path, monkeypatch, caplog):
    """Without --snapshot-mem the arena takes an eighth of the host's memory (at most half
    of /dev/shm's free space, at most 8 GiB), and the log says how much and why."""
    import coordinator.memory as memory
    monkeypatch.setenv("FERMOE_HOST_MEMORY", str(1 << 30))
    monkeypatch.setattr(memory, "shm_free_bytes", lambda: 64 << 30)
    assert memory.default_snapshot_mem()[0] == 128 << 20                 # an eighth of 1 GiB
    monkeypatch.setattr(memory, "shm_free_bytes", lambda: 100 << 20)
    assert memory.default_snapshot_mem()[0] == 50 << 20                  # half of a small /dev/shm
    monkeypatch.setenv("FERMOE_HOST_MEMORY", str(1 << 40))
    monkeypatch.setattr(memory, "shm_free_bytes", lambda: 1 << 40)
    assert memory.default_snapshot_mem()[0] == 8 << 30                   # the cap
    monkeypatch.setenv("FERMOE_HOST_MEMORY", str(1 << 30))
    caplog.set_level(logging.INFO, logger="fermoe.coordinator")
    opts = parse_options(["--model", str(tiny_q4_path), "--bind", f"tcp://127.0.0.1:{free_port()}",
                          "--max-model-len", "256"])           # a 1 GiB host fits no full context
    assert opts.snapshot_mem == 128 << 20
    coord = daemon.Coordinator(opts)
    try:
        kv, state = coord.arena.slot_bytes, coord.arena.state_slot_bytes
        n_states = coord.arena.n_state_slots          # a quarter of the budget, at least 4
        assert n_states == max(4, round((32 << 20) / state)) and coord.index.n_state_slots == n_states
        assert coord.arena.n_slots == coord.index.n_slots == ((128 << 20) - n_states * state) // kv
        n_kv = coord.arena.n_slots
    finally:
        coord.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("snapshot store:")]
    assert f"{n_kv} KV slots" in line and f"{n_states} state slots" in line, line
    assert "(default: 1/8 of this host's 1.0 GiB" in line, line


def test_the_snapshot_states_option_splits_the_budget(tiny_q4_path):
    """--snapshot-states N: N state slots, the rest of --snapshot-mem KV slots; more states
    than fit beside one KV slot, or none, is a clear error."""
    from coordinator.memory import snapshot_pools
    from shared.errors import FermoeError
    assert snapshot_pools(100_000, 10, 100) == (7500, 250)    # a quarter of the budget
    assert snapshot_pools(1000, 10, 100) == (60, 4)           # at least 4
    assert snapshot_pools(350, 10, 100) == (5, 3)             # at most what leaves room for a KV slot
    assert snapshot_pools(4000, 10, 100, states=30) == (100, 30)
    assert snapshot_pools(100, 10, 100) == (0, 0)             # not one of each: no store
    with pytest.raises(FermoeError, match="--snapshot-states 40: 40 states .* do not fit"):
        snapshot_pools(4000, 10, 100, states=40)
    with pytest.raises(FermoeError, match="--snapshot-states 0"):
        snapshot_pools(4000, 10, 100, states=0)
    opts = parse_options(["--model", str(tiny_q4_path), "--bind", f"tcp://127.0.0.1:{free_port()}",
                          "--snapshot-mem", "8MiB", "--snapshot-states", "5", "--max-model-len", "256"])
    coord = daemon.Coordinator(opts)
    try:
        assert (coord.arena.n_state_slots, coord.index.stats()["state_slots"]) == (5, 5)
        assert coord.arena.n_slots == ((8 << 20) - 5 * coord.arena.state_slot_bytes) // coord.arena.slot_bytes
    finally:
        coord.shutdown()
    opts.snapshot_states = 1000
    with pytest.raises(FermoeError, match="--snapshot-states 1000"):
        daemon.Coordinator(opts)
