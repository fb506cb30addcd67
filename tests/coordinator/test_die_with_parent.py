"""A coordinator killed with SIGKILL takes its workers and its HTTP front end with it
(shared/parent.py): nothing of it is left holding the model's memory or its caller's pipes."""
from __future__ import annotations

import os
import time

from coordinator.client import Client
from shared.builtin import BUILTIN
from tests.support.http_server import HttpDaemon


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:           # a zombie (its parent, us or init, not yet waited) is gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_coordinators_children_stop():
    """Guards: workers and the front end left running after a kill -9 of their coordinator
    (PR_SET_PDEATHSIG not set, or set in the wrong process)."""
    d = HttpDaemon(BUILTIN["tiny"])
    with Client(d.addr) as client:
        workers = [w.pid for w in client.status().workers]
    frontend = [int(line.split("(pid ")[1].split(")")[0]) for line in d.log if "started the HTTP front end" in line]
    assert workers and len(frontend) == 1
    d.proc.kill()
    d.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers + frontend):
        assert time.monotonic() < deadline, [pid for pid in workers + frontend if _alive(pid)]
        time.sleep(0.1)
