"""What the serving tests share: a coordinator daemon in a subprocess, a CPU worker in
a thread of the test (so a test sees what it ran), the local runs a served request
must equal, and the `fermoe` command run as a user runs it."""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import zmq

from coordinator.client import Client
from shared.topology import allowed_cpus
from cpu_worker.worker import CPUWorker
from shared import protocol as P
from shared.errors import FermoeError
from fermoe.engines import load_engine
from shared.generate import generate
from shared.model import Model
from shared.sampling import SamplingParams

BLOCK = 8                    # small blocks: short prompts cross several snapshot boundaries
CLI_TIMEOUT_S = 300          # the slowest command a test runs (a benchmark, a conversion) on 2 busy cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout_s: float, what: str):
    """Poll condition() until it is true; its value. Fails naming `what` after timeout_s
    (a loaded machine is slow, but nothing a test waits for may hang it forever)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return value


def replies_within(client, rid: str, within_s: float, waiting_for, log=None, stuck=None) -> list:
    """Request rid's replies up to its Done, each within within_s of the one before: a
    request a fault leaves waiting for ever (on a dead worker, or sent back again and again
    to one that fails it) fails the test after within_s, not after the client's long
    timeout, with `waiting_for` (a string, or a function of nothing giving one) saying
    what the test waited for and so what the hang means, and the daemon's `log` (its
    lines) if given. stuck(): checked every second while no reply comes, a reason to
    fail at once (the wait is known to be hopeless), or None."""
    out, timeout = [], client.timeout_s
    deadline = time.monotonic() + within_s
    client.timeout_s = 1.0
    try:
        while True:
            try:
                for msg in client.stream(rid):
                    out.append(msg)
                    deadline = time.monotonic() + within_s
                return out
            except FermoeError as e:
                if "no answer from the coordinator" not in str(e):
                    raise
            why = stuck() if stuck is not None else None
            if why is None and time.monotonic() < deadline:
                continue
            if why is None:
                why = waiting_for() if callable(waiting_for) else waiting_for
                why = f"nothing more from it within {within_s:.0f} s: {why}"
            tail = f"; the daemon's log ends:\n{''.join(log[-30:])}" if log is not None else ""
            raise AssertionError(f"request {rid}, after {len(out)} replies: {why}{tail}")
    finally:
        client.timeout_s = timeout


def requests_lost(client, for_s: float = 3.0):
    """A stuck() for replies_within: the daemon counts more requests running than its
    workers hold, for for_s on end (a request left on a worker that is gone or was
    replaced, which nothing will ever end)."""
    since = None

    def check():
        nonlocal since
        status = client.status()
        held = sum(w.running for w in status.workers)
        if status.running <= held:
            since = None
            return None
        since = since or time.monotonic()
        if time.monotonic() - since < for_s:
            return None
        return (f"the daemon counts {status.running} request(s) running, its workers hold {held}: a request is "
                f"left on a worker that is gone ({[(w.worker_id, w.pid, w.running) for w in status.workers]})")
    return check


def shm_names(pid: int | None = None) -> set[str]:
    """Our arenas in /dev/shm; with pid, only those that process created (other
    agents' daemons may come and go meanwhile)."""
    prefix = "fermoe" if pid is None else f"fermoe-{pid}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def unpinned():
    """preexec_fn giving a child the CPUs this process started with: a NativeEngine made
    in a test pins the thread that made it (often pytest's main thread) to its first
    CPU, and a child would inherit that (a daemon would then see one core)."""
    os.sched_setaffinity(0, allowed_cpus())


class Daemon:
    """`coordinator` in a subprocess on a free port; its log (and its workers', which
    share its stderr) collected in `log`."""

    def __init__(self, model, *extra, block: int = BLOCK, curve_key=None):
        """curve_key: the client key file to wait for it with (a daemon with --curve-keys)."""
        self.addr, self.curve_key = f"tcp://127.0.0.1:{free_port()}", curve_key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.daemon", "--model", str(model), "--bind", self.addr,
             "--snapshot-mem", "32MiB", "--block", str(block), "--threads-per-worker", "1", *extra],
            stderr=subprocess.PIPE, text=True, preexec_fn=unpinned)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        with Client(self.addr, curve_key=curve_key) as c:
            try:
                self.workers = c.wait_ready(120, alive=lambda: self.proc.poll() is None).workers
            except Exception as e:
                raise AssertionError(f"{e}; its log:\n{''.join(self.log)}") from None

    @property
    def worker_endpoint(self) -> str:
        """Where workers connect, from the daemon's "ready:" line (which the daemon may log
        just after a status reply has said it is ready, and which the reader thread may not
        have collected yet: wait for it)."""
        line = wait_until(lambda: next((l for l in self.log if "workers on " in l), None), 30,
                          "the daemon's ready line")
        return line.split("workers on ")[1].strip()

    def stop(self, sig=signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


def run(addr, prompt=None, **params):
    """One request: (its streamed text, its Done)."""
    with Client(addr, timeout_s=120) as c:
        msgs = list(c.generate(prompt, **params))
    return "".join(m.text for m in msgs[:-1]), msgs[-1]


def streamed_ids(msgs) -> list[int]:
    """The token ids of a request's replies (the -1 of a final text-only piece left out)."""
    return [m.token for m in msgs if hasattr(m, "token") and m.token >= 0]


def fermoe(*args, env: dict | None = None, check: bool = True, timeout_s: float = CLI_TIMEOUT_S):
    """`fermoe ARGS` in a child process on the CPUs this one started with; env: changes to
    this environment (a None value removes the variable). Its stdout and stderr are the
    bytes decoded, newlines untranslated (a "\r" the model generates stays one). With
    check, a failure is an AssertionError showing its stderr."""
    environ = None if env is None else {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    run = subprocess.run([sys.executable, "-m", "fermoe.cli", *map(str, args)], capture_output=True,
                         env=environ, timeout=timeout_s, preexec_fn=unpinned)
    run.stdout, run.stderr = run.stdout.decode(), run.stderr.decode()
    if check and run.returncode != 0:
        raise AssertionError(f"fermoe {' '.join(map(str, args))} exited with {run.returncode}:\n{run.stderr}")
    return run


def local(model, prompt, n, seed, temp=0.8, kv="f16"):
    """`fermoe generate --engine cpu` as a user runs it: its text."""
    return fermoe("generate", model, "--engine", "cpu", "-t", 1, "-p", prompt, "-n", n, "--seed", seed,
                  "--temp", temp, "--kv-cache-dtype", kv).stdout[:-1]     # generate ends with a newline


@functools.lru_cache(maxsize=4)
def _model(model_path: str) -> Model:
    return Model(model_path)


def local_ids(model_path, prompt_or_ids, n, eos=False, engine="cpu", **sampling) -> list[int]:
    """The token ids `fermoe generate` samples, in this process: all n (as ignore_eos), or
    with eos=True up to an end-of-generation token, which is left out (never streamed).
    The engine is closed at once: a live NativeEngine keeps the thread that made it
    pinned to one CPU, and so everything that thread starts later (torch's threads too)."""
    model = _model(str(model_path))
    ids = model.tokenizer.encode(prompt_or_ids) if isinstance(prompt_or_ids, str) else list(prompt_or_ids)
    stop = model.tokenizer.eos_ids if eos else ()
    eng = load_engine(engine, model, threads=1)
    try:
        return [t for t in generate(eng, ids, n, SamplingParams(**sampling), stop_ids=stop) if t not in stop]
    finally:
        eng.close()


def local_text(model_path, prompt_or_ids, n, eos=False, engine="cpu", **sampling) -> str:
    return _model(str(model_path)).tokenizer.decode(local_ids(model_path, prompt_or_ids, n, eos, engine, **sampling))


class ThreadWorker:
    """A CPUWorker connected to a daemon from a thread of this process, recording each
    prompt chunk it runs ((request id, position it starts at, tokens)), each request it
    decodes for, and each Assign with the number of data frames it came with. Like the
    process, it says goodbye when its loop ends, however it ends (`crash` says why)."""

    def __init__(self, endpoint, model_path, worker_id, **kwargs):
        self.worker = CPUWorker(str(model_path), endpoint, worker_id, threads=1, **kwargs)
        self.prefills, self.decoded, self.assigns, self.crash = [], set(), [], None
        run_pass, handle_assign = self.worker.run_pass, self.worker.handle_assign

        def recording_pass(batch):
            for rid, seq, tokens in batch:
                if seq.decoder is None:
                    self.prefills.append((rid, seq.state.position, len(tokens)))
                else:
                    self.decoded.add(rid)
            run_pass(batch)

        def recording_assign(msg, data=()):
            self.assigns.append((msg, len(data)))
            handle_assign(msg, data)
        self.worker.run_pass, self.worker.handle_assign = recording_pass, recording_assign
        self.worker.handlers[P.Assign] = recording_assign
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.worker.event_loop()
        except BaseException as e:          # a crash of the process it stands for
            self.crash = e
        finally:
            self.worker.close()

    def prefilled(self, rid) -> list[tuple[int, int]]:
        return [(pos, n) for r, pos, n in self.prefills if r == rid]

    def stop(self) -> None:
        self.worker.running = False
        self.thread.join(30)


def stop_string_at(text: str, start: int, length: int = 3) -> str:
    """A printable piece of text first found at or after `start` (a stop string that
    cuts the text exactly there)."""
    for i in range(start, len(text) - length + 1):
        piece = text[i:i + length]
        if piece.isprintable() and text.find(piece) == i:
            return piece
    raise AssertionError(f"no piece of {text!r} first found after {start}")


class OrderedClient:
    """One client socket, its replies read strictly in the order the coordinator sent
    them (a Client would sort them by request)."""

    def __init__(self, addr):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.replies = []

    def send(self, msg):
        self.sock.send(P.encode(msg))

    def until(self, done, timeout_s=60.0):
        """Read replies until done(reply); that reply. Fails after timeout_s in all (other
        requests' tokens may keep coming meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000)), "not the awaited reply within the time"
            msg = P.decode(self.sock.recv(), P.CLIENT_REPLIES)
            self.replies.append(msg)
            if done(msg):
                return msg

    def status(self) -> P.StatusReply:
        self.send(P.Status())
        return self.until(lambda m: isinstance(m, P.StatusReply))

    def ids(self) -> list[int]:
        return streamed_ids(r for r in self.replies if isinstance(r, P.Token))

    def close(self):
        self.sock.close()
