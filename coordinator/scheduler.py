"""Scheduling policy, pure: which worker takes the next queued request.

First come, first served; a request goes to the live, welcomed worker running
the fewest sequences, while it has fewer than `max_sequences`. Workers interleave
their sequences token by token, so a busy worker still serves every one."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerView:
    worker_id: str
    alive: bool = True
    ready: bool = False
    threads: int = 1
    pid: int = 0
    arena: bool = False          # mapped the snapshot arena; else snapshots go to it and back as frames
    requests: set = field(default_factory=set)
    kind: str = "cpu"            # cpu: prefills and decodes; gpu: prefills only
    device: str = ""
    prefill_tok_s: float = 0.0   # measured at start, then a running average of what it served
    prefill_fixed_ms: float = 0.0  # a prompt's cost beyond its tokens (measured at start)
    decode_tok_s: float = 0.0
    vision_tok_s: float = 0.0    # image tokens its tower encodes a second, a running average; 0: none yet
    mailbox: str = ""            # a cpu worker's hybrid-decode mailbox ("": none)
    hybrid_with: str = ""        # the gpu worker serving that mailbox ("": none yet)


def hybrid_pairs(workers: dict[str, WorkerView]) -> list[tuple[str, str]]:
    """(cpu worker, gpu worker) for each ready CPU worker with an unserved mailbox: the ready
    GPU worker serving the fewest mailboxes takes it, so that several GPUs share the decode."""
    gpus = sorted(w.worker_id for w in workers.values() if w.kind == "gpu" and w.alive and w.ready)
    if not gpus:
        return []
    load = {g: 0 for g in gpus}
    for w in workers.values():
        if w.kind == "cpu" and w.alive and w.hybrid_with in load:
            load[w.hybrid_with] += 1
    pairs = []
    for cpu in sorted(workers.values(), key=lambda w: w.worker_id):
        if cpu.kind == "cpu" and cpu.alive and cpu.ready and cpu.mailbox and not cpu.hybrid_with:
            gpu = min(gpus, key=lambda g: (load[g], g))
            load[gpu] += 1
            pairs.append((cpu.worker_id, gpu))
    return pairs


def pick_worker(workers: dict[str, WorkerView], max_sequences: int) -> str | None:
    """The CPU worker that takes the next sequence (GPU workers only prefill)."""
    candidates = [w for w in workers.values()
                  if w.kind == "cpu" and w.alive and w.ready and len(w.requests) < max_sequences]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (len(w.requests), w.worker_id)).worker_id
