"""Starts the CPU workers (one per NUMA node by default, each pinned to its node's
physical cores), notices when one exits, restarts it, and stops them all."""
from __future__ import annotations

import logging
import subprocess
import sys

from cpu_worker.topology import numa_nodes, physical_cores

log = logging.getLogger("fermoe.coordinator")


class Supervisor:
    def __init__(self, opts, endpoint: str):
        self.opts, self.endpoint = opts, endpoint
        self.procs: dict[str, subprocess.Popen] = {}
        self.plan = self._plan()

    def _plan(self) -> dict[str, tuple[int, list[int]]]:
        """worker id -> (node, CPUs): the node's physical cores split among its workers."""
        plan = {}
        per = self.opts.cpu_workers_per_socket
        for node, cpus in numa_nodes().items():
            cores = physical_cores(cpus)
            for i in range(per):
                share = cores[i::per] or cores
                if self.opts.threads_per_worker:
                    share = (share * self.opts.threads_per_worker)[:self.opts.threads_per_worker]
                plan[f"cpu{node}.{i}"] = (node, share)
        return plan

    def start(self, wid: str) -> None:
        node, cpus = self.plan[wid]
        cmd = [sys.executable, "-m", "cpu_worker.worker", "--connect", self.endpoint, "--model",
               self.opts.model_path, "--worker-id", wid, "--threads", str(len(cpus)),
               "--cpus", ",".join(map(str, cpus)), "--node", str(node), "--engine", self.opts.engine]
        if self.opts.numa_interleave:
            cmd.append("--numa-interleave")
        self.procs[wid] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        log.info("started worker %s (pid %d) on node %d, CPUs %s", wid, self.procs[wid].pid, node, cpus)

    def start_all(self) -> None:
        for wid in self.plan:
            self.start(wid)

    def reap(self) -> list[str]:
        """Workers of ours that have exited since the last call."""
        gone = [wid for wid, p in self.procs.items() if p.poll() is not None]
        for wid in gone:
            log.error("worker %s exited with status %s", wid, self.procs.pop(wid).returncode)
        return gone

    def restart(self, wid: str) -> None:
        proc = self.procs.pop(wid, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if wid in self.plan:
            self.start(wid)

    def stop_all(self, grace_s: float = 5.0) -> None:
        for wid, proc in self.procs.items():
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("worker %s did not stop; killing it", wid)
                proc.kill()
                proc.wait()
        self.procs.clear()
