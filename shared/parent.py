"""The coordinator's children (workers, the HTTP front end) die with it.

A coordinator killed with SIGKILL cannot stop its children, and a worker left running
holds its model's memory (and any pipe its parent's caller reads) for ever. The
coordinator names itself to each child in FERMOE_PARENT_PID; the child asks Linux to send
it SIGTERM when that parent dies (PR_SET_PDEATHSIG), which it handles as a stop. A worker
started by hand has no such variable and outlives whatever started it."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "FERMOE_PARENT_PID"
PR_SET_PDEATHSIG = 1


def child_env(env: dict | None = None) -> dict:
    """The environment of a child that is to die with this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """Where FERMOE_PARENT_PID names our parent: SIGTERM when it dies, and exit now if it
    is gone already (it died before the request was made)."""
    pid = os.environ.pop(PARENT_ENV, None)
    if not pid or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return                                  # not fatal: the parent stops us in order, as before
    if os.getppid() != int(pid):
        sys.exit(0)
