"""Pin a worker process to its node: CPUs by sched_setaffinity, memory by libnuma
(py-libnuma) when the machine has it. Weight pages come from the shared page cache
(one copy for all workers); with `interleave` they are spread over every node, the
paper's setting for a model larger than one node's memory."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("fermoe.cpu_worker")


def place(node: int, cpus: list[int], interleave: bool = False) -> str:
    """Apply the placement; returns a one-line description of what was done."""
    os.sched_setaffinity(0, cpus)
    try:
        from numa import info, memory
    except (ImportError, OSError, AttributeError) as e:   # no libnuma (py-libnuma without libnuma.so
        # fails its import with AttributeError on the missing symbol)
        return f"CPUs {cpus}; memory policy unchanged (libnuma unavailable: {e})"
    nodes = list(range(info.get_max_node() + 1))
    if interleave:
        memory.set_interleave_nodes(*nodes)
        return f"CPUs {cpus}; memory interleaved over nodes {nodes}"
    memory.set_membind_nodes(node)
    return f"CPUs {cpus}; memory bound to node {node}"
