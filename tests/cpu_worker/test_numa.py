"""NUMA placement on a two-socket machine that is not there: a fake sysfs tree (two
nodes of four cores, two hardware threads each), a recorded py-libnuma and a
recorded sched_setaffinity, so the two-socket code runs in CI on any machine.

Expected placements come from the tree's own description (which CPUs share a
core), never from the code under test."""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from coordinator import supervisor
from coordinator.options import parse_options
from coordinator.supervisor import Supervisor, worker_plan
from cpu_worker import numa_placement
from cpu_worker import worker as worker_module
from cpu_worker.native_engine import NativeEngine
from shared import topology
from shared.errors import FermoeError

# Two layouts of the same machine: Linux on Intel numbers a core's second thread
# n + 8 (node 0: 0-3,8-11); some firmware numbers a core's threads 2k, 2k + 1.
LAYOUTS = {
    "intel": {0: [(0, 8), (1, 9), (2, 10), (3, 11)], 1: [(4, 12), (5, 13), (6, 14), (7, 15)]},
    "adjacent": {0: [(0, 1), (2, 3), (4, 5), (6, 7)], 1: [(8, 9), (10, 11), (12, 13), (14, 15)]},
}


def cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8', as sysfs writes it."""
    runs, cpus = [], sorted(cpus)
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def write_sysfs(root: Path, nodes: dict[int, list[tuple[int, ...]]]) -> None:
    """/sys/devices/system as Linux lays it out: node<N>/cpulist, and each CPU's
    topology/thread_siblings_list (plus the files beside them that are no node)."""
    (root / "node").mkdir(parents=True)
    (root / "node" / "online").write_text(cpulist(nodes) + "\n")
    (root / "node" / "possible").write_text(cpulist(nodes) + "\n")
    for node, cores in nodes.items():
        (root / "node" / f"node{node}").mkdir()
        (root / "node" / f"node{node}" / "cpulist").write_text(cpulist(c for core in cores for c in core) + "\n")
        for core in cores:
            for cpu in core:
                d = root / "cpu" / f"cpu{cpu}" / "topology"
                d.mkdir(parents=True)
                (d / "thread_siblings_list").write_text(cpulist(core) + "\n")


class Machine:
    """The fake machine's description and what was done to the process on it."""

    def __init__(self, nodes):
        self.nodes = nodes
        self.affinity: list[tuple[int, list[int]]] = []      # sched_setaffinity(pid, cpus) calls
        self.numa: list[tuple[str, tuple]] = []              # py-libnuma memory policy calls

    def cpus(self, node) -> list[int]:
        return sorted(c for core in self.nodes[node] for c in core)

    def cores(self, node) -> list[int]:
        """The first hardware thread of each of the node's cores, from the layout itself."""
        return sorted(min(core) for core in self.nodes[node])


def recorded_numa(machine: Machine, max_node: int) -> types.ModuleType:
    """py-libnuma's `numa` package as place() uses it, recording instead of binding."""
    numa = types.ModuleType("numa")
    numa.info = types.SimpleNamespace(get_max_node=lambda: max_node)
    numa.memory = types.SimpleNamespace(
        set_membind_nodes=lambda *nodes: machine.numa.append(("membind", nodes)),
        set_interleave_nodes=lambda *nodes: machine.numa.append(("interleave", nodes)))
    return numa


def install(monkeypatch, tmp_path, nodes, allowed=None) -> Machine:
    """Point topology at a fake tree, the process's CPUs at the fake machine's (or
    `allowed`), py-libnuma at a recorder, and sched_setaffinity at another."""
    machine = Machine(nodes)
    write_sysfs(tmp_path / "sys", nodes)
    every = sorted(c for cores in nodes.values() for core in cores for c in core)
    monkeypatch.setattr(topology, "SYS", tmp_path / "sys")
    monkeypatch.setattr(topology, "_PROCESS_CPUS", tuple(allowed if allowed is not None else every))
    monkeypatch.setitem(sys.modules, "numa", recorded_numa(machine, max(nodes)))
    monkeypatch.setattr(numa_placement.os, "sched_setaffinity", lambda pid, cpus: machine.affinity.append(
        (pid, list(cpus))))
    return machine


@pytest.fixture(params=sorted(LAYOUTS))
def machine(request, monkeypatch, tmp_path):
    return install(monkeypatch, tmp_path, LAYOUTS[request.param])


def test_the_recorded_libnuma_has_the_real_packages_api():
    """The names and signatures the recorder stands in for, read from py-libnuma's
    source (not imported: that loads libnuma)."""
    spec = importlib.util.find_spec("numa")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("py-libnuma is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    for module, name, varargs in [("info", "get_max_node", False), ("memory", "set_membind_nodes", True),
                                  ("memory", "set_interleave_nodes", True)]:
        tree = ast.parse((root / f"{module}.py").read_text())
        fn = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name), None)
        assert fn is not None, f"numa.{module}.{name}"
        assert not fn.args.args and (fn.args.vararg is not None) == varargs, f"numa.{module}.{name}"


# ---------------------------------------------------------------- topology

