"""`fermoe submit`: a prompt sent to a running coordinator, its reply streamed."""
from __future__ import annotations

from .common import add_n_predict, add_prompt, add_sampling, escaped, max_tokens_of, sampling_of, stream

NAME = "submit"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="send a prompt to a running coordinator and stream the reply",
                       description="Send a prompt to a running coordinator (started with `coordinator --model "
                                   "MODEL`) and stream the reply; a summary line on stderr says why it stopped.")
    p.add_argument("--addr", default="tcp://127.0.0.1:5557", help="coordinator address (default: loopback 5557)")
    p.add_argument("--curve-key", default=None, metavar="FILE",
                   help="a client key file (clients/NAME.key_secret of `fermoe keys`), for a coordinator started "
                        "with --curve-keys")
    add_prompt(p, required=True)
    add_n_predict(p)
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message (model's template)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string, with escapes as -p (repeatable), e.g. --stop '\n\n'")
    p.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for the coordinator")
    add_sampling(p)


def run(args) -> None:
    from coordinator.client import Client

    max_tokens = max_tokens_of(args)
    escaped(args)
    with Client(args.addr, curve_key=args.curve_key) as client:
        if args.wait:
            client.wait_ready(args.wait)
        else:
            client.status(timeout_s=5.0)    # nothing there: one clear error now, not after minutes
        kwargs = dict(messages=[{"role": "user", "content": args.prompt}]) if args.chat else dict(prompt=args.prompt)
        rid = client.submit(max_tokens=max_tokens, sampling=sampling_of(args), stop=args.stop,
                            ignore_eos=args.ignore_eos, **kwargs)
        stream(client, rid, max_tokens)
