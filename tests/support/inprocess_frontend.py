"""The HTTP front end in the test process: the real app (frontend.app.build_app), its lifespan
run as a server runs it, driven through httpx's ASGI transport, and connected over ZeroMQ to a
scripted coordinator: a ROUTER that answers Status with a StatusReply naming the built-in model
(so that the front end loads its tokenizer) and each Generate with the replies the test
scripted. No subprocess, no model: a request takes milliseconds.

    with InProcessFrontend() as fe:
        fe.coordinator.script(started(9, 4), token(1785, "Hello"), done("stop", completion_tokens=1))
        r = fe.post("/completion", json={"prompt": "Hi"})
        generate = fe.coordinator.generates[0]          # what the front end sent

The app runs on an event loop of its own thread, so that a test reads as plain calls; the
coordinator answers from a thread of its own (a float in a script is a pause, in seconds).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import msgspec
import zmq

from frontend.app import build_app
from frontend.core import Settings
from shared import protocol as P
from shared.builtin import BUILTIN

RECV_TIMEOUT_MS = 5000      # one loopback hop; generous for a loaded machine
REQUEST_TIMEOUT_S = 10.0
MODEL_PATH = str(BUILTIN["tiny"])


class FakeCoordinator:
    """A ROUTER bound on loopback that answers as the test says (recv() and send() by hand)."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer = None

    def recv(self):
        assert self.sock.poll(RECV_TIMEOUT_MS)
        self.peer, data = self.sock.recv_multipart()
        return P.decode(data, P.CLIENT_MESSAGES)

    def send(self, msg):
        self.sock.send_multipart([self.peer, P.encode(msg)])

    def close(self):
        self.sock.close()


class ScriptedCoordinator(FakeCoordinator):
    """A FakeCoordinator answering from a thread of its own: every Status with `status`, each
    Generate with the next script (its messages addressed to that request); a Generate with no
    script left is refused with an Error saying so, so that a test missing one fails, not hangs."""

    def __init__(self, status: P.StatusReply):
        super().__init__()
        self.status = status
        self.scripts: collections.deque[list] = collections.deque()
        self.generates: list[P.Generate] = []
        self.cancels: list[str] = []
        self.statuses = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def script(self, *replies) -> None:
        """The replies to the next Generate: messages (their request_id is the Generate's) and
        pauses (a float: seconds)."""
        self.scripts.append(list(replies))

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(5)
        super().close()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            if not self.sock.poll(10):
                continue
            msg = self.recv()
            if isinstance(msg, P.Status):
                self.statuses += 1
                self.send(self.status)
            elif isinstance(msg, P.Cancel):
                self.cancels.append(msg.request_id)
            else:
                self.generates.append(msg)
                replies = self.scripts.popleft() if self.scripts else [
                    P.Error(message="the test scripted no reply to this Generate", code="no_script")]
                for reply in replies:
                    if isinstance(reply, float):
                        time.sleep(reply)
                    else:
                        self.send(msgspec.structs.replace(reply, request_id=msg.request_id))


# ---- the replies a script holds (request_id filled in when sent) ---------------------------------
def started(prompt_tokens: int, cached_prompt_tokens: int = 0) -> P.Started:
    return P.Started(request_id="", prompt_tokens=prompt_tokens, cached_prompt_tokens=cached_prompt_tokens)


def token(token_id: int, text: str, logprob: float | None = None, top: list[tuple[int, float]] | None = None) -> P.Token:
    top_logprobs = None if top is None else [P.TokenLogprob(token=t, logprob=lp) for t, lp in top]
    return P.Token(request_id="", token=token_id, text=text, logprob=logprob, top_logprobs=top_logprobs)


def progress(processed: int, time_ms: float) -> P.Progress:
    return P.Progress(request_id="", processed=processed, time_ms=time_ms)


def done(finish_reason: str, **fields) -> P.Done:
    return P.Done(request_id="", finish_reason=finish_reason, **fields)


def error(message: str, **fields) -> P.Error:
    return P.Error(message=message, request_id="", **fields)


def status_reply(**fields) -> P.StatusReply:
    """The coordinator's StatusReply: the built-in model, one live CPU worker, unless `fields` say."""
    base = dict(model=MODEL_PATH, workers=[P.WorkerInfo(worker_id="w0", pid=1, threads=2, running=0, alive=True)],
                queued=0, running=0, snapshots={}, name="tiny", fingerprint="0123456789abcdef")
    return P.StatusReply(**(base | fields))


# ---- the front end --------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def lifespan(app):
    """The app's ASGI lifespan, run as a server runs it: startup before the first request,
    shutdown after the last (ASGITransport runs neither)."""
    to_app: asyncio.Queue = asyncio.Queue()
    from_app: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, to_app.get,
                                   from_app.put))
    await to_app.put({"type": "lifespan.startup"})
    reply = await from_app.get()
    assert reply["type"] == "lifespan.startup.complete", reply
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        reply = await from_app.get()
        assert reply["type"] == "lifespan.shutdown.complete", reply
        await task


class InProcessFrontend:
    """build_app(Settings(...)) on its own event loop thread, with a ScriptedCoordinator behind it.
    `settings`: Settings' fields (connect is the coordinator's); `status`: the StatusReply's."""

    def __init__(self, settings: dict | None = None, **status):
        self.settings = settings or {}
        self.coordinator = ScriptedCoordinator(status_reply(**status))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._stack: contextlib.AsyncExitStack | None = None

    def __enter__(self) -> InProcessFrontend:
        self.coordinator.start()
        self._thread.start()
        try:
            self._call(self._start())
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._call(self._stack.aclose())
        finally:
            self._close()

    async def _start(self) -> None:
        self.app = build_app(Settings(connect=self.coordinator.addr, **self.settings))
        self.server = self.app.state.server
        self._stack = contextlib.AsyncExitStack()
        await self._stack.enter_async_context(lifespan(self.app))
        assert self.server.upstream is not None and self.server.upstream.tasks      # the startup ran
        self.client = await self._stack.enter_async_context(httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://frontend.test"))

    def _close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():     # a loop that never yields cannot be stopped: left to die with the process
            self.loop.close()
        self.coordinator.close()

    def _call(self, coro):
        """The coroutine's result; asyncio's own timeout cannot end it while something on the loop
        loops without awaiting (or holds up its cancellation), so this thread gives up a little
        later, saying so, instead of hanging the test."""
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, REQUEST_TIMEOUT_S), self.loop)
        try:
            return future.result(REQUEST_TIMEOUT_S + 5)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"the front end's event loop did not answer in {REQUEST_TIMEOUT_S + 5} s, past the "
                                 f"request's own timeout: a coroutine on it loops without awaiting, or its "
                                 f"cancellation is held up") from None

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        return self._call(self.client.request(method, path, **kw))

    def get(self, path: str, **kw) -> httpx.Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.request("POST", path, **kw)


def data_lines(body: str) -> list:
    """An SSE body of `data:` lines as their JSON (`[DONE]` as the string)."""
    events = []
    for event in body.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        payload = event.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert body.endswith("\n\n"), body[-40:]
    return events


def named_events(body: str) -> list[tuple[str, dict]]:
    """An SSE body of `event:` and `data:` pairs: (the event's name, its data)."""
    out = []
    for event in body.split("\n\n")[:-1]:
        name, data = event.split("\n", 1)
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert body.endswith("\n\n"), body[-40:]
    return out