def test_topology_reads_the_nodes_and_their_physical_cores(machine):
    assert topology.numa_nodes() == {n: machine.cpus(n) for n in machine.nodes}
    for node in machine.nodes:
        assert topology.physical_cores(machine.cpus(node)) == machine.cores(node)   # no hyper-thread sibling
    assert topology.default_cpus() == machine.cores(0) and topology.default_cpus(1) == machine.cores(1)


def test_topology_keeps_to_the_cpus_this_process_may_use(monkeypatch, tmp_path):
    """A cpuset that leaves node 1 one hardware thread: node 1 is that one core;
    one that leaves it none: node 1 is not there."""
    nodes = LAYOUTS["intel"]
    install(monkeypatch, tmp_path, nodes, allowed=[0, 1, 2, 3, 8, 9, 10, 11, 12])
    assert topology.numa_nodes() == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [12]}
    assert topology.physical_cores([12]) == [12]
    monkeypatch.setattr(topology, "_PROCESS_CPUS", (0, 8, 1))
    assert topology.numa_nodes() == {0: [0, 1, 8]} and topology.default_cpus() == [0, 1]


def test_a_machine_without_node_directories_is_one_node(monkeypatch, tmp_path):
    """No sysfs node tree (some containers): one node of every allowed CPU, each its
    own core where no topology says otherwise."""
    monkeypatch.setattr(topology, "SYS", tmp_path / "empty")
    monkeypatch.setattr(topology, "_PROCESS_CPUS", (0, 1, 2))
    assert topology.numa_nodes() == {0: [0, 1, 2]} and topology.default_cpus() == [0, 1, 2]


# ---------------------------------------------------------------- the coordinator's plan

def _opts(*argv):
    return parse_options(["--model", "unused.gguf", *argv])


def test_the_default_plan_is_one_worker_per_node_on_its_physical_cores(machine):
    assert worker_plan(_opts()) == {"cpu0.0": (0, machine.cores(0)), "cpu1.0": (1, machine.cores(1))}


@pytest.mark.parametrize("per", [2, 3, 4])
def test_workers_per_socket_split_each_nodes_cores(machine, per):
    plan = worker_plan(_opts("--cpu-workers-per-socket", str(per)))
    assert sorted(plan) == sorted(f"cpu{n}.{i}" for n in machine.nodes for i in range(per))
    for node in machine.nodes:
        shares = [cpus for wid, (n, cpus) in plan.items() if n == node and wid.startswith(f"cpu{node}.")]
        assert len(shares) == per
        assert sorted(c for share in shares for c in share) == machine.cores(node)    # each core once
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_threads_per_worker_takes_that_many_of_the_nodes_cores(machine):
    plan = worker_plan(_opts("--threads-per-worker", "2"))
    for wid, (node, cpus) in plan.items():
        assert len(cpus) == 2 and set(cpus) <= set(machine.cores(node))


def test_more_workers_per_socket_than_physical_cores_is_refused(machine):
    assert len(worker_plan(_opts("--cpu-workers-per-socket", "4"))) == 8
    # 5 workers would fit the node's 8 hardware threads, not its 4 cores
    with pytest.raises(FermoeError, match="--cpu-workers-per-socket 5: node 0 has 4 physical cores"):
        _opts("--cpu-workers-per-socket", "5")


# ---------------------------------------------------------------- supervisor -> worker -> place()

class _Started:
    """What the supervisor's Popen was asked to run."""

    def __init__(self):
        self.commands = []

    def Popen(self, cmd, **kw):
        self.commands.append(cmd)
        return types.SimpleNamespace(pid=1000 + len(self.commands), poll=lambda: None)


class _Worker:
    """CPUWorker as run_cpu_worker builds it, recording its arguments."""
    made = []

    def __init__(self, model_path, connect, worker_id, threads, engine="cpu", cpus=None, shared_memory=True,
                 shared_experts=None, mmproj=None, curve_key=None, decode="cpu"):
        _Worker.made.append(dict(worker_id=worker_id, threads=threads, cpus=cpus, engine=engine))

    def event_loop(self):
        pass

    def close(self):
        pass


def _run_workers_the_supervisor_starts(monkeypatch, argv):
    """parse_options -> Supervisor.start_all -> each command line, run in this process
    as `python -m cpu_worker.worker` would run it, up to its event loop."""
    started = _Started()
    monkeypatch.setattr(supervisor, "subprocess", types.SimpleNamespace(Popen=started.Popen,
                                                                        DEVNULL=subprocess.DEVNULL))
    monkeypatch.setattr(worker_module, "CPUWorker", _Worker)
    import shared.worker_link
    monkeypatch.setattr(shared.worker_link, "signal", types.SimpleNamespace(signal=lambda *a: None, SIGTERM=15))
    _Worker.made = []
    Supervisor(_opts(*argv), "tcp://127.0.0.1:9").start_all()
    for cmd in started.commands:
        assert cmd[:3] == [sys.executable, "-m", "cpu_worker.worker"]
        assert worker_module.main(cmd[3:]) == 0
    return started.commands


