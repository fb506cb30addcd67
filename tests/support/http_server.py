"""What the HTTP tests share: a coordinator started with --http (the real processes:
daemon, worker, uvicorn front end on a free loopback port), a standalone
`fermoe serve`, an SSE reader, and the served text computed independently in
this process with the same engine and sampler."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx

from shared.model import Model
from shared.tokenizer import StreamDecoder
from tests.support.serving_harness import BLOCK, free_port, local_ids, unpinned

START_TIMEOUT_S = 120       # a loaded 2-core machine starts four Python processes slowly


class Process:
    """A child process whose stderr is kept (for failure messages) and that is stopped by its id."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                     preexec_fn=unpinned)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def wait_http(self, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode}: {''.join(self.log[-20:])}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{url} not healthy within {timeout_s} s: {''.join(self.log[-20:])}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


class HttpDaemon(Process):
    """`coordinator --model M --http 127.0.0.1:PORT`: the daemon starts the front end itself."""

    def __init__(self, model, *extra):
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{free_port()}"
        super().__init__([sys.executable, "-m", "coordinator.daemon", "--model", str(model), "--bind", self.addr,
                          "--snapshot-mem", "32MiB", "--block", str(BLOCK), "--threads-per-worker", "1",
                          "--http", self.url.removeprefix("http://"), *extra])
        self.wait_http(self.url)


class Serve(Process):
    """`fermoe serve --connect ADDR --http 127.0.0.1:PORT [options]`: a front end of its own."""

    def __init__(self, connect: str, *extra):
        self.url = f"http://127.0.0.1:{free_port()}"
        super().__init__([sys.executable, "-m", "fermoe.cli", "serve", "--connect", connect,
                          "--http", self.url.removeprefix("http://"), *extra])


def sse_events(response: httpx.Response) -> list[str]:
    """The data of each server-sent event, checking the framing: 'data: ...' lines, a blank line after each."""
    raw = "".join(response.iter_text())
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
    return [e[len("data: "):] for e in events]


class LocalEngine:
    """The served text, computed here: the same tokenizer, chat template, engine and
    sampler (serving_harness.local_ids, which closes each engine it makes)."""

    def __init__(self, model_path):
        self.model_path = model_path
        self.tok = Model(model_path).tokenizer

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(self.tok.apply_chat_template(messages))

    def text(self, ids: list[int], max_tokens: int, ignore_eos: bool = False, **sampling) -> tuple[str, int]:
        """(text, completion tokens) as the coordinator streams them: end-of-generation tokens end it, unsent."""
        pieces, n = self.pieces(ids, max_tokens, ignore_eos, **sampling)
        return "".join(pieces), n

    def pieces(self, ids: list[int], max_tokens: int, ignore_eos: bool = False, **sampling) -> tuple[list[str], int]:
        """The non-empty pieces of text the stream carries, and the completion tokens."""
        tokens = local_ids(self.model_path, ids, max_tokens, eos=not ignore_eos, **sampling)
        stream = StreamDecoder(self.tok)
        out = [stream.feed(token) for token in tokens] + [stream.flush()]
        return [p for p in out if p], len(tokens)
