"""One client request from arrival to Done: what the coordinator keeps about it, the
snapshots its workers write for it (SnapshotIntake), and the text side of streaming
(detokenising, stop strings). No sockets here."""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from shared import protocol as P
from shared.sampling import SamplingParams
from shared.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("fermoe.coordinator")


class Phase(enum.Enum):
    """Where a request stands, so that a fault knows what to redo (gpu_prefill.py draws
    the GPU's part)."""
    DECODING = "decoding"            # its images being decoded off the loop (coordinator/images.py), not queued yet
    QUEUED = "queued"                # waiting for a worker (new, or to be replayed)
    PREFILLING = "prefilling"        # its prompt on a GPU worker
    HANDED_OFF = "handed_off"        # prefilled on a GPU worker, waiting for a CPU worker to resume it
    RUNNING = "running"              # on a CPU worker: prefilling there if need be, then decoding


@dataclass
class Request:
    client: bytes                    # ZeroMQ identity of the client
    msg: P.Generate
    tokens: list[int]
    sampling: SamplingParams         # the client's, its seed fixed at arrival so a replay after a worker death samples the same
    stream: "TextStream"
    grammar: str | None = None       # the compiled constraint (Assign.grammar), None: unconstrained
    arrived: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.QUEUED
    worker: str | None = None        # the worker it is on (PREFILLING, RUNNING)
    resume: object = None            # pinned SnapshotIndex lookup, released when the request ends
    planned: list = field(default_factory=list)    # snapshot slots being written for it
    cached_tokens: int = 0           # reused from before the request started (its first lookup)
    started: bool = False            # its client was told the prompt's size (P.Started)
    progress: int = 0                # the prompt's tokens its client was told are processed (P.Progress)
    disk_checked: bool = False       # the disk tier was asked for its prompt (once)
    disk_ms: float = 0.0             # loading its prefix from the disk tier took this long
    sent: int = 0                    # tokens streamed to the client
    thinking: bool = False           # a chat whose output is inside a <think> block (its prompt's, or its own)
    reasoning_tokens: int = 0        # tokens streamed inside <think> blocks, the tags included
    generated: list = field(default_factory=list)  # every token sampled for it, end-of-generation ones too
    marks: list = field(default_factory=list)      # prompt positions where chat turns begin: snapshots there too
    decode_slots: list = field(default_factory=list)   # (KV, state) pairs reserved for its worker's decode snapshots
    skip: int = 0                    # tokens a replaying worker will re-sample before new ones
    attempts: int = 0
    # Timings of the current attempt, kept here so that every finish reason (a stop string
    # or a cancel ends a request before its worker reports) has them.
    dispatched: float | None = None  # sent to a worker
    first_dispatch: float | None = None   # sent to a GPU worker first, if it was
    prefill_ms: float | None = None  # the worker's, with its first token
    first_token: float | None = None
    last_token: float | None = None
    sampled: int = 0                 # tokens the worker sampled (replayed and end-of-generation ones too)
    # Prefill on a GPU worker: where it ran and on what estimates, the GPU's time, and the
    # snapshot lookup a CPU worker decodes from afterwards (pinned from the hand-off on).
    prefill_device: str | None = None
    decode_device: str | None = None    # hybrid: its worker ran decode steps with a GPU worker
    estimates: dict = field(default_factory=dict)
    gpu_prefill_ms: float | None = None
    gpu_tokens: int = 0              # the tokens sent to the GPU worker to prefill
    prefill_batch: int = 0           # the prompts of its batch there
    handoff: object = None
    gpu_failed: bool = False         # a GPU worker failed it: the prompt runs on a CPU worker
    # A chat's images (Assign.images) and the prompt as the snapshot index keys it: each image's
    # tokens replaced by values drawn from its pixels' hash (shared/vision/chat.py); None: tokens.
    images: list = field(default_factory=list)
    key: list | None = None
    chat: object = None              # while DECODING: its ChatPlan (shared/vision/chat.py), the images still bytes

    @property
    def cache_tokens(self) -> list[int]:
        """The prompt as the snapshot index sees it (two images never share a key past their start)."""
        return self.tokens if self.key is None else self.key

    @property
    def rid(self) -> str:
        return self.msg.request_id

    def release(self, index) -> None:
        """Give back the snapshot entries it holds: the pinned lookups and the planned
        slots not written."""
        for lookup in (self.resume, self.handoff):
            if lookup is not None:
                index.release(lookup)
        self.resume = self.handoff = None
        for planned in self.planned:
            index.abort(planned)
        self.planned = []
        index.unreserve(self.decode_slots)
        self.decode_slots = []

    def timings(self, now: float) -> tuple[float, float]:
        """(prefill_ms, decode_tok_s) of the current attempt: the worker's prefill time (the
        time since dispatch while no token came yet), then the rate of the tokens after the
        first one as they arrived here (0 with fewer than two)."""
        gpu = self.gpu_prefill_ms or 0.0            # a GPU worker's part, before the CPU worker's
        if self.dispatched is None:
            return gpu, 0.0
        if self.first_token is None:
            return gpu + 1000 * (now - self.dispatched), 0.0
        span = self.last_token - self.first_token
        return gpu + self.prefill_ms, (self.sampled - 1) / span if span > 0 else 0.0


