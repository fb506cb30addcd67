"""`fermoe serve`: the OpenAI-compatible HTTP API for a running coordinator (its options and
its server are the HTTP front end's)."""
from __future__ import annotations

NAME = "serve"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="OpenAI-compatible HTTP API for a running coordinator",
                       description="Serve the OpenAI-compatible HTTP API for a running coordinator (or start "
                                   "the coordinator with --http).")
    from shared.http_options import add_http_options
    add_http_options(p, standalone=True)


def run(args) -> None:
    from frontend.server import run
    run(args)
