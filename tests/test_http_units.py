"""The HTTP front end's parts in this process, no model: the routing of replies to
bounded per-request queues (against a ZeroMQ ROUTER standing in for the
coordinator), OpenAI bodies -> Generate, the listen address."""
from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from coordinator.http import params
from coordinator.http.options import parse_listen
from coordinator.http.schemas import APIError, ChatCompletionRequest, CompletionRequest, decode_body
from coordinator.http.upstream import Upstream
from shared import protocol as P
from shared.errors import FermoeError
from shared.sampling import SamplingParams

RECV_TIMEOUT_MS = 5000      # one loopback hop; generous for a loaded machine


class FakeCoordinator:
    """A ROUTER bound on loopback that answers as the test says."""

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


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def token(rid, i):
    return P.Token(request_id=rid, token=i, text=f"<{i}>")


def test_replies_reach_their_own_request_in_order():
    fake = FakeCoordinator()

    async def go():
        up = Upstream(fake.addr)
        up.start()
        a, b = up.submit(P.Generate(request_id="a", prompt="x")), up.submit(P.Generate(request_id="b", prompt="y"))
        assert {fake.recv().request_id, fake.recv().request_id} == {"a", "b"}
        assert up.waiting == 2
        for i in range(3):
            fake.send(token("b", i))
            fake.send(token("a", 10 + i))
        fake.send(P.Done(request_id="a", finish_reason="length"))
        got_a = [await a.get() for _ in range(4)]
        got_b = [await b.get() for _ in range(3)]
        assert [m.token for m in got_a[:3]] == [10, 11, 12] and isinstance(got_a[3], P.Done)
        assert [m.token for m in got_b] == [0, 1, 2]
        assert set(up.streams) == {"b"} and up.waiting == 0
        await up.close()
    run(go())
    fake.close()


def test_a_client_that_does_not_read_is_cancelled_not_buffered_forever():
    fake = FakeCoordinator()
    bound = 4

    async def go():
        up = Upstream(fake.addr, bound=bound)
        up.start()
        slow, other = up.submit(P.Generate(request_id="slow", prompt="x")), up.submit(P.Generate(request_id="ok",
                                                                                                  prompt="y"))
        fake.recv(), fake.recv()
        for i in range(bound + 1):                  # one more than its queue holds
            fake.send(token("slow", i))
        fake.send(token("ok", 0))
        assert (await other.get()).token == 0       # the reader went on for the others
        cancel = fake.recv()
        assert isinstance(cancel, P.Cancel) and cancel.request_id == "slow"
        got = [await slow.get() for _ in range(bound + 1)]
        assert [m.token for m in got[:bound]] == list(range(bound))
        assert got[-1].finish_reason == "error" and "too slowly" in got[-1].error
        await up.close()
    run(go())
    fake.close()


def test_status_replies_go_to_the_callers_in_order_and_silence_fails_requests():
    fake = FakeCoordinator()

    async def go():
        up = Upstream(fake.addr, timeout_s=0.5, watch_s=0.1)
        up.start()
        first, second = asyncio.ensure_future(up.status()), asyncio.ensure_future(up.status())
        await asyncio.sleep(0)
        for n in (1, 2):
            assert isinstance(fake.recv(), P.Status)
            fake.send(P.StatusReply(model="m", workers=[], queued=n, running=0, snapshots={}))
        assert ((await first).queued, (await second).queued) == (1, 2)
        stream = up.submit(P.Generate(request_id="r", prompt="x"))
        fake.recv()                                 # and then the coordinator says nothing more
        done = await stream.get()
        assert done.finish_reason == "error" and "did not answer" in done.error
        await up.close()
    run(go())
    fake.close()


