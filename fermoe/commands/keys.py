"""`fermoe keys`: ZeroMQ CURVE key pairs for a coordinator's --curve-keys (shared/curve.py)."""
from __future__ import annotations

import sys

NAME = "keys"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="write ZeroMQ CURVE key pairs for a coordinator's --curve-keys",
                       description="Write ZeroMQ CURVE key pairs into DIR (made, mode 0700): the coordinator's "
                                   "(server.key, server.key_secret; kept if DIR has them), and a pair for each "
                                   "worker and client name under DIR/workers and DIR/clients (secret files mode "
                                   "0600). A coordinator started with --curve-keys DIR takes only those keys; a "
                                   "worker or client connects with its one NAME.key_secret file (--curve-key), "
                                   "which also holds the coordinator's public key.")
    p.add_argument("dir", help="the keys directory")
    p.add_argument("--worker", action="append", default=None, metavar="NAME",
                   help="a worker pair to write, e.g. one per host (repeatable; with neither --worker nor --client: "
                        "worker, the pair the coordinator's own workers use, and client)")
    p.add_argument("--client", action="append", default=None, metavar="NAME",
                   help="a client pair to write (repeatable; `client` is the pair the coordinator's own HTTP front "
                        "end uses)")
    p.add_argument("--force", action="store_true", help="replace the named pairs that exist (their old keys stop "
                                                        "working)")


def run(args) -> None:
    from shared.curve import write_keys
    # named pairs only: what is not named is not written (a first run gets the two the coordinator needs)
    first = args.worker is None and args.client is None
    workers = args.worker or (["worker"] if first else [])
    clients = args.client or (["client"] if first else [])
    for path in write_keys(args.dir, workers, clients, force=args.force):
        print(f"wrote {path}", file=sys.stderr)
