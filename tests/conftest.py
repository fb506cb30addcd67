"""Shared fixtures: the built-in tiny model, made once per test session; and `isa`,
which runs a test once for every kernel set the native library has. An ISA this CPU
lacks is a skip that names it, never a case that silently is not there, and the
summary's last line says which ISAs ran and which were skipped, and why (run with
FERMOE_MAX_ISA=avx2 to see what an AVX2-only machine reports)."""
from __future__ import annotations

import os
from collections import Counter

import pytest

from modeltools.synth import synth

try:
    import native
except ImportError:          # not built: every `isa` case skips, saying so
    native = None

# native.ISAS where the extension is built; the same names otherwise, so the cases exist
ALL_ISAS = native.ISAS if native is not None else ("scalar", "ssse3", "avx2", "avx512vnni")
_isa_ran: Counter = Counter()
_isa_skipped: dict[str, tuple[str, int]] = {}     # name -> (reason, tests)


# Every daemon a test starts runs without the snapshot disk tier (a user's ~/.cache would make
# one run's prompts cached in the next), unless the test gives --snapshot-disk itself.
os.environ.setdefault("FERMOE_SNAPSHOT_DISK", "0")

_START_CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def _cpus_as_at_start():
    """A native thread pool pins the thread that creates it to one CPU while it lives;
    an engine a test left alive would pin every later test (and the daemons they start)
    to that CPU. Each test starts on the CPUs the session started with."""
    if sorted(os.sched_getaffinity(0)) != _START_CPUS:
        os.sched_setaffinity(0, _START_CPUS)
    yield


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    """The kernels of one ISA, selected for the test's duration (indirect
    parametrisation narrows the list: parametrize("isa", [...], indirect=True))."""
    name = request.param
    if native is None:
        _skip_isa(name, "the native extension is not built")
    old = native.get_isa()
    try:
        native.set_isa(name)
    except native.ISAError as e:          # the library's own refusal: "... this CPU lacks avx512vnni ..."
        _skip_isa(name, str(e))
    _isa_ran[name] += 1
    try:
        yield name
    finally:
        native.set_isa(old)


def _skip_isa(name: str, reason: str):
    _isa_skipped[name] = (reason, _isa_skipped.get(name, ("", 0))[1] + 1)
    pytest.skip(reason)


def isa_summary() -> str | None:
    """One line: the ISAs whose cases ran, and those skipped with the reason."""
    if not _isa_ran and not _isa_skipped:
        return None
    ran = ", ".join(f"{n} ({_tests(_isa_ran[n])})" for n in ALL_ISAS if _isa_ran[n]) or "none"
    skipped = "; ".join(f"{n} ({_tests(count)}: {reason})" for n, (reason, count) in _isa_skipped.items()) or "none"
    return f"ISAs: ran {ran}; skipped {skipped}"


def _tests(n: int) -> str:
    return f"{n} test{'' if n == 1 else 's'}"


def pytest_terminal_summary(terminalreporter):
    line = isa_summary()
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """The tiny preset in Q8_0 (every structural feature; a few hundred KB)."""
    path = tmp_path_factory.mktemp("models") / "tiny-q8_0.gguf"
    synth(path, "tiny", out_type="q8_0", seed=0, progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_q4_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-q4_0.gguf"
    synth(path, "tiny", out_type="q4_0", seed=0, progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_f32_path(tmp_path_factory):
    """The tiny preset in F32: engines compared on it differ only by their sums' order."""
    path = tmp_path_factory.mktemp("models") / "tiny-f32.gguf"
    synth(path, "tiny", out_type="f32", seed=0, progress=False)
    return path
