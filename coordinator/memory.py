"""How much of the host the coordinator plans for: how many positions a served
sequence may hold (vLLM's max_model_len), and the snapshot arena's default size and slots.

KV pages are allocated as a sequence grows, so the limit is what keeps the host's
memory from running out: max_sequences sequences on every local worker, each at
max_model_len positions, must fit beside the mapped weights. By default it is the
model's context length, or less where that many sequences would not fit;
--max-model-len sets it (never above the model's context length)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from shared.config import ModelConfig
from shared.errors import FermoeError
from shared.state import DEFAULT_BLOCK, kv_bytes_per_position, kv_slot_nbytes, recurrent_nbytes, state_slot_nbytes

from .placement import GPU_QUEUE

log = logging.getLogger("fermoe.coordinator")

RESERVE_BYTES = 2 << 30         # left to the OS, the processes and the page cache's churn
RESERVE_FRACTION = 0.05


def host_memory_bytes() -> int:
    """MemTotal of this host (FERMOE_HOST_MEMORY overrides it, for tests)."""
    if os.environ.get("FERMOE_HOST_MEMORY"):
        return int(os.environ["FERMOE_HOST_MEMORY"])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise FermoeError("cannot read MemTotal from /proc/meminfo")


# The snapshot arena lives in /dev/shm: memory the kernel can neither swap nor reclaim
# while the coordinator runs, taken beside the weights and the workers' KV. By default
# it gets an eighth of the host's memory, at most half of what /dev/shm has free (other
# programs use it too) and at most 8 GiB (on the full-size model some thirty resume
# points and a quarter of a million positions of KV: past that, more cache rarely means
# more hits).
SNAPSHOT_MEM_HOST_FRACTION = 8
SNAPSHOT_MEM_SHM_FRACTION = 2
SNAPSHOT_MEM_CAP = 8 << 30
SHM_DIR = "/dev/shm"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def default_snapshot_mem() -> tuple[int, str]:
    """--snapshot-mem when not given: (bytes, why, in words for the log)."""
    host, shm = host_memory_bytes(), shm_free_bytes()
    size = min(host // SNAPSHOT_MEM_HOST_FRACTION, shm // SNAPSHOT_MEM_SHM_FRACTION, SNAPSHOT_MEM_CAP)
    gib = 1 << 30
    why = (f"1/{SNAPSHOT_MEM_HOST_FRACTION} of this host's {host / gib:.1f} GiB, at most 1/{SNAPSHOT_MEM_SHM_FRACTION} "
           f"of the {shm / gib:.1f} GiB free in {SHM_DIR} and {SNAPSHOT_MEM_CAP // gib} GiB")
    return size, why


# The snapshot store's two pools (coordinator/snapshots.py): KV slots, a block's K and V
# each, link the chains that every resume needs whole; state slots, a recurrent state
# each (far larger), are the resume points, of which a few recent ones serve most
# requests. By default the states get about a quarter of the budget, and at least
# SNAPSHOT_STATES_MIN (a conversation's turn start, its prompt's end and its
# generation's end, with one to spare), when they fit.
SNAPSHOT_STATES_SHARE = 4
SNAPSHOT_STATES_MIN = 4


def snapshot_pools(budget: int, kv_slot_bytes: int, state_slot_bytes: int,
                   states: int | None = None) -> tuple[int, int]:
    """(KV slots, state slots) of a --snapshot-mem `budget`: `states` state slots
    (--snapshot-states) or by default about a quarter of the budget, at least
    SNAPSHOT_STATES_MIN and at most what leaves room for one KV slot; the rest KV slots.
    (0, 0): the budget holds no snapshot (one KV slot and one state slot)."""
    room = (budget - kv_slot_bytes) // state_slot_bytes if budget >= kv_slot_bytes else 0
    if states is not None:
        if states < 1:
            raise FermoeError(f"--snapshot-states {states}: a snapshot store needs one state slot at least")
        if budget and states > room:
            raise FermoeError(f"--snapshot-states {states}: {states} states of {state_slot_bytes / 2**20:.1f} MiB "
                              f"and a KV slot do not fit in --snapshot-mem {budget / 2**20:.1f} MiB "
                              f"({room} would)")
    if room < 1:
        return 0, 0
    if states is None:
        share = round(budget / SNAPSHOT_STATES_SHARE / state_slot_bytes)
        states = min(max(share, SNAPSHOT_STATES_MIN), room)
    return (budget - states * state_slot_bytes) // kv_slot_bytes, states


@dataclass(frozen=True)
class SnapshotStore:
    """The snapshot store's slots: how many of each pool, and their sizes."""
    kv_slot_bytes: int
    state_slot_bytes: int
    kv_slots: int
    state_slots: int

    def describe(self, block: int) -> str:
        """In words, for the log: the slots, the positions of KV they hold, the /dev/shm they take."""
        kv, state = self.kv_slot_bytes, self.state_slot_bytes
        return (f"{self.kv_slots} KV slots of {kv / 2**20:.2f} MiB ({self.kv_slots * block} positions, block "
                f"{block}) and {self.state_slots} state slots of {state / 2**20:.1f} MiB: "
                f"{(self.kv_slots * kv + self.state_slots * state) / 2**20:.1f} MiB of /dev/shm")