def resume_refs(resume, arena, attached: bool) -> tuple[list[P.SnapshotRef], list[bytes]]:
    """A lookup's snapshots as a worker is told them: the KV slot of each, the state slot
    of the last; and for a worker without the arena (`attached` false) their bytes as
    frames, copied (the slots may be reused later): the KV slots in order, then the state."""
    if resume is None:
        return [], []
    entries = resume.entries
    refs = [P.SnapshotRef(slot=e.slot, state=resume.state if i == len(entries) - 1 else -1, position=e.position)
            for i, e in enumerate(entries)]
    data = [] if attached else [bytes(arena.slot(e.slot)) for e in entries] + [bytes(arena.state_slot(resume.state))]
    return refs, data


def planned_refs(planned) -> list[P.SnapshotRef]:
    """The snapshots a worker is to write: (KV slot, state slot, position) of each."""
    return [P.SnapshotRef(slot=p.slot, state=p.state, position=p.position) for p in planned]


class Unfinished:
    """Snapshot slots a worker may still be writing for requests that ended before it said
    it stopped (a cancel, a stop string, a client gone: the worker learns it from a Stop
    only after its current pass, and a GPU worker after its prefill's current layer).
    They are reused only once its Finished or Prefilled for the request comes, or the
    worker is lost; freed at once, another request's snapshot could land in a slot this
    worker then overwrites."""

    def __init__(self, index):
        self.index = index
        self.held: dict[str, tuple[str, list, list]] = {}   # request id -> (worker, planned, decode slots)

    def hold(self, req: Request) -> None:
        if req.planned or req.decode_slots:
            self.held[req.rid] = (req.worker, req.planned, req.decode_slots)
            req.planned, req.decode_slots = [], []

    def stopped(self, rid: str, wid: str) -> None:
        """The worker says it is done with the request: its slots are free."""
        if self.held.get(rid, (None,))[0] == wid:
            _, planned, decode_slots = self.held.pop(rid)
            self.index.abort(planned)
            self.index.unreserve(decode_slots)

    def worker_lost(self, wid: str) -> None:
        for rid in [r for r, (w, _, _) in self.held.items() if w == wid]:
            self.stopped(rid, wid)


class SnapshotIntake:
    """The snapshots a worker reports written (SnapshotWritten) into the index: a planned
    one committed, a decode one adopted; from a worker without the arena, its bytes,
    which come as the message's frames, copied into the slots first. `send(wid, msg)`
    reaches a worker (the decode pairs that replace an adopted one)."""

    def __init__(self, index, arena, block: int, send):
        self.index, self.arena, self.block, self.send = index, arena, block, send

    def written(self, req: Request, wid: str, msg: P.SnapshotWritten, data: list, attached: bool) -> None:
        """Worker `wid`, which runs `req`, wrote a snapshot of it; `attached`: it has the arena."""
        if (msg.slot, msg.state) in req.decode_slots:
            self._adopt_decode_snapshot(wid, req, msg, data, attached)
            return
        for planned in list(req.planned):
            if (planned.slot, planned.state) != (msg.slot, msg.state):
                continue
            if not self._slots_from(wid, msg.slot, msg.state, data, attached):
                return
            self.index.commit(planned)
            req.planned.remove(planned)

    def _adopt_decode_snapshot(self, wid: str, req: Request, msg: P.SnapshotWritten, data: list,
                               attached: bool) -> None:
        """A snapshot taken while decoding, at msg.position: cached under the tokens the
        sequence holds there (every one of them came in a Sampled before this); a block
        boundary's pair is replaced, for the next one."""
        pair = (msg.slot, msg.state)
        req.decode_slots.remove(pair)
        tokens = list(req.cache_tokens) + req.generated
        if not len(req.tokens) < msg.position <= len(tokens) or not self._slots_from(wid, *pair, data, attached):
            log.error("worker %s: decode snapshot at %d of request %s does not match its %d tokens",
                      wid, msg.position, req.rid, len(tokens))
            self.index.unreserve([pair])
            return
        self.index.adopt(pair, tokens[:msg.position])
        if msg.position % self.block == 0:
            more = self.index.reserve(1, end=False)        # it holds the end's pair still
            if more:
                req.decode_slots += more
                self.send(wid, P.DecodeSlots(request_id=req.rid, slots=more))

    def _slots_from(self, wid: str, slot: int, state: int, data: list, attached: bool) -> bool:
        """A snapshot from a worker without the arena comes as frames: its KV slot's bytes
        (if it has one), then its state slot's (if it has one)."""
        if attached:
            return True
        sizes = [n for n, i in ((self.arena.slot_bytes, slot), (self.arena.state_slot_bytes, state)) if i >= 0]
        if [len(d) for d in data] != sizes:
            log.error("worker %s sent snapshot (KV slot %d, state slot %d) as frames of %s bytes, expected %s",
                      wid, slot, state, [len(d) for d in data], sizes)
            return False
        if slot >= 0:
            self.arena.slot(slot)[:] = data[0]
        if state >= 0:
            self.arena.state_slot(state)[:] = data[-1]
        return True


class TextStream:
    """Token ids -> text pieces, holding back what could still become a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.stopped = False
        self.stopped_by: str | None = None          # the stop string that ended the text

    def feed(self, token: int) -> str:
        """The text that can be shown now; sets `stopped` when a stop string appeared."""
        self.pending += self.decoder.feed(token)
        # the first place any stop string starts (one token's text may hold several)
        found = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if found:
            cut, self.stopped_by = min(found, key=lambda f: f[0])
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        keep = min(self.hold, len(self.pending))
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        out = "" if self.stopped else self.pending + self.decoder.flush()
        self.pending = ""
        return out