@pytest.mark.parametrize("interleave", [False, True])
def test_each_worker_the_supervisor_starts_is_pinned_and_its_memory_placed(machine, monkeypatch, interleave):
    """Each worker runs on its own node's physical cores with that many threads, its
    memory bound to its node; with --numa-interleave the flag reaches every worker's
    command line and place() interleaves over all the nodes instead."""
    argv = ["--numa-interleave"] if interleave else []
    commands = _run_workers_the_supervisor_starts(monkeypatch, argv)
    assert len(commands) == 2 and all(("--numa-interleave" in c) == interleave for c in commands)
    assert machine.affinity == [(0, machine.cores(0)), (0, machine.cores(1))]
    every = tuple(sorted(machine.nodes))
    assert machine.numa == ([("interleave", every)] * 2 if interleave else [("membind", (0,)), ("membind", (1,))])
    assert _Worker.made == [dict(worker_id=f"cpu{n}.0", threads=len(machine.cores(n)), cpus=machine.cores(n),
                                 engine="cpu") for n in sorted(machine.nodes)]


def test_split_workers_are_pinned_to_their_share(machine, monkeypatch):
    _run_workers_the_supervisor_starts(monkeypatch, ["--cpu-workers-per-socket", "2"])
    plan = worker_plan(_opts("--cpu-workers-per-socket", "2"))
    assert machine.affinity == [(0, cpus) for _, cpus in plan.values()]
    assert machine.numa == [("membind", (node,)) for node, _ in plan.values()]


def test_place_without_libnuma_still_pins(machine, monkeypatch):
    monkeypatch.setitem(sys.modules, "numa", None)          # import numa -> ImportError
    said = numa_placement.place(1, machine.cores(1), interleave=True)
    assert machine.affinity == [(0, machine.cores(1))] and machine.numa == []
    assert "memory policy unchanged (libnuma unavailable" in said


def test_a_worker_refuses_a_node_or_cpus_this_machine_lacks(machine, capsys):
    base = ["--connect", "tcp://127.0.0.1:9", "--model", "unused.gguf"]
    assert worker_module.main(base + ["--node", "2"]) == 1
    assert capsys.readouterr().err.strip() == "cpu_worker: error: --node 2: this machine's NUMA nodes are [0, 1]"
    assert worker_module.main(base + ["--cpus", "3,16"]) == 1
    assert "cpu_worker: error: --cpus 3,16: [16] not among the CPUs" in capsys.readouterr().err
    assert machine.affinity == [] and machine.numa == []


# ---------------------------------------------------------------- the engine's default threads

@pytest.mark.parametrize("nodes, want", [
    ({0: [(0, 1)]}, [0]),                  # this machine's two CPUs as one core's threads: one thread
    ({0: [(1,)], 1: [(0,)]}, [1]),         # the first node's cores, not every CPU
])
def test_the_engine_defaults_to_the_first_nodes_physical_cores(monkeypatch, tmp_path, tiny_q4_path, nodes, want):
    """`--engine cpu` without --threads: one thread on each physical core of the first
    node (the fake tree is laid over this machine's two CPUs, which the pool pins)."""
    from shared.model import Model
    pytest.importorskip("native", reason="the native extension is not built", exc_type=ImportError)
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        pytest.skip("needs CPUs 0 and 1")
    install(monkeypatch, tmp_path, nodes, allowed=[0, 1])
    cpu = NativeEngine(Model(tiny_q4_path))
    try:
        assert cpu.cpus == want and cpu.threads == len(want)
    finally:
        cpu.close()


def test_py_libnuma_without_libnuma_still_pins_the_cpus(monkeypatch, tmp_path):
    """py-libnuma installed but libnuma.so missing: its import fails with AttributeError
    (a symbol ctypes cannot find). The worker pins its CPUs and says so; it does not die."""
    package = tmp_path / "numa"
    package.mkdir()
    (package / "__init__.py").write_text("raise AttributeError('/lib/libnuma.so.1: undefined symbol: numa_available')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "numa", raising=False)
    pinned = []
    monkeypatch.setattr(numa_placement.os, "sched_setaffinity", lambda pid, cpus: pinned.append(list(cpus)))
    line = numa_placement.place(0, [0, 1])
    assert pinned == [[0, 1]] and "libnuma unavailable" in line and "numa_available" in line


def test_a_gpu_workers_host_thread_has_a_core_of_its_own(machine, monkeypatch):
    """With a GPU, node 0's last physical core goes to the gpu worker's host thread and
    no CPU worker decodes on it; where a node has no core to spare, the gpu worker shares."""
    from coordinator.supervisor import gpu_cores
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    opts = _opts("--gpu", "0")
    spare = machine.cores(0)[-1]
    assert gpu_cores(opts) == {"gpu0": [spare]}
    assert worker_plan(opts) == {"cpu0.0": (0, machine.cores(0)[:-1]), "cpu1.0": (1, machine.cores(1))}
    per = str(len(machine.cores(0)))                 # every core of node 0 taken by a CPU worker
    assert gpu_cores(_opts("--gpu", "0", "--cpu-workers-per-socket", per)) == {"gpu0": []}
    assert gpu_cores(_opts("--gpu", "none")) == {}
