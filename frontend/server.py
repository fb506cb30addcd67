"""`fermoe serve --connect ADDR --http HOST:PORT`: the HTTP front end as a process of its
own (also what `coordinator --http` starts beside itself, handing it the socket)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import sys

import zmq

from shared.curve import client_keys
from shared.errors import FermoeError
from shared.http_options import add_http_options, bind_listeners, check_http_options, listen_url

log = logging.getLogger("fermoe.http")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fermoe serve", description="OpenAI-compatible HTTP API for a coordinator")
    add_http_options(p, standalone=True)
    p.add_argument("--listen-fd", default=None, help=argparse.SUPPRESS)   # from coordinator --http: fds, comma list
    return p


def _check_endpoint(addr: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(addr)
    except zmq.ZMQError as e:
        raise FermoeError(f"--connect {addr!r}: {e}") from None
    finally:
        sock.close(linger=0)


def _quiet_server(config):
    """uvicorn's Server, stopping on SIGINT/SIGTERM with status 0 as the coordinator does
    (uvicorn itself re-raises the signal once it has shut down)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server(config)


def run(opts) -> int:
    """Serve until SIGINT/SIGTERM (uvicorn's own handlers stop it gracefully)."""
    import prometheus_client
    import uvicorn

    from .app import build_app
    from .core import Settings

    prometheus_client.disable_created_metrics()     # a *_created sample beside every counter says nothing here
    logging.basicConfig(level=logging.INFO, format="%(asctime)s http %(levelname)s %(message)s", stream=sys.stderr)
    check_http_options(opts)
    _check_endpoint(opts.connect)
    client_keys(opts.curve_key)         # a bad key file: one error at start
    fds = getattr(opts, "listen_fd", None)
    socks = [socket.socket(fileno=int(fd)) for fd in fds.split(",")] if fds is not None else \
        bind_listeners(opts.http, bool(opts.api_key))
    app = build_app(Settings(connect=opts.connect, api_key=opts.api_key, max_queue=opts.max_queue, alias=opts.alias,
                             cors_origins=opts.cors_origins, max_request_size=opts.max_request_size,
                             reasoning_format=opts.reasoning_format, curve_key=opts.curve_key, tags=tuple(opts.tags),
                             slots=opts.slots))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=3)
    log.info("HTTP API on %s for the coordinator at %s%s", ", ".join(listen_url(s) for s in socks), opts.connect,
             ", API key required" if opts.api_key else "")
    _quiet_server(config).run(sockets=socks)
    return 0


def main(argv=None) -> int:
    from shared.parent import die_with_parent
    die_with_parent()                   # a coordinator's front end goes with it
    try:
        return run(build_parser().parse_args(argv))
    except FermoeError as e:
        print(f"fermoe serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
