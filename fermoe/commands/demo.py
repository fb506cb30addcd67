"""`fermoe demo`: the daemon path end to end. A coordinator started on a model, one prompt's
continuation streamed (or, with --agent, a tool loop: fermoe/agent_demo.py), the coordinator
stopped."""
from __future__ import annotations

import sys

from shared.errors import FermoeError

from .common import add_model_name, add_prompt, escaped, max_tokens_of, notices, stream, summary

NAME = "demo"
AGENT_QUESTION = "What does json.dumps do?"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="start a coordinator on a model, stream one prompt's continuation (or run "
                                  "a tool loop: --agent), stop",
                       description="Start a coordinator on a model, print a prompt and its continuation as it "
                                   "streams (greedy), say why it stopped, and stop the coordinator. With --agent "
                                   "the prompt is a question asked in a chat that offers a pydoc tool, run here "
                                   "with Python's pydoc whenever the model calls it.")
    add_model_name(p)
    add_prompt(p)
    p.add_argument("--agent", action="store_true",
                   help=f"a tool loop: the model may call pydoc (default prompt: {AGENT_QUESTION!r})")
    p.add_argument("-n", "--n-predict", type=int, default=None, help="tokens to generate (default 32, with "
                   "--agent 128 a reply; -1: until end of generation or of the context)")
    p.add_argument("--addr", default=None, help="where its coordinator listens (default: a free loopback port; "
                                                "an address another process listens on is refused)")


def run(args) -> None:
    """The daemon path end to end: coordinator up, one streamed request, clean stop. The
    coordinator's log goes to a file, shown only if it fails: the output is the prompt,
    its continuation and why it stopped."""
    import tempfile

    from coordinator.client import Client
    from coordinator.launcher import last_words, start_coordinator, stop_coordinator
    from shared.builtin import resolve_model
    from shared.gguf_file import GGUFFile

    if args.n_predict is None:
        args.n_predict = 128 if args.agent else 32
    max_tokens = max_tokens_of(args)
    if args.prompt is None:
        args.prompt = AGENT_QUESTION if args.agent else "This module provides"
    escaped(args)
    path = resolve_model(args.model)
    try:
        metadata = GGUFFile(path).metadata
    except OSError as e:
        raise FermoeError(f"{args.model}: {e.strerror or e}") from None
    notices(args, metadata)
    args.addr = _own_address(args.addr)
    with tempfile.TemporaryFile("w+") as log:
        daemon = start_coordinator(args.model, args.addr, ["--snapshot-mem", "64MiB"], log)
        try:
            with Client(args.addr) as client:
                try:
                    client.wait_ready(300, alive=lambda: daemon.poll() is None)
                except FermoeError as e:
                    last = last_words(log)
                    raise FermoeError(f"{e}" + (f": {last}" if last else "")) from None
                if args.agent:
                    _agent(client, args.prompt, max_tokens, metadata)
                else:
                    sys.stdout.write(args.prompt)
                    stream(client, client.submit(args.prompt, max_tokens=max_tokens, temperature=0.0), max_tokens)
        finally:
            stop_coordinator(daemon)
        if daemon.returncode != 0:
            last = last_words(log)
            raise FermoeError(f"the coordinator exited with status {daemon.returncode}" + (f": {last}" if last else ""))


def _own_address(addr: str | None) -> str:
    """Where the demo's own coordinator listens: a free loopback port, or `addr` when no
    process listens there already (the demo would talk to that one, on another model maybe)."""
    import socket

    from coordinator.launcher import free_port
    if addr is None:
        return f"tcp://127.0.0.1:{free_port()}"
    host, sep, port = addr.removeprefix("tcp://").rpartition(":")
    if addr.startswith("tcp://") and sep and port.isdigit():
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
            s.settimeout(1.0)
            if s.connect_ex((host.strip("[]"), int(port))) == 0:
                raise FermoeError(f"--addr {addr}: another process listens there already (a coordinator of its "
                                  "own?); leave --addr out to use a free port")
    return addr


def _agent(client, question: str, max_tokens: int | None, metadata: dict) -> None:
    from fermoe.agent_demo import run
    from shared.chat import opens_reasoning
    from shared.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_metadata(metadata)
    if not tokenizer.chat_template:
        raise FermoeError("--agent needs a model with a chat template (tokenizer.chat_template)")
    run(client, question, max_tokens, opens_reasoning(tokenizer), lambda done: summary(done, max_tokens))
