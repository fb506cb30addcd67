"""The HTTP front end's options, as `coordinator` and `fermoe serve` take them, and the
listening socket (bound by whoever is started with --http, so that a port in use is
one clear error at start, and a restarted front end serves the same socket)."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import socket

from shared.errors import FermoeError

log = logging.getLogger("fermoe.http")
DEFAULT_HTTP = "127.0.0.1:8080"
API_KEY_ENV = "FERMOE_API_KEY"


def add_http_options(p: argparse.ArgumentParser, standalone: bool = False) -> None:
    """--http, --api-key, --max-queue (and --connect for a front end of its own)."""
    g = p.add_argument_group("HTTP API (OpenAI-compatible)")
    if standalone:
        g.add_argument("--connect", default="tcp://127.0.0.1:5557", help="the coordinator's client endpoint")
    g.add_argument("--http", metavar="HOST:PORT", default=DEFAULT_HTTP if standalone else None,
                   help=f"serve the OpenAI-compatible HTTP API here (loopback unless told otherwise"
                        f"{'; default ' + DEFAULT_HTTP if standalone else ', e.g. ' + DEFAULT_HTTP})")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health and the chat page "
                        f"(default: ${API_KEY_ENV})")
    g.add_argument("--max-queue", type=int, default=None,
                   help="answer 503 with Retry-After while this many requests wait for their first token")


def check_http_options(opts) -> None:
    if opts.max_queue is not None and opts.max_queue < 1:
        raise FermoeError(f"--max-queue {opts.max_queue}: must be >= 1")
    if opts.http is None and opts.max_queue is not None:
        raise FermoeError("--max-queue needs --http")
    if opts.api_key is not None and not opts.api_key.strip():
        raise FermoeError("--api-key: empty")
    if opts.http is not None:
        parse_listen(opts.http)


def parse_listen(text: str) -> tuple[str, int]:
    """'127.0.0.1:8080', '[::1]:8080', 'localhost:8080' or a port alone (loopback)."""
    m = re.fullmatch(r"(?:\[([0-9a-fA-F:.]+)\]|([^:\[\]]*)):(\d+)|(\d+)", text.strip())
    if not m:
        raise FermoeError(f"--http {text!r}: expected HOST:PORT (e.g. {DEFAULT_HTTP}) or a port")
    host = m.group(1) or m.group(2) or "127.0.0.1"
    port = int(m.group(3) or m.group(4))
    if not 0 <= port < 65536:
        raise FermoeError(f"--http {text!r}: port {port} is out of range")
    return host, port


def bind_listener(text: str, has_key: bool = False) -> socket.socket:
    host, port = parse_listen(text)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise FermoeError(f"--http {text}: cannot listen there: {e.strerror or e}") from None
    if not _is_loopback(addr[0]):
        log.warning("the HTTP API listens on %s, which is not a loopback address%s", text,
                    "" if has_key else " (consider --api-key)")
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"
