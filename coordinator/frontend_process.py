"""`coordinator --http HOST:PORT`: the HTTP front end (frontend/, `python -m frontend`) as a
child process of the daemon.

The coordinator binds the listening socket itself (a port in use fails its start
with one clear error) and hands it to the child, which connects back to the
coordinator's client endpoint like any other client. A child that exits is
restarted on the same socket, within limits; the API key travels in the
environment, never on a command line other users can read.
"""
from __future__ import annotations

import logging
import subprocess
import sys

import zmq

from shared.http_options import API_KEY_ENV, bind_listeners, listen_url
from shared.parent import child_env

from .supervisor import RESTART_WINDOW_S, RestartBudget

log = logging.getLogger("fermoe.coordinator")


def client_endpoint(sock) -> str:
    """Where a local client reaches a ROUTER bound to a wildcard or a fixed address."""
    ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return ep.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")


class FrontEnd:
    def __init__(self, opts, connect: str, curve_key=None):
        """curve_key: with --curve-keys, the client pair it connects with."""
        self.opts, self.connect, self.curve_key = opts, connect, curve_key
        self.listeners = bind_listeners(opts.http, bool(opts.api_key))
        self.proc: subprocess.Popen | None = None
        self.restarts = RestartBudget()      # as the workers': past it, it is failing to start
        self.given_up = False

    def start(self) -> None:
        fds = [s.fileno() for s in self.listeners]
        cmd = [sys.executable, "-m", "frontend", "--connect", self.connect, "--listen-fd", ",".join(map(str, fds))]
        if self.opts.max_queue is not None:
            cmd += ["--max-queue", str(self.opts.max_queue)]
        cmd += ["--cors-origins", ",".join(self.opts.cors_origins), "--max-request-size",
                str(self.opts.max_request_size), "--reasoning-format", self.opts.reasoning_format]
        if self.curve_key:
            cmd += ["--curve-key", str(self.curve_key)]
        if self.opts.alias:
            cmd += ["--alias", self.opts.alias]
        if self.opts.tags:
            cmd += ["--tags", ",".join(self.opts.tags)]
        if not self.opts.slots:
            cmd += ["--no-slots"]
        env = child_env()
        env.pop(API_KEY_ENV, None)
        if self.opts.api_key:
            env[API_KEY_ENV] = self.opts.api_key
        # own session, as the workers: a Ctrl-C for the coordinator stops it in order
        self.proc = subprocess.Popen(cmd, pass_fds=fds, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("started the HTTP front end (pid %d) on %s", self.proc.pid,
                 ", ".join(listen_url(s) for s in self.listeners))

    def poll(self) -> None:
        if self.proc is None or self.proc.poll() is None or self.given_up:
            return
        log.error("the HTTP front end exited with status %d", self.proc.returncode)
        if not self.restarts.spend():
            log.error("the HTTP front end failed %d times within %.0f s; not restarting it",
                      len(self.restarts.times), RESTART_WINDOW_S)
            self.given_up = True
            return
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for s in self.listeners:
            s.close()
