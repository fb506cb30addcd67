"""The HTTP front end's options, as `coordinator` and `fermoe serve` take them, and the
listening socket (bound by whoever is started with --http, so that a port in use is
one clear error at start, and a restarted front end serves the same socket). Here in
shared/ because both processes read them: the daemon, which binds the socket and starts
the front end (coordinator/frontend_process.py), and the front end (frontend/)."""
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
DEFAULT_CORS = "*"
DEFAULT_MAX_REQUEST = "64MiB"
# --reasoning-format: llama-server's names, and `both` for clients written against vLLM
REASONING_FORMATS = ("deepseek", "auto", "none", "both")


def add_http_options(p: argparse.ArgumentParser, standalone: bool = False) -> None:
    """--http, --api-key, --max-queue, --alias, --cors-origins, --reasoning-format, --max-request-size (and --connect
    for a front end of its own)."""
    g = p.add_argument_group("HTTP API (OpenAI-compatible)")
    if standalone:
        g.add_argument("--connect", default="tcp://127.0.0.1:5557", help="the coordinator's client endpoint")
        g.add_argument("--curve-key", default=None, metavar="FILE",
                       help="a client key file (clients/NAME.key_secret of `fermoe keys`), for a coordinator "
                            "started with --curve-keys")
    g.add_argument("--http", metavar="HOST:PORT", default=DEFAULT_HTTP if standalone else None,
                   help=f"serve the OpenAI-compatible HTTP API here, or at each of a comma list of them (loopback "
                        f"unless told otherwise"
                        f"{'; default ' + DEFAULT_HTTP if standalone else ', e.g. ' + DEFAULT_HTTP})")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health, the chat page and "
                        f"its icon, and CORS preflights (default: ${API_KEY_ENV})")
    g.add_argument("--max-queue", type=int, default=None,
                   help="answer 503 with Retry-After while this many requests wait for their first token")
    g.add_argument("-a", "--alias", default=None,
                   help="the model's name in the API, as llama-server's --alias: one, or a comma-separated list "
                        "(each listed in /v1/models; the first is the name replies carry) (default: "
                        + ("the coordinator's" if standalone else "--model as given") +
                        "); whatever name a request gives, the one model served answers it")
    g.add_argument("--tags", default=None, metavar="LIST",
                   help="comma-separated tags listed with the model in /v1/models (llama-server's)")
    g.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="serve GET /slots (the default, as llama-server's)")
    g.add_argument("--no-slots", dest="slots", action="store_false",
                   help="answer GET /slots with 501, as llama-server started with --no-slots")
    g.add_argument("--cors-origins", metavar="ORIGINS", default=None,
                   help=f"origins whose web pages may call the API: a comma-separated list "
                        f"(e.g. http://localhost:3000; localhost: any loopback origin), or * for any (default {DEFAULT_CORS}, as llama-server and "
                        f"vLLM); an empty value ('') turns CORS off")
    g.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="deepseek",
                   help="where a chat's reasoning goes: deepseek (default; `auto` is the same), as llama-server: "
                        "message.reasoning_content, delta.reasoning_content; both: there and under `reasoning`, "
                        "vLLM's name; none: left in the content, <think> tags and all. A request's "
                        "reasoning_format overrides it")
    g.add_argument("--max-request-size", metavar="SIZE", default=None,
                   help=("the largest HTTP request body taken (the coordinator's own --max-request-size bounds "
                         "the messages it takes)" if standalone else
                         "the largest request taken, as an HTTP body and as a client's message over ZeroMQ")
                        + f" (default {DEFAULT_MAX_REQUEST}: a prompt of a whole 262144-token context, as JSON text, "
                          f"fits many times over)")


def check_http_options(opts) -> None:
    if opts.max_queue is not None and opts.max_queue < 1:
        raise FermoeError(f"--max-queue {opts.max_queue}: must be >= 1")
    if opts.http is None and opts.max_queue is not None:
        raise FermoeError("--max-queue needs --http")
    if opts.api_key is not None and not opts.api_key.strip():
        raise FermoeError("--api-key: empty")
    if opts.http is None and opts.cors_origins is not None:
        raise FermoeError("--cors-origins needs --http")
    opts.cors_origins = parse_origins(DEFAULT_CORS if opts.cors_origins is None else opts.cors_origins)
    if opts.alias is not None and not opts.alias.strip():
        raise FermoeError("--alias: empty")
    opts.max_request_size = parse_request_size(opts.max_request_size or DEFAULT_MAX_REQUEST)
    if opts.alias is not None:
        opts.alias = ",".join(name.strip() for name in opts.alias.split(",") if name.strip())
    opts.tags = [t.strip() for t in (opts.tags or "").split(",") if t.strip()]
    if opts.http is not None:
        for address in opts.http.split(","):
            parse_listen(address)


def bind_listeners(text: str, has_key: bool = False) -> list[socket.socket]:
    """One listening socket for each HOST:PORT of a comma list (llama-server's several --host)."""
    socks: list[socket.socket] = []
    try:
        for address in text.split(","):
            socks.append(bind_listener(address, has_key))
    except FermoeError:
        for s in socks:
            s.close()
        raise
    return socks


def parse_request_size(text: str) -> int:
    from shared.options import parse_size
    try:
        size = parse_size(text)
    except FermoeError as e:
        raise FermoeError(f"--max-request-size: {e}") from None
    if size < 1024:
        raise FermoeError(f"--max-request-size {text}: must be at least 1KiB")
    return size


def parse_origins(text: str) -> tuple[str, ...]:
    """--cors-origins: () off, ("*",) any, else the origins as browsers send them (no trailing /);
    `localhost` among them stands for every loopback origin, any port (llama-server's)."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if "*" in origins and len(origins) > 1:
        raise FermoeError(f"--cors-origins {text!r}: * stands alone")
    for o in origins:
        if o not in ("*", "localhost") and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+", o):
            raise FermoeError(f"--cors-origins {text!r}: {o!r} is not an origin (scheme://host[:port])")
    return origins


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
        if family == socket.AF_INET6:           # [::] beside 0.0.0.0 on one port, as two listeners
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
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
