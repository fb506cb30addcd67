"""One client request from arrival to Done: what the coordinator keeps about it,
and the text side of streaming (detokenising, stop strings). No sockets here."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared import protocol as P
from shared.tokenizer import StreamDecoder, Tokenizer


@dataclass
class Request:
    client: bytes                    # ZeroMQ identity of the client
    msg: P.Generate
    tokens: list[int]
    seed: int                        # fixed at arrival so a replay after a worker death samples the same
    stream: "TextStream"
    arrived: float = field(default_factory=time.monotonic)
    worker: str | None = None
    resume: object = None            # pinned SnapshotIndex lookup, released when the request ends
    planned: list = field(default_factory=list)    # snapshot slots being written for it
    cached_tokens: int = 0
    sent: int = 0                    # tokens streamed to the client
    skip: int = 0                    # tokens a replaying worker will re-sample before new ones
    attempts: int = 0
    prefill_ms: float = 0.0

    @property
    def rid(self) -> str:
        return self.msg.request_id


class TextStream:
    """Token ids -> text pieces, holding back what could still become a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, token: int) -> str:
        """The text that can be shown now; sets `stopped` when a stop string appeared."""
        self.pending += self.decoder.feed(token)
        # the first place any stop string starts (one token's text may hold several)
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
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
