"""The snapshot store's disk tier as the coordinator uses it: written behind the arena,
read back into it when a prompt reaches further on disk than in memory.

What is kept (issue: an agent's system prompt prefilled once, ever): the states where
prompts resume (a prompt's end, its turn starts, a generation's end, a block-aligned
prompt's last block) and the KV of every block that leads to them; the spare states a long
prompt leaves at its other block boundaries are not (they would multiply the bytes by the
state's size for resume points no request names).

Threads: the event loop only pins the entries to write (lookups that count nothing) or
reserves slots for a load (plan_load: SnapshotIndex.restore); one I/O thread copies the pinned
slots and writes them, reads entries into the reserved slots, and does every other file
operation (coordinator/disk_tier.py), then wakes the loop through `fd`, which unpins what was
written and commits what was loaded (finished). The loop's own view of what is on disk, `known`, is updated
as it queues writes, so that a second request for the same prefix neither copies it again
nor waits for the write to land: a load of an entry whose write failed fails as a whole and
the request prefills as if there were no disk tier.

The directory is per model contents: DiskTier's model key hashes the GGUF file's bytes
(cached by its size, mtime and inode, so a restart does not read it again), its metadata
fingerprint, the KV data type and the arena's block and slot geometry, so any change that
would make a snapshot wrong makes the old ones invisible.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .disk_tier import DiskTier, DiskTierLocked, default_capacity
from .snapshots import Planned, SnapshotIndex

log = logging.getLogger("fermoe.coordinator")

MAX_PENDING_WRITES = 16         # prompts whose snapshots wait for the writer, pinned: past this, skipped
HASH_CHUNK = 16 << 20


def file_digest(path: str, cache_file: Path) -> str:
    """blake2b of the file's bytes, remembered in `cache_file` under its (size, mtime, inode):
    a 20 GB model is read once per version of the file, not at every start."""
    st = os.stat(path)
    stamp = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}"
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(stamp), str):
        return known[stamp]
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    known = {k: v for k, v in (known if isinstance(known, dict) else {}).items()
             if not k.startswith(os.path.realpath(path) + ":")}
    known[stamp] = digest
    tmp = cache_file.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache_file)
    except OSError:
        pass                                    # only a cache: the next start reads the file again
    return digest


@dataclass
class LoadJob:
    """Entries to bring from disk into the slots SnapshotIndex.restore reserved for them."""
    rid: str
    planned: list[Planned]
    position: int                               # where the request resumes once they are in
    ok: bool = False
    ms: float = 0.0
    nbytes: int = 0


@dataclass
class DiskStats:
    written: int = 0                            # entries written
    written_bytes: int = 0
    dropped: int = 0                            # writes not queued (the writer behind) or failed
    loads: int = 0                              # requests that resumed from disk
    load_failures: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    bytes_used: int = 0
    entries: int = 0


@dataclass
class _Known:
    parent: bytes | None
    position: int
    has_state: bool


class DiskCache:
    def __init__(self, root: str, capacity: int, model_path: str, model_fingerprint: str, kv_dtype: str,
                 index: SnapshotIndex, arena):
        self.root, self.capacity, self.index, self.arena = Path(root), capacity, index, arena
        self.geometry = f"{model_fingerprint}:{kv_dtype}:{index.block}:{arena.slot_bytes}:{arena.state_slot_bytes}"
        self.model_path = model_path
        self.tier: DiskTier | None = None
        self.ready = False                      # opened (the loop learnt it in finished())
        self.known: dict[bytes, _Known] = {}
        self.ends: dict[bytes, set[int]] = {}   # chain key (b"": none) -> tail lengths of end entries after it
        self.stats = DiskStats()
        self.jobs: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.pending = 0                        # writes queued whose entries are pinned
        self.fd, self._wake_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake_fd, False)
        self.thread = threading.Thread(target=self._run, name="snapshot-disk", daemon=True)
        self.thread.start()

    # ---- the event loop's side ---------------------------------------------------------
    def persist(self, tokens, state_at) -> None:
        """Write behind: for each position of `state_at` (the prompt's resume points), the
        deepest cached resume point at or before it, its state and the KV chain to it, where
        not on disk yet. The entries are pinned (lookups that count nothing) until the I/O
        thread has copied and written them: the loop itself copies no bytes."""
        if self.pending >= MAX_PENDING_WRITES:      # the writer is behind: pins would pile up
            self.stats.dropped += 1
            return
        idx, resumes, entries = self.index, [], {}
        for p in sorted({int(p) for p in state_at if 0 < p <= len(tokens)}):
            resume = idx.lookup(tokens[:p], counted=False)
            if resume is None:
                continue
            resumes.append(resume)
            last = resume.entries[-1].key
            for entry in resume.entries:
                with_state = entry.key == last
                have = self.known.get(entry.key)
                if (have is None or (with_state and not have.has_state)) and \
                        not (entry.key in entries and entries[entry.key][1] >= 0):
                    entries[entry.key] = (entry, resume.state if with_state else -1)
        if not entries:
            for resume in resumes:
                idx.release(resume)
            return
        for entry, state in entries.values():
            self._note(entry.key, _Known(entry.parent, entry.position, state >= 0))
        writes = sorted(entries.values(), key=lambda e: -e[0].position)   # deepest first: the disk's
        self.pending += 1                                                 # LRU keeps a chain's root longest
        self.jobs.put(("put", writes, resumes))

    def _note(self, key: bytes, known: _Known) -> None:
        self.known[key] = known
        if known.position % self.index.block:
            self.ends.setdefault(known.parent or b"", set()).add(known.position % self.index.block)

    def plan_load(self, rid: str, tokens) -> LoadJob | None:
        """When the disk reaches further into `tokens` than the arena does: the entries to
        bring in, their slots reserved (the I/O thread fills them, finished() commits them);
        None otherwise, or when the arena cannot hold them."""
        if not self.ready:
            return None
        idx, block, n = self.index, self.index.block, len(tokens)
        keys = idx.chain_keys(tokens)
        m = 0
        while m < len(keys) and (keys[m] in self.known or idx.entry(keys[m]) is not None):
            m += 1
        best = None
        for k in range(m, -1, -1):
            base = keys[k - 1] if k else b""
            for r in sorted(self.ends.get(base, ()), reverse=True):
                if k * block + r <= n:
                    end = idx.end_key(tokens[:k * block + r])
                    if end in self.known:
                        best = (k, end, k * block + r)
                        break
            if best is None and k and (have := self.known.get(keys[k - 1])) is not None and have.has_state:
                best = (k, None, k * block)
            if best is not None:
                break
        if best is None or best[2] <= idx.cached(tokens):
            return None
        k, end, position = best
        chain = [(keys[i], keys[i - 1] if i else None, (i + 1) * block) for i in range(k)]
        if end is not None:
            chain.append((end, keys[k - 1] if k else None, position))
        planned = idx.restore(chain)
        if not planned:
            return None
        job = LoadJob(rid, planned, position)
        self.jobs.put(("load", job))
        return job

    def finished(self) -> list[LoadJob]:
        """After `fd` turned readable: the loads done (their slots committed, or freed on a
        failure), and the store's opening."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        done = []
        while True:
            try:
                kind, item = self.results.get_nowait()
            except queue.Empty:
                return done
            if kind == "opened":
                for key, known in item.items():
                    if key not in self.known:
                        self._note(key, known)
                self.ready = True
            elif kind == "forget":              # a write that failed, or an entry found bad
                self.known.pop(item, None)
            elif kind == "release":             # written: the entries it pinned may go
                self.pending -= 1
                for resume in item:
                    self.index.release(resume)
            else:
                (self.index.commit if item.ok else self.index.abort)(item.planned)
                self.stats.loads += item.ok
                self.stats.load_failures += not item.ok
                self.stats.loaded_bytes += item.nbytes
                self.stats.load_seconds += item.ms / 1000
                done.append(item)

    def status(self) -> dict[str, int]:
        """StatusReply.snapshots' disk entries (/metrics: fermoe:snapshot_disk_*)."""
        st = self.stats
        return {"disk_entries": st.entries, "disk_bytes": st.bytes_used, "disk_capacity": self.capacity or 0,
                "disk_written": st.written, "disk_written_bytes": st.written_bytes, "disk_dropped": st.dropped,
                "disk_loads": st.loads, "disk_load_failures": st.load_failures, "disk_loaded_bytes": st.loaded_bytes,
                "disk_load_ms": round(1000 * st.load_seconds)}

    def close(self) -> None:
        self.jobs.put(("stop",))
        self.thread.join(timeout=30)
        for fd in (self.fd, self._wake_fd):
            os.close(fd)

    # ---- the I/O thread ------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_fd, b"\0")
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        try:
            self._open()
        except DiskTierLocked as e:
            log.warning("%s: serving without the disk tier", e)
        except Exception as e:                  # a bad directory, no permission: serve on without it
            log.error("the snapshot disk tier at %s could not be opened (%s: %s): serving without it",
                      self.root, type(e).__name__, e)
        while True:
            job = self.jobs.get()
            if job[0] == "stop":
                break
            if self.tier is None:               # no tier: loads fail (none are planned), writes are dropped
                if job[0] == "load":
                    self._finish_load(job[1])
                else:
                    self.results.put(("release", job[2]))
                    self._wake()
                continue
            try:
                self._put(*job[1:]) if job[0] == "put" else self._load(job[1])
            except Exception:                   # one entry's fault: the thread goes on
                log.exception("the snapshot disk tier failed a %s", job[0])
                if job[0] == "load":
                    self._finish_load(job[1])
        if self.tier is not None:
            self.tier.close()

    def _open(self) -> None:
        t0 = time.perf_counter()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        digest = file_digest(self.model_path, self.root / "model-digests.json")
        key = hashlib.blake2b(f"{digest}:{self.geometry}".encode(), digest_size=12).hexdigest()
        if self.capacity is None:
            self.capacity = default_capacity(self.root)
        self.tier = DiskTier(self.root, key, self.capacity)
        known = {k: _Known(parent, position, has_state) for k, (parent, position, has_state) in self.tier.items()}
        self.stats.entries, self.stats.bytes_used = len(self.tier), self.tier.bytes_used
        log.info("snapshot disk tier: %s, %d entries (%.1f MiB of %.1f MiB), opened in %.1f s", self.tier.directory,
                 len(known), self.tier.bytes_used / 2**20, self.capacity / 2**20, time.perf_counter() - t0)
        self.results.put(("opened", known))
        self._wake()

    def _put(self, writes, resumes) -> None:
        """Copy the pinned slots and write them; the loop unpins them afterwards (finished)."""
        try:
            for entry, state in writes:
                kv = bytes(self.arena.slot(entry.slot))
                st = bytes(self.arena.state_slot(state)) if state >= 0 else None
                if self.tier.put(entry.key, entry.parent, entry.position, kv, st):
                    self.stats.written += 1
                    self.stats.written_bytes += len(kv) + (len(st) if st is not None else 0)
                elif entry.key not in self.tier:
                    self.stats.dropped += 1
                    self.results.put(("forget", entry.key))
            self.stats.entries, self.stats.bytes_used = len(self.tier), self.tier.bytes_used
        finally:
            self.results.put(("release", resumes))
            self._wake()

    def _load(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        nbytes = 0
        for p in reversed(job.planned):             # deepest first, as written: the root read last stays newest
            got = self.tier.get(p.key)
            if got is None or (p.state >= 0 and got[3] is None):
                self.results.put(("forget", p.key))
                break
            _, _, kv, state = got
            if len(kv) != self.arena.slot_bytes or (state is not None and len(state) != self.arena.state_slot_bytes):
                self.results.put(("forget", p.key))
                break
            if p.slot >= 0:
                self.arena.slot(p.slot)[:len(kv)] = kv
                nbytes += len(kv)
            if p.state >= 0:
                self.arena.state_slot(p.state)[:len(state)] = state
                nbytes += len(state)
        else:
            job.ok = True
        job.ms, job.nbytes = 1000 * (time.perf_counter() - t0), nbytes
        self._finish_load(job)

    def _finish_load(self, job: LoadJob) -> None:
        self.results.put(("load", job))
        self._wake()