def chat(**fields):
    body = {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    return params.chat_generate(decode_body(msgspec.json.encode(body | fields), ChatCompletionRequest))


def completion(**fields):
    return params.completion_generate(decode_body(msgspec.json.encode({"prompt": "x"} | fields), CompletionRequest))


def test_openai_fields_map_onto_generate():
    g = chat(max_completion_tokens=7, max_tokens=3, top_k=-1, seed=-1, stop="END", presence_penalty=0.5,
             frequency_penalty=-0.25, repeat_penalty=1.1, temperature=0, min_p=0.1, top_p=0.9)
    assert [(m.role, m.content) for m in g.messages] == [("system", "be brief"), ("user", "a\nb")]
    assert (g.max_tokens, g.top_k, g.seed, g.stop) == (7, 0, None, ["END"])      # -1s: off and random
    assert (g.presence_penalty, g.frequency_penalty, g.repeat_penalty) == (0.5, -0.25, 1.1)
    assert (g.temperature, g.min_p, g.top_p) == (0.0, 0.1, 0.9)
    defaults, sampling = completion(), SamplingParams()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p, defaults.max_tokens) == (
        sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, None)
    assert completion(prompt=[[5, 6]]).tokens == [5, 6] and completion(prompt=["hi"]).prompt == "hi"
    assert completion(seed=3, stop=["a", "b"], max_tokens=2).stop == ["a", "b"]


@pytest.mark.parametrize("fields, param", [
    (dict(n=2), "n"), (dict(logprobs=True), "logprobs"), (dict(logit_bias={"1": 5}), "logit_bias"),
    (dict(stream_options={"include_usage": True}), "stream_options"), (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt=[True]), "prompt"), (dict(prompt=[2**63]), "prompt"), (dict(echo=True), "echo"),
    (dict(best_of=2), "best_of"), (dict(suffix="s"), "suffix"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fields, param):
    with pytest.raises(APIError) as e:
        completion(**fields)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("text, expected", [("127.0.0.1:8080", ("127.0.0.1", 8080)), ("8081", ("127.0.0.1", 8081)),
                                            ("[::1]:9000", ("::1", 9000)), ("localhost:80", ("localhost", 80)),
                                            (":8082", ("127.0.0.1", 8082))])
def test_listen_addresses(text, expected):
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["", "host", "1.2.3.4:99999", "a:b", "[::1]"])
def test_bad_listen_addresses_are_named(text):
    with pytest.raises(FermoeError, match="--http"):
        parse_listen(text)


class _NoUpstream:
    def cancel(self, rid):
        pass


def test_a_request_that_fails_is_counted_once():
    from coordinator.http.metrics import Metrics
    from coordinator.http.streaming import GenerationResponse, TextFormat
    from coordinator.http.upstream import RequestStream

    async def go(streaming):
        metrics, stream, sent = Metrics(), RequestStream("r"), []
        stream.fail("the worker died")
        response = GenerationResponse(_NoUpstream(), stream, TextFormat(), "m", streaming, False, metrics)

        async def receive():
            await asyncio.Event().wait()            # the client stays connected

        async def send(message):
            sent.append(message)
        await response(None, receive, send)
        return metrics, sent

    for streaming in (False, True):
        metrics, sent = run(go(streaming))
        assert sent[0]["status"] == 500
        assert metrics.registry.get_sample_value("fermoe:request_success_total", {"finished_reason": "error"}) == 1
        assert metrics.registry.get_sample_value("fermoe:e2e_request_latency_seconds_count") == 1


def test_a_front_end_that_keeps_exiting_is_restarted_within_the_workers_budget(monkeypatch):
    from types import SimpleNamespace

    from coordinator import supervisor
    from coordinator.http.process import FrontEnd

    class Exited:
        pid, returncode = 0, 1

        def poll(self):
            return self.returncode

    front = FrontEnd(SimpleNamespace(http="127.0.0.1:0", api_key=None, max_queue=None), "tcp://127.0.0.1:1")
    starts = []
    monkeypatch.setattr(front, "start", lambda: (starts.append(1), setattr(front, "proc", Exited())))
    front.start()
    for _ in range(supervisor.MAX_RESTARTS + 3):
        front.poll()
    front.stop()
    assert front.given_up and len(starts) == supervisor.MAX_RESTARTS + 1