def snapshot_store(cfg: ModelConfig, block: int, kv_cache_dtype: str, budget: int,
                   states: int | None = None) -> SnapshotStore:
    """The store of a --snapshot-mem `budget` (--snapshot-states `states`): its slots' sizes
    for this model, block and KV dtype, and their numbers (snapshot_pools)."""
    kv = kv_slot_nbytes(cfg, block, kv_cache_dtype)
    state = state_slot_nbytes(cfg)
    return SnapshotStore(kv, state, *snapshot_pools(budget, kv, state, states))


# What one GPU worker holds in host memory, in sequences: the state of the prompts it
# prefills in one batch (their KV together at most max_model_len positions: the worker
# is told) and the page-locked rows their K and V land in first (as many).
GPU_WORKER_SEQUENCES = 2


def host_footprint(model_bytes: int, expert_bytes: int, cpu_sequences: int, gpu_workers: int,
                   shared_experts: bool, snapshot_bytes: int = 0, state_bytes: int = 0) -> tuple[int, int]:
    """(bytes held beside the sequences' state, sequences held at once) of a daemon: the
    model file once (its page cache, or the shared expert segment and the rest of the
    file), a page-locked copy of the experts for each GPU worker that cannot stream from
    the shared segment, the snapshot store where a GPU worker page-locks it (all of it
    resident from the start, where without one it fills as prompts come), and each GPU
    worker's batch of prompts beside the CPU workers' sequences: two sequences, and for
    each prompt past the first the recurrent state (`state_bytes`) and its landing."""
    copies = 0 if shared_experts else gpu_workers
    pinned_store = snapshot_bytes if gpu_workers else 0
    batch_states = gpu_workers * (GPU_QUEUE - 1) * 2 * state_bytes
    return (model_bytes + copies * expert_bytes + pinned_store + batch_states,
            cpu_sequences + GPU_WORKER_SEQUENCES * gpu_workers)


def fitted_max_model_len(cfg: ModelConfig, dtype: str, weight_bytes: int, sequences: int, memory: int) -> int:
    """The longest context (whole KV pages of DEFAULT_BLOCK, at most the model's) that
    `sequences` sequences can all reach in `memory` bytes beside the weights; 0 if not even their
    recurrent states fit."""
    budget = memory - weight_bytes - max(RESERVE_BYTES, int(memory * RESERVE_FRACTION))
    per_sequence = budget // max(sequences, 1) - recurrent_nbytes(cfg)
    if per_sequence <= 0:
        return 0
    positions = per_sequence // kv_bytes_per_position(cfg, dtype)
    return min(cfg.n_ctx_train, positions // DEFAULT_BLOCK * DEFAULT_BLOCK)


def resolve_max_model_len(asked: int | None, cfg: ModelConfig, dtype: str, weight_bytes: int,
                          sequences: int) -> int:
    """--max-model-len as given, or fitted to the host. A value above the model's context
    length is taken with a warning (llama.cpp's -c does the same): the workers then run
    sequences that long (WorkerLink's Welcome carries it)."""
    memory = host_memory_bytes()
    fitted = fitted_max_model_len(cfg, dtype, weight_bytes, sequences, memory)
    gib = memory / (1 << 30)
    if asked is not None:
        if asked < 1:
            raise FermoeError(f"--max-model-len {asked}: must be >= 1")
        if asked > cfg.n_ctx_train:      # llama.cpp's -c above n_ctx_train: taken, with a warning
            log.warning("--max-model-len %d: the model was trained on %d positions (its context length); "
                        "its answers past them are unreliable (noise for the built-in model)",
                        asked, cfg.n_ctx_train)
        if asked > cfg.n_ctx_train:      # what fits when sequences may be longer than the model's own
            fitted = fitted_max_model_len(replace(cfg, n_ctx_train=asked), dtype, weight_bytes, sequences, memory)
        if asked > fitted:
            log.warning("--max-model-len %d: %d sequences that long may not fit in this host's %.1f GiB "
                        "beside the weights (about %d would)", asked, sequences, gib, fitted)
        return asked
    if fitted < 1:
        raise FermoeError(f"{sequences} sequences' state does not fit in this host's {gib:.1f} GiB beside "
                          f"the weights: lower --max-sequences")
    if fitted < cfg.n_ctx_train:
        log.info("max_model_len %d positions: %d sequences at the model's context length (%d) would not fit "
                 "in this host's %.1f GiB beside the weights (--max-model-len, --max-sequences)",
                 fitted, sequences, cfg.n_ctx_train, gib)
    return fitted
