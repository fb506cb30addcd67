"""A worker's side of the worker protocol, whatever the worker runs (CPU decode, GPU
prefill): everything but the work itself.

    worker --Hello--> coordinator --Welcome--> worker --Attached--> (ready)
    ... Heartbeat every HEARTBEAT_S while alive ... Goodbye when it leaves

The Welcome names the coordinator's snapshot arena (shared memory): KV slots (a
block's K and V) and state slots (a recurrent state). A worker that can map it reads
and writes snapshot slots in place; one that cannot (on another host, or told not to)
gets an Assign's resume snapshots as raw frames after it (the KV slots, then the state
slot) and sends each snapshot it writes as raw frames after its SnapshotWritten. Both
paths live here, so a worker only ever asks for "the slots to resume from" and "write
this state into those slots".
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from . import protocol as P
from .curve import client_keys
from .parent import die_with_parent
from .errors import FermoeError, ProtocolError
from .state import SequenceState, kv_dtype, write_snapshot, write_snapshot_kv

log = logging.getLogger("fermoe.worker_link")
HEARTBEAT_S = 1.0
WELCOME_WAIT_S = 30.0       # a coordinator answers a Hello at once; this long without one, say so


class WorkerLink:
    """One DEALER socket to the coordinator's worker endpoint, named `worker_id`.

    configure(kv_cache_dtype) is called on a Welcome before the worker says it is
    ready: the snapshot slots hold KV of that type, so the worker's engine must too."""

    def __init__(self, connect: str, worker_id: str, configure: Callable[[str], None],
                 shared_memory: bool = True, curve_key: str | None = None):
        """curve_key: the worker's NAME.key_secret, for a coordinator that requires CURVE keys."""
        self.worker_id, self.configure, self.shared_memory = worker_id, configure, shared_memory
        self.connect, self.curve_key = connect, curve_key
        keys = client_keys(curve_key)
        self.arena = None                      # the SnapshotArena, once attached
        self._prefault = None                  # its pages being mapped while the worker idles
        self.block: int | None = None          # from the Welcome: positions a slot's KV covers
        self.slot_bytes: int | None = None     # of a KV slot
        self.state_slot_bytes: int | None = None
        self.max_model_len = 0                 # from the Welcome: the positions the host's memory is planned for
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        if keys is not None:
            keys.apply(self.sock)
        self.sock.connect(connect)
        self._last_beat = 0.0
        self._hello_at: float | None = None    # until the Welcome: a refused handshake is silent
        self._lock = threading.Lock()          # the socket is used by keepalive()'s thread too
        self._early: deque = deque()           # messages keepalive() received, to be served next

    # ---- sending --------------------------------------------------------------
    def send(self, msg, *frames: bytes, block: bool = True) -> bool:
        """Send msg (and its data frames). block=False: only if ZeroMQ can queue it now (False
        if not): a socket whose coordinator is gone, or has never answered, blocks a send
        once its queue is full, and a heartbeat or a goodbye must never wait on that."""
        with self._lock:
            try:
                self.sock.send_multipart([P.encode(msg), *frames], 0 if block else zmq.NOBLOCK)
                return True
            except zmq.Again:
                return False

    def hello(self, pid: int, threads: int, fingerprint: str, **about) -> None:
        """The first message; `about`: the worker's kind, device and rates (see Hello)."""
        self.send(P.Hello(worker_id=self.worker_id, pid=pid, threads=threads, fingerprint=fingerprint, **about))
        self._hello_at = time.monotonic()

    def beat(self, running: int) -> None:
        """A Heartbeat, if HEARTBEAT_S has passed since the last one."""
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self.send(P.Heartbeat(running=running), block=False)    # none taken: the coordinator is not reading
            self._last_beat = now

    def report(self, problem: str) -> None:
        """An Error the coordinator logs (a message it sent that we cannot take)."""
        self.send(P.Error(message=f"worker {self.worker_id}: {problem}"))

    # ---- receiving ------------------------------------------------------------
    def serve(self, handlers: dict, timeout_ms: int) -> bool:
        """Wait up to timeout_ms for a message and hand it with its data frames to the
        handler of its type; False if none came. A Welcome is handled here; a message that
        cannot be decoded, or that this kind of worker does not take, is reported to the
        coordinator and dropped."""
        if self._early:
            frames = self._early.popleft()
        else:
            with self._lock:
                if not self.sock.poll(timeout_ms):
                    self._still_unwelcome()
                    return False
                frames = self.sock.recv_multipart()
        try:
            msg = P.decode(frames[0], P.TO_WORKER)
            if len(frames) > 1 and not isinstance(msg, (P.Assign, P.Prefill)):
                raise ProtocolError(f"{type(msg).__name__} came with {len(frames) - 1} data frames")
        except ProtocolError as e:
            self.report(str(e))
            return True
        if type(msg) not in handlers and not isinstance(msg, P.Welcome):
            self.report(f"this worker does not take {type(msg).__name__} messages")
            return True
        if isinstance(msg, P.Welcome):
            self._hello_at = None
        try:
            self._welcome(msg) if isinstance(msg, P.Welcome) else handlers[type(msg)](msg, frames[1:])
        except Exception as e:             # a bug met by one message must not end the worker
            log.exception("handling a %s failed", type(msg).__name__)
            self.report(f"handling a {type(msg).__name__} failed: {type(e).__name__}: {e}")
        return True

    def _still_unwelcome(self) -> None:
        """One line when the coordinator has not answered the Hello within WELCOME_WAIT_S:
        ZeroMQ reports neither a coordinator that is not there nor one that refused our keys."""
        if self._hello_at is not None and time.monotonic() - self._hello_at > WELCOME_WAIT_S:
            self._hello_at = None
            keys = (f"that it takes this worker's key ({self.curve_key}: its public key in the coordinator's "
                    f"keys directory, workers/)" if self.curve_key else
                    "that it does not require CURVE keys (if it does, give this worker --curve-key FILE)")
            log.warning("no answer from the coordinator at %s within %.0f s of saying hello: check that it runs "
                        "there, and %s; still waiting", self.connect, WELCOME_WAIT_S, keys)

    def waiting(self, kind: type, accept: Callable[[object], bool]) -> list[tuple[object, list[bytes]]]:
        """The messages of type `kind` that have already arrived, with their data frames, in
        order while accept(msg) says yes; they leave the queue, every other message stays
        in it for serve() (a GPU worker batches the prompts waiting behind the one it got)."""
        with self._lock:
            while self.sock.poll(0):
                self._early.append(self.sock.recv_multipart())
            taken, kept, taking = [], deque(), True
            for frames in self._early:
                if taking:
                    try:
                        msg = P.decode(frames[0], P.TO_WORKER)
                    except ProtocolError:
                        msg = None                  # serve() reports it
                    if isinstance(msg, kind):
                        if accept(msg):
                            taken.append((msg, frames[1:]))
                            continue
                        taking = False
                kept.append(frames)
            self._early = kept
        return taken

    @contextlib.contextmanager
    def keepalive(self, running: int, urgent: Callable[[object], None] | None = None):
        """While the worker is busy with one long step (a GPU prefill): a thread sends the
        heartbeats and receives the messages that arrive, which serve() hands out after;
        urgent(msg) sees each of them at once (a Stop of the running job, say)."""
        done = threading.Event()

        def run():
            while not done.wait(0.05):
                with self._lock:
                    while self.sock.poll(0):
                        frames = self.sock.recv_multipart()
                        self._early.append(frames)
                        if urgent is not None:
                            try:
                                urgent(P.decode(frames[0], P.TO_WORKER))
                            except ProtocolError:
                                pass            # serve() reports it
                            except Exception:   # a bug: the message is still served (or reported) by serve()
                                log.exception("looking ahead at a message failed")
                self.beat(running)

        thread = threading.Thread(target=run, name="keepalive", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _welcome(self, msg: P.Welcome) -> None:
        from .shm_arena import SnapshotArena
        try:
            kv_dtype(msg.kv_cache_dtype)
        except FermoeError as e:
            self.report(str(e))
            return
        self.block, self.max_model_len = msg.block, msg.max_model_len     # before configure: it may read them
        self.configure(msg.kv_cache_dtype)
        self.slot_bytes, self.state_slot_bytes = msg.slot_bytes, msg.state_slot_bytes
        if self.arena is None and msg.n_slots and self.shared_memory:
            try:
                self.arena = SnapshotArena.attach(msg.arena, msg.slot_bytes, msg.n_slots, msg.state_slot_bytes,
                                                  msg.n_state_slots)
                self._prefault = self.arena.prefault()
            except FermoeError as e:        # another host: no shared memory with the coordinator
                log.warning("no snapshot arena here (%s): snapshots travel as message frames", e)
        self.send(P.Attached(arena=self.arena is not None))

    @property
    def prefaulting(self) -> bool:
        """Pages of the arena are still to be mapped into this process (prefault_step)."""
        return self._prefault is not None

    def prefault_step(self) -> None:
        """One step of mapping the arena's pages into this process (SnapshotArena.prefault),
        for an idle worker."""
        if self._prefault is not None and not next(self._prefault, False):
            self._prefault = None               # all mapped

    # ---- snapshots ------------------------------------------------------------
    def resume_slots(self, msg: P.Assign | P.Prefill, data: list[bytes]) -> tuple[list, object]:
        """The bytes of an Assign's or a Prefill's resume snapshot: (its chain's KV slots in
        order, the last one's state slot), arena slots or the frames that came with it;
        ([], None) when it starts empty."""
        if (msg.resume or msg.snapshots) and self.block is None:
            raise FermoeError("snapshots assigned before the coordinator's Welcome")
        if not msg.resume:
            if data:
                raise FermoeError(f"{len(data)} data frames came with a message that resumes from no snapshot")
            return [], None
        if any(r.slot < 0 for r in msg.resume) or msg.resume[-1].state < 0:
            raise FermoeError("a resume needs the KV slot of each snapshot and the state slot of the last")
        if self.arena is None:
            if len(data) != len(msg.resume) + 1:
                raise FermoeError(f"{len(msg.resume)} snapshots to resume from take {len(msg.resume) + 1} frames "
                                  f"(their KV, the last one's state), {len(data)} came with the message")
            return list(data[:-1]), data[-1]
        return [self.arena.slot(r.slot) for r in msg.resume], self.arena.state_slot(msg.resume[-1].state)

    def snapshot_buffers(self, slot: int, state: int) -> tuple:
        """Where a snapshot for KV slot `slot` and state slot `state` is to be written (None
        for -1): the arena's slots, or without the arena buffers of their sizes that
        snapshot_written() sends."""
        if self.arena is not None:
            return (self.arena.slot(slot) if slot >= 0 else None,
                    self.arena.state_slot(state) if state >= 0 else None)
        return (bytearray(self.slot_bytes) if slot >= 0 else None,
                bytearray(self.state_slot_bytes) if state >= 0 else None)

    def snapshot_written(self, request_id: str, slot: int, state: int, buffers, position: int = -1) -> None:
        """SnapshotWritten for buffers from snapshot_buffers(slot, state), now holding the
        snapshot (at `position`, for a decode pair); without the arena they ride as frames
        after it."""
        written = P.SnapshotWritten(request_id=request_id, slot=slot, state=state, position=position)
        if self.arena is not None:
            self.send(written)
        else:
            self.send(written, *(b for b in buffers if b is not None))

    def write_snapshot(self, request_id: str, slot: int, state: int, seq_state: SequenceState, position: int,
                       buffers=None) -> None:
        """The snapshot at `position` (at most seq_state's own; only there with a state slot)
        into its slots, then sent: its block's KV into KV slot `slot`, the recurrent part
        into state slot `state` (-1: not written). buffers: from snapshot_buffers(), their
        state part landed already (a GPU prefill's): only the KV is written."""
        if buffers is None:
            buffers = self.snapshot_buffers(slot, state)
            write_snapshot(seq_state, *buffers, self.block, position)
        elif buffers[0] is not None:
            write_snapshot_kv(seq_state, buffers[0], self.block, position)
        self.snapshot_written(request_id, slot, state, buffers, position)

    def close(self) -> None:
        try:                # delivered within the socket's linger, if the coordinator takes it now
            self.send(P.Goodbye(), block=False)
        except zmq.ZMQError:
            pass
        self.sock.close()
        if self.arena is not None:
            self.arena.close()


# ---- the worker processes' command line -------------------------------------------
def add_worker_options(p) -> None:
    """The options every worker process takes (argparse)."""
    p.add_argument("--connect", required=True, help="the coordinator's worker endpoint, e.g. tcp://127.0.0.1:5558")
    p.add_argument("--model", required=True, help="GGUF path or built-in model name (the coordinator's model)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--no-shared-memory", action="store_true",
                   help="do not map the coordinator's snapshot arena, as a worker on another host cannot: "
                        "snapshots then travel as message frames")
    p.add_argument("--curve-key", default=None, metavar="FILE",
                   help="this worker's key file (a workers/NAME.key_secret of `fermoe keys`), for a coordinator "
                        "started with --curve-keys: it holds the worker's key pair and the coordinator's public key")
    p.add_argument("--shared-experts", default=None, metavar="NAME",
                   help="read the routed experts from this shared-memory segment, which the coordinator packs "
                        "when it runs a GPU worker (one copy in RAM for all workers), not from the model file")


def attach_experts(name: str | None, model):
    """The coordinator's ExpertSegment named on the command line, or None."""
    if not name:
        return None
    from .expert_segment import ExpertSegment
    return ExpertSegment.attach(name, model)


def serve_until_stopped(worker) -> int:
    """The worker's loop until a Shutdown, Ctrl-C or SIGTERM; it says goodbye either way."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)      # `kill` ends it as Ctrl-C does
    try:
        worker.event_loop()
    finally:
        worker.close()
    return 0


def worker_main(prog: str, parser, run, argv=None) -> int:
    """Parse, log as `prog`, run(args); an error we can name is one line, never a traceback."""
    args = parser.parse_args(argv)
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prog} %(levelname)s %(message)s")
    try:
        client_keys(args.curve_key)             # a bad key file: one error now, not after loading the model
        return run(args)
    except FermoeError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
