"""Starts the workers (a CPU worker per NUMA node by default, each pinned to its node's
physical cores; a GPU worker per GPU of --gpu), notices when one exits, restarts it,
and stops them all."""
from __future__ import annotations

import logging
import subprocess
import sys
import time

from shared.parent import child_env
from shared.topology import numa_nodes, physical_cores

log = logging.getLogger("fermoe.coordinator")
# A child process that dies this often within the window is not restarted again:
# it is failing to start (bad model, no memory), and restarting would spin.
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0


class RestartBudget:
    """The restarts of one child within the last RESTART_WINDOW_S."""

    def __init__(self):
        self.times: list[float] = []

    def spend(self) -> bool:
        """Count a restart now; False when that is more than MAX_RESTARTS in the window."""
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < RESTART_WINDOW_S] + [now]
        return len(self.times) <= MAX_RESTARTS


def gpu_cores(opts) -> dict[str, list[int]]:
    """gpu worker id -> the physical core its host thread has to itself: the last ones of
    node 0, while the node keeps a core for each of its CPU workers (else none: it shares)."""
    nodes = numa_nodes()
    cores = physical_cores(nodes[min(nodes)]) if nodes else []
    gpus = getattr(opts, "gpus", [])
    if len(cores) - len(gpus) < opts.cpu_workers_per_socket:
        return {f"gpu{i}": [] for i in gpus}
    return {f"gpu{i}": [cores[len(cores) - len(gpus) + k]] for k, i in enumerate(gpus)}


def worker_plan(opts) -> dict[str, tuple[int, list[int]]]:
    """worker id -> (node, CPUs): each node's physical cores split among its CPU workers,
    but for the cores the GPU workers' host threads have (options.py has checked that
    every worker gets one at least)."""
    plan = {}
    per = opts.cpu_workers_per_socket
    taken = {c for cpus in gpu_cores(opts).values() for c in cpus}
    for node, cpus in numa_nodes().items():
        cores = [c for c in physical_cores(cpus) if c not in taken]
        for i in range(per):
            share = cores[i::per]
            if opts.threads_per_worker:
                share = (share * opts.threads_per_worker)[:opts.threads_per_worker]
            plan[f"cpu{node}.{i}"] = (node, share)
    return plan


class Supervisor:
    def __init__(self, opts, endpoint: str, shared_experts: str | None = None, curve_key=None):
        self.opts, self.endpoint = opts, endpoint
        # the experts' shared segment, when the coordinator packed one: every worker reads them there;
        # with --curve-keys, the worker pair they connect with (its path: the file is the owner's alone)
        self.common_args = (["--shared-experts", shared_experts] if shared_experts else []) + \
            (["--curve-key", str(curve_key)] if curve_key else [])
        self.procs: dict[str, subprocess.Popen] = {}
        self.plan = worker_plan(opts)
        self.gpu_plan = {f"gpu{i}": i for i in getattr(opts, "gpus", [])}
        self.gpu_cpus = gpu_cores(opts)
        self.restarts: dict[str, RestartBudget] = {}
        self.given_up: set[str] = set()
        self.asleep = False                 # its workers were stopped on purpose (--sleep-idle-seconds)

    def start(self, wid: str) -> None:
        if wid in self.gpu_plan:
            self._start_gpu(wid)
            return
        node, cpus = self.plan[wid]
        cmd = [sys.executable, "-m", "cpu_worker.worker", "--connect", self.endpoint, "--model",
               self.opts.model_path, "--worker-id", wid, "--threads", str(len(cpus)),
               "--cpus", ",".join(map(str, cpus)), "--node", str(node), "--engine", self.opts.engine,
               *self.common_args]
        if self.opts.numa_interleave:
            cmd.append("--numa-interleave")
        if getattr(self.opts, "decode", "cpu") != "cpu":
            cmd += ["--decode", self.opts.decode]
        if getattr(self.opts, "mmproj", None):
            cmd += ["--mmproj", self.opts.mmproj]
        # own session: a Ctrl-C meant for the coordinator must not kill the workers
        # before it can stop them in order
        self.procs[wid] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=child_env())
        log.info("started worker %s (pid %d) on node %d, CPUs %s", wid, self.procs[wid].pid, node, cpus)

    def _start_gpu(self, wid: str) -> None:
        cmd = [sys.executable, "-m", "gpu_worker.worker", "--connect", self.endpoint, "--model", self.opts.model_path,
               "--worker-id", wid, "--gpu", str(self.gpu_plan[wid]), *self.common_args]
        if self.opts.gpu_mem:
            cmd += ["--gpu-mem", self.opts.gpu_mem]
        if getattr(self.opts, "mmproj", None):
            cmd += ["--mmproj", self.opts.mmproj]
        cpus = self.gpu_cpus[wid]
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        self.procs[wid] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, env=child_env())
        log.info("started gpu worker %s (pid %d) on GPU %d, CPUs %s", wid, self.procs[wid].pid, self.gpu_plan[wid],
                 cpus or "shared")

    def start_all(self) -> None:
        for wid in [*self.plan, *self.gpu_plan]:
            self.start(wid)

    def reap(self) -> list[str]:
        """Workers of ours that have exited since the last call (not those put to sleep)."""
        gone = [wid for wid, p in self.procs.items() if p.poll() is not None]
        for wid in gone:
            code = self.procs.pop(wid).returncode
            if self.asleep:
                log.info("worker %s stopped (status %s): asleep", wid, code)
            else:
                log.error("worker %s exited with status %s", wid, code)
        return [] if self.asleep else gone

    def sleep(self) -> list[str]:
        """Asleep: the workers of ours (to be told to stop) exit without being restarted."""
        self.asleep = True
        return list(self.procs)

    def wake(self) -> None:
        """Start again every worker of ours that is not running (nor given up)."""
        self.asleep = False
        for wid in [*self.plan, *self.gpu_plan]:
            if wid not in self.procs and wid not in self.given_up:
                self.start(wid)

    def restart(self, wid: str) -> None:
        proc = self.procs.pop(wid, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if (wid not in self.plan and wid not in self.gpu_plan) or wid in self.given_up:
            return
        budget = self.restarts.setdefault(wid, RestartBudget())
        if not budget.spend():
            log.error("worker %s died %d times in %.0f s; not restarting it", wid, len(budget.times),
                      RESTART_WINDOW_S)
            self.given_up.add(wid)
            return
        self.start(wid)

    @property
    def all_given_up(self) -> bool:
        """Every CPU worker (the ones that decode) given up."""
        return bool(self.plan) and set(self.plan) <= self.given_up

    def stop_all(self, grace_s: float = 5.0) -> None:
        for wid, proc in self.procs.items():
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("worker %s did not stop; killing it", wid)
                proc.kill()
                proc.wait()
        self.procs.clear()
