"""The README's examples, run as a reader runs them, on the built-in model.

A fenced block right after the line `<!-- test_readme: run -->` is run: a bash block
as one script (`set -e`, `$MODEL` = tiny), a Python block as one program against a
coordinator serving tiny over HTTP. Other blocks name large files or other hosts and
are not run. The installs are skipped (this package is installed) and so is the
test suite itself. Ports are replaced by free ones, so that the examples' defaults
(ZeroMQ 5557, HTTP 8080) never meet another daemon on this machine, and `fermoe`,
`coordinator` and `cpu_worker` run this checkout's code with this interpreter."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.http_server import HttpDaemon
from tests.support.serving_harness import free_port, shm_names, unpinned

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- test_readme: run -->"
TIMEOUT_S = 120
COMMANDS = {"fermoe": "fermoe.cli", "coordinator": "coordinator.daemon", "cpu_worker": "cpu_worker.worker"}


def marked_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block right after the marker, in README order."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(re.escape(MARKER) + r"\n```(\w+)\n(.*?)\n```", text, re.S)
    assert len(found) == text.count(MARKER), "a marker not followed at once by a fenced block"
    return found


def runnable(code: str) -> str:
    """The block without its installs and without the test suite (this is a test of it)."""
    lines = []
    for line in code.splitlines():
        line = re.sub(r"^python3 -m pip install .*? && ", "", line)
        if "pip install" in line or "pytest" in line:
            continue
        lines.append(line)
    return "\n".join(lines)


def with_ports(code: str, zmq_port: int, http_port: int) -> str:
    return code.replace("5557", str(zmq_port)).replace("8080", str(http_port))


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    """`fermoe`, `coordinator` and `cpu_worker` that run this checkout with this interpreter."""
    d = tmp_path / "bin"
    d.mkdir()
    for name, module in COMMANDS.items():
        (d / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        (d / name).chmod(0o755)
    return d


def run_bash(code: str, bin_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    """The block as one bash script (-e: the first failing line ends it)."""
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MODEL": "tiny",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # The examples rely on the default client endpoint (5557); spelled out, it gets a free port.
    code = re.sub(r"\bcoordinator --model", "coordinator --bind tcp://127.0.0.1:5557 --model", code)
    for cmd in ("fermoe demo", "fermoe submit"):
        code = code.replace(cmd, f"{cmd} --addr tcp://127.0.0.1:5557")
    code = with_ports(code, free_port(), free_port())
    # A session of its own: if a line fails, what the script left running in the background
    # (a coordinator and its workers) is stopped with it, by the session's process group.
    # Output goes to files, which a daemon left behind cannot hold open as it would a pipe.
    out_path, err_path = cwd / "stdout", cwd / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", "-e", "-c", code], cwd=cwd, env=env, stdout=out, stderr=err,
                                text=True, preexec_fn=unpinned, start_new_session=True)
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass                                    # nothing left: the script stopped its daemon
    out, err = out_path.read_text(), err_path.read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


BASH = [code for lang, code in marked_blocks() if lang == "bash"]
PYTHON = [code for lang, code in marked_blocks() if lang == "python"]


def test_the_readme_marks_its_runnable_examples():
    """The quick start, the HTTP and ZeroMQ examples and the openai snippet at least."""
    joined = "\n".join(BASH)
    for command in ("fermoe demo", "fermoe generate", "curl", "fermoe submit", "kill %1"):
        assert command in joined, f"no marked README example runs {command!r}"
    assert any("from openai import OpenAI" in code for code in PYTHON)


@pytest.mark.parametrize("code", BASH, ids=[f"bash{i}" for i in range(len(BASH))])
def test_bash_example(code, bin_dir, tmp_path):
    before = shm_names()
    r = run_bash(runnable(code), bin_dir, tmp_path)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert r.stdout.strip(), f"no output\n--- stderr\n{r.stderr}"
    assert not [n for n in shm_names() - before if not _alive(n)], "a stopped daemon left its arena"


def _alive(shm_name: str) -> bool:
    """Whether the process that made a segment (fermoe-PID-...) still runs: another
    test's daemon, not one of this example's."""
    pid = shm_name.split("-")[1]
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("code", PYTHON, ids=[f"python{i}" for i in range(len(PYTHON))])
def test_python_example(code, tmp_path):
    pytest.importorskip("openai")
    daemon = HttpDaemon("tiny")
    try:
        http_port = int(daemon.url.rsplit(":", 1)[1])
        zmq_port = int(daemon.addr.rsplit(":", 1)[1])
        r = subprocess.run([sys.executable, "-c", with_ports(code, zmq_port, http_port)], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    finally:
        assert daemon.stop() == 0
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert r.stdout.strip()
