"""This machine's CPUs, as the coordinator plans its workers and a decode worker pins
itself: the physical cores of a NUMA node, one hardware thread per core (the paper
found hyper-thread siblings catastrophic)."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import FermoeError

SYS = Path("/sys/devices/system")

# The CPUs this process may run on, as it started. A native thread pool pins the
# thread that creates it to its first CPU while it lives, so sched_getaffinity(0)
# from that thread would then name one CPU, and a second engine made there would
# put all its threads on it.
_PROCESS_CPUS = tuple(sorted(os.sched_getaffinity(0)))


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (as it started; see _PROCESS_CPUS)."""
    return list(_PROCESS_CPUS)


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes() -> dict[int, list[int]]:
    """CPUs of each NUMA node; one node holding every allowed CPU where sysfs has none."""
    allowed = allowed_cpus()
    nodes = {}
    for d in sorted((SYS / "node").glob("node[0-9]*")):
        cpus = [c for c in parse_cpulist((d / "cpulist").read_text()) if c in allowed]
        if cpus:
            nodes[int(d.name[4:])] = cpus
    return nodes or {0: allowed}


def physical_cores(cpus: list[int]) -> list[int]:
    """The first hardware thread of every core among `cpus`."""
    chosen, seen = [], set()
    for cpu in sorted(cpus):
        path = SYS / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        siblings = tuple(parse_cpulist(path.read_text())) if path.exists() else (cpu,)
        if siblings not in seen:
            seen.add(siblings)
            chosen.append(cpu)
    return chosen


def default_cpus(node: int | None = None) -> list[int]:
    """Physical cores of `node` (default: the first node)."""
    nodes = numa_nodes()
    return physical_cores(nodes[node if node is not None else min(nodes)])


def cpu_list(text: str) -> list[int]:
    """--cpus: CPUs this process may run on, or a FermoeError naming the bad ones."""
    try:
        cpus = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise FermoeError(f"--cpus {text!r}: expected comma-separated CPU numbers") from None
    allowed = allowed_cpus()
    bad = [c for c in cpus if c not in allowed]
    if not cpus or bad:
        raise FermoeError(f"--cpus {text}: {bad or 'no CPUs'} not among the CPUs this process may run on {allowed}")
    return cpus
