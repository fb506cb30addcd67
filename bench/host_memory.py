"""The host memory a process tree holds: the sum of its processes' proportional set
sizes (Pss, /proc/PID/smaps_rollup), which counts a page mapped by several of them
once in all (the model's page cache, a shared-memory segment, page-locked buffers),
sampled in a thread while a benchmark runs. At the peak it is also split by what the
pages are (/proc/PID/smaps): the files mapped, each shared-memory segment, the rest.

JSON keys (of the object TreeMemory.stop returns: `fermoe bench serve` prints it as "host_memory"):
  peak_gib                GiB: the largest sum of the tree's Pss seen
  peak_by_process_gib.<process>  GiB: at that moment, by process kind (the module a python process
                          runs with -m, else its command), processes of a kind summed
  peak_by_mapping_gib.<mapping>  GiB: at that moment, by what is mapped: a file's path, a /dev/shm
                          segment's, or "anonymous" (heaps, page-locked buffers, the CUDA driver's);
                          those of at least 64 MiB
  peak_by_mapping_gib.other  GiB: the smaller ones, summed"""
from __future__ import annotations

import os
import threading
import time


def parents() -> dict[int, int]:
    """pid -> its parent's pid, for every process there is."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """pid and every process below it (workers in sessions of their own included)."""
    children: dict[int, list[int]] = {}
    for child, ppid in parents().items():
        children.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_name(pid: int) -> str:
    """The module a python process runs (-m NAME), else its command."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    if b"-m" in argv and argv.index(b"-m") + 1 < len(argv):
        return argv[argv.index(b"-m") + 1].decode(errors="replace")
    return os.path.basename(argv[0].decode(errors="replace"))


def pss_by_mapping(pid: int) -> dict[str, int]:
    """Pss by what is mapped: a file's path, a /dev/shm segment's name, or "anonymous"
    (heaps, page-locked buffers, the CUDA driver's)."""
    out: dict[str, int] = {}
    name = "anonymous"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not line.endswith(":\n") and ":" not in head[0]:
                    path = head[5].strip() if len(head) == 6 else ""
                    name = path if path.startswith("/") else "anonymous"
                elif line.startswith("Pss:"):
                    out[name] = out.get(name, 0) + int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


class TreeMemory(threading.Thread):
    """Samples the tree under `pid` every `period_s` until stop(); peak() is the largest
    sum seen, with each kind of process's share at that moment."""

    def __init__(self, pid: int, period_s: float = 0.25):
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self._done = threading.Event()
        self.peak_total, self.peak_by_name, self.peak_by_mapping = 0, {}, {}

    def sample(self) -> int:
        by_name: dict[str, int] = {}
        for p in descendants(self.pid):
            name = process_name(p)
            by_name[name] = by_name.get(name, 0) + pss_bytes(p)
        total = sum(by_name.values())
        if total > self.peak_total:
            self.peak_total, self.peak_by_name = total, by_name
            by_mapping: dict[str, int] = {}
            for p in descendants(self.pid):
                for k, v in pss_by_mapping(p).items():
                    by_mapping[k] = by_mapping.get(k, 0) + v
            self.peak_by_mapping = by_mapping
        return total

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            time.sleep(self.period_s)

    def stop(self) -> dict:
        self._done.set()
        if self.is_alive():
            self.join(5)
        gib = 1 << 30
        large = {k: v for k, v in self.peak_by_mapping.items() if v >= 64 << 20}
        rest = sum(self.peak_by_mapping.values()) - sum(large.values())
        return {"peak_gib": round(self.peak_total / gib, 2),
                "peak_by_process_gib": {k: round(v / gib, 2) for k, v in sorted(self.peak_by_name.items())},
                "peak_by_mapping_gib": {**{k: round(v / gib, 2) for k, v in sorted(large.items())},
                                        "other": round(rest / gib, 2)}}
