"""A coordinator daemon as a child process, started and stopped from another program:
`fermoe demo` and the serving benchmarks (bench/serve.py, bench/http.py, bench/agent.py).
Its log goes to a file the caller holds, read back for its last words when it fails."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(model: str, addr: str, extra, log) -> subprocess.Popen:
    """Without the snapshot disk tier unless `extra` names one: a benchmark's cold prefill is
    cold, whatever an earlier run left on disk."""
    return subprocess.Popen([sys.executable, "-m", "coordinator.daemon", "--model", model, "--bind", addr,
                             "--snapshot-disk", "0", *extra], stderr=log)


def stop_coordinator(daemon: subprocess.Popen) -> None:
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout=60)


def read_log(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def last_words(log) -> str | None:
    """The coordinator's last log line: why it did not come up."""
    lines = [line for line in read_log(log).splitlines() if line.strip()]
    return lines[-1] if lines else None
