"""How much of a process's mapping is in its page tables, from /proc/PID/smaps."""
from __future__ import annotations


def mapping_rss(pid: int | str, is_it) -> int:
    """Rss bytes of the first mapping of process `pid` whose smaps header line (address
    range, permissions, ..., path) is_it(line) accepts."""
    lines = open(f"/proc/{pid}/smaps").read().splitlines()
    at = next((i for i, line in enumerate(lines) if "-" in line.split()[0] and is_it(line)), None)
    assert at is not None, f"process {pid} has no such mapping"
    return next(int(m.split()[1]) * 1024 for m in lines[at + 1:] if m.startswith("Rss:"))
