"""The HTTP front end's parts in this process, no model: the routing of replies to
bounded per-request queues (against a ZeroMQ ROUTER standing in for the
coordinator), OpenAI bodies -> Generate, the listen address."""
from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from frontend import openai_request
from frontend.schemas import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                              decode_body, decode_object)
from frontend.upstream import Upstream
from shared import protocol as P
from shared.errors import FermoeError
from shared.http_options import parse_listen, parse_origins
from shared.sampling import SamplingParams
from tests.support import frame_fuzz
from tests.support.inprocess_frontend import FakeCoordinator

RUN_TIMEOUT_S = 20


def run(coro):
    """The coroutine on an event loop of its own thread: asyncio's own timeout cannot fire while
    a coroutine loops without awaiting (a disconnect watch reading receive() forever, say), so
    the thread is given up on a little later and the test fails, naming that, instead of hanging."""
    out = {}

    def go():
        try:
            out["value"] = asyncio.run(asyncio.wait_for(coro, RUN_TIMEOUT_S))
        except BaseException as e:          # re-raised in the test's thread
            out["error"] = e
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(RUN_TIMEOUT_S + 5)
    assert not thread.is_alive(), (f"the event loop did not come back in {RUN_TIMEOUT_S + 5} s: a coroutine loops "
                                   f"without awaiting, so nothing else on the loop runs")
    if "error" in out:
        raise out["error"]
    return out["value"]


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


def test_an_idle_spell_does_not_count_as_silence_of_the_next_request():
    """Fault guarded: the watchdog measured silence from the last reply, which nothing
    refreshes while no request is open, so the first request after an idle spell longer
    than the timeout failed with "did not answer" at the watchdog's first look, although
    the coordinator answered every status probe while it prefilled."""
    fake = FakeCoordinator()

    def coordinator_prefilling(seconds: float):
        """Answers the status probes for `seconds`, then the request's token and Done."""
        generate = fake.recv()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if fake.sock.poll(20):
                assert isinstance(fake.recv(), P.Status)
                fake.send(P.StatusReply(model="m", workers=[], queued=0, running=1, snapshots={}))
        fake.send(token(generate.request_id, 7))
        fake.send(P.Done(request_id=generate.request_id, finish_reason="length"))

    async def go():
        up = Upstream(fake.addr, timeout_s=0.5, watch_s=0.1)
        up.start()
        await asyncio.sleep(1.0)                    # idle for twice the timeout
        stream = up.submit(P.Generate(request_id="after-idle", prompt="x"))
        answering = threading.Thread(target=coordinator_prefilling, args=(1.0,))
        answering.start()
        first = await stream.get()
        await asyncio.to_thread(answering.join)
        assert isinstance(first, P.Token) and first.token == 7, first
        assert isinstance(await stream.get(), P.Done)
        await up.close()
    run(go())
    fake.close()


def test_the_front_ends_reader_survives_every_mutant_of_a_reply():
    """The front end's socket to the coordinator, fuzzed (tests/support/frame_fuzz.py):
    mutants of every reply, addressed to an open request; the reader goes on, and a
    request sent after them gets its own replies."""
    fake = FakeCoordinator()

    async def go():
        up = Upstream(fake.addr, bound=1 << 20)
        up.start()
        up.submit(P.Generate(request_id="fuzz", prompt="x"))
        fake.recv()
        sent = frame_fuzz.fuzz(frame_fuzz.coordinator_replies(), 2,
                               lambda what, frames: fake.sock.send_multipart([fake.peer, *frames]))
        after = up.submit(P.Generate(request_id="after", prompt="y"))
        while not isinstance(fake.recv(), P.Generate):
            pass                                    # the watchdog's status probes
        fake.send(token("after", 1))
        fake.send(P.Done(request_id="after", finish_reason="length"))
        assert (await after.get()).token == 1 and isinstance(await after.get(), P.Done)
        assert sent > 50 and not any(task.done() for task in up.tasks)
        await up.close()
    run(go())
    fake.close()


def chat(**fields):
    body = {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    return openai_request.chat_generate(decode_body(msgspec.json.encode(body | fields), ChatCompletionRequest))


def completion(**fields):
    return openai_request.completion_generate(decode_body(msgspec.json.encode({"prompt": "x"} | fields),
                                                          CompletionRequest))


def test_openai_fields_map_onto_generate():
    g = chat(max_completion_tokens=7, max_tokens=3, top_k=-1, seed=-1, stop="END", presence_penalty=0.5,
             frequency_penalty=-0.25, repeat_penalty=1.1, temperature=0, min_p=0.1, top_p=0.9)
    assert [(m.role, m.content) for m in g.messages] == [("system", "be brief"), ("user", "a\nb")]
    assert (g.max_tokens, g.sampling.top_k, g.sampling.seed, g.stop) == (7, 0, None, ["END"])  # -1s: off, random
    assert g.sampling == SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repeat_penalty=1.1,
                                        temperature=0.0, min_p=0.1, top_p=0.9, top_k=0)
    defaults = completion()
    assert (defaults.sampling, defaults.max_tokens) == (SamplingParams(), None)
    with pytest.raises(APIError) as e:              # within the API's bounds, outside the sampler's
        chat(top_p=0.0)
    assert (e.value.status, e.value.param) == (400, "top_p") and "top_p must be in (0, 1]" in e.value.message
    assert completion(prompt=[[5, 6]]).tokens == [5, 6] and completion(prompt=["hi"]).prompt == "hi"
    assert completion(seed=3, stop=["a", "b"], max_tokens=2).stop == ["a", "b"]


@pytest.mark.parametrize("fields, param", [
    (dict(n=17), "n"), (dict(logprobs=True), "logprobs"), (dict(logit_bias={"a": 5}), "logit_bias"),
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
    def cancel(self, rid, on_done=None):
        return False


def test_a_request_that_fails_is_counted_once():
    from frontend.metrics import Metrics
    from frontend.streaming import GenerationResponse, TextFormat
    from frontend.upstream import RequestStream

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
    from coordinator.frontend_process import FrontEnd

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


# ---- llama-server's fields --------------------------------------------------------
def test_llama_server_fields_that_mean_something_here_are_honoured():
    assert completion(n_predict=5).max_tokens == 5
    assert completion(n_predict=-1, max_tokens=9).max_tokens is None        # -1: until the end, as llama.cpp's
    assert completion(n_predict=7, max_tokens=3).max_tokens == 7            # n_predict first, as llama-server
    assert chat(n_predict=4, max_completion_tokens=2).max_tokens == 4
    g = completion(samplers=["top_k", "temperature"], top_p=0.5, min_p=0.2).sampling  # left out: not used
    assert (g.top_k, g.top_p, g.min_p) == (SamplingParams().top_k, 1.0, 0.0)
    g = completion(samplers="edkypmxt", top_p=0.5).sampling                  # llama-server's default chain
    assert (g.top_k, g.top_p, g.min_p) == (SamplingParams().top_k, 0.5, SamplingParams().min_p)
    assert completion(repeat_last_n=128, repeat_penalty=1.1).sampling.repeat_last_n == 128
    assert completion(repeat_last_n=-1).sampling.repeat_last_n >= 2**31 - 1     # the whole context
    assert completion(repeat_last_n=0).sampling.repeat_last_n == 0


def test_llama_server_fields_without_effect_are_accepted_and_logged(caplog):
    web_page = dict(cache_prompt=True, id_slot=-1, timings_per_token=True, return_progress=True, verbose=False,
                    n_keep=0, dry_multiplier=0.0, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1,
                    dry_sequence_breakers=["\n"], typical_p=1.0, xtc_probability=0.0, xtc_threshold=0.1,
                    mirostat=0, mirostat_tau=5.0, mirostat_eta=0.1, dynatemp_range=0.0, dynatemp_exponent=1.0,
                    n_probs=0, post_sampling_probs=False, return_tokens=False, top_n_sigma=-1.0, repeat_last_n=64,
                    reasoning_format="none", min_keep=0)
    with caplog.at_level("INFO", logger="fermoe.http"):
        g = chat(**web_page)
    # the same request as one without them; but repeat_last_n it gave, so the server's default is not its
    assert msgspec.structs.replace(g, request_id="", unset=[]) == msgspec.structs.replace(chat(), request_id="",
                                                                                          unset=[])
    assert set(chat().unset) - set(g.unset) == {"repeat_last_n"}
    lines = [r.getMessage() for r in caplog.records if "ignored llama-server fields" in r.getMessage()]
    assert len(lines) == 1 and "cache_prompt" in lines[0] and "id_slot" in lines[0] and "mirostat" in lines[0]
    assert "timings_per_token" not in lines[0]                              # honoured, not ignored
    caplog.clear()
    with caplog.at_level("INFO", logger="fermoe.http"):
        completion(seed=3)
    assert not caplog.records                                               # nothing to say


@pytest.mark.parametrize("fields, param", [
    (dict(dry_multiplier=0.8), "dry_multiplier"), (dict(mirostat=2), "mirostat"),
    (dict(xtc_probability=0.5), "xtc_probability"), (dict(typical_p=0.9), "typical_p"),
    (dict(dynatemp_range=0.5), "dynatemp_range"), (dict(top_n_sigma=1.5), "top_n_sigma"),
    (dict(n_probs=3), "n_probs"), (dict(n_indent=4), "n_indent"), (dict(n_cmpl=2), "n_cmpl"),
    (dict(t_max_predict_ms=100), "t_max_predict_ms"), (dict(lora=[{"id": 0, "scale": 1}]), "lora"),
    (dict(min_keep=5), "min_keep"), (dict(n_predict=0), "n_predict"),
    (dict(repeat_last_n=-2, repeat_penalty=1.1), "repeat_last_n"), (dict(samplers=["top_k", "bogus"]), "samplers"),
    (dict(samplers="kpm"), "samplers"), (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (dict(reasoning_format="raw"), "reasoning_format"),
])
def test_llama_server_settings_we_cannot_honour_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_xtc_is_off_above_its_threshold_as_in_llama_cpp():
    assert chat(xtc_probability=0.5, xtc_threshold=0.6).max_tokens is None


# ---- integers: bounded before they reach MessagePack -------------------------------
@pytest.mark.parametrize("fields, param", [
    (dict(seed=2**64), "seed"), (dict(max_tokens=2**64), "max_tokens"), (dict(max_tokens=2**63), "max_tokens"),
    (dict(top_k=2**70), "top_k"), (dict(n_predict=2**64), "n_predict"), (dict(n_predict=-(2**70)), "n_predict"),
    (dict(id_slot=2**64), "id_slot"), (dict(n_keep=-(2**64)), "n_keep"), (dict(n=2**64), "n"),
    (dict(top_logprobs=2**64), "top_logprobs"), (dict(best_of=-(2**70)), "best_of"),
    (dict(prompt=[2**64]), "prompt"), (dict(prompt=[[1, -(2**64)]]), "prompt"),
])
def test_integers_out_of_range_are_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        completion(**fields)
    assert e.value.status == 400 and e.value.param == param


def test_integers_at_their_bounds_reach_the_coordinator_whole():
    g = completion(seed=2**64 - 1, max_tokens=2**63 - 1, top_k=2**63 - 1, id_slot=-(2**63))
    assert P.decode(P.encode(g), P.CLIENT_MESSAGES) == g
    with pytest.raises(APIError) as e:
        decode_body(msgspec.json.encode({"tokens": [2**64]}), DetokenizeRequest)
    assert e.value.param == "tokens[0]"


def test_a_body_nested_past_the_decoders_bound_is_a_400():
    """Fault guarded: 100,000 nested arrays raised RecursionError out of the JSON decoder,
    which the web server answered with a bare 500."""
    deep = b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for decode in (lambda body: decode_body(body, ChatCompletionRequest), decode_object):
        with pytest.raises(APIError) as e:
            decode(deep)
        assert (e.value.status, e.value.code) == (400, "invalid_json") and "too deeply" in e.value.message


# ---- llama-server's timings -------------------------------------------------------
def test_timings_are_llama_servers():
    from frontend.llama_server_request import Timings
    t = Timings()
    assert t.partial() == {}
    t.arrived = 10.0
    for now in (10.5, 10.6, 10.7):
        t.token(now)
    part = t.partial()
    assert part["prompt_ms"] == 500.0 and part["predicted_n"] == 3 and part["predicted_ms"] == pytest.approx(200.0)
    done = P.Done(request_id="r", finish_reason="length", prompt_tokens=12, cached_prompt_tokens=8,
                  completion_tokens=4, prefill_ms=20.0, decode_tok_s=50.0)
    assert t.final(done) == {"cache_n": 8, "prompt_n": 4, "prompt_ms": 20.0, "prompt_per_token_ms": 5.0,
                             "prompt_per_second": 200.0, "predicted_n": 4, "predicted_ms": 80.0,
                             "predicted_per_token_ms": 20.0, "predicted_per_second": 50.0}


# ---- sizes: one limit, and a full context within it --------------------------------
def test_the_coordinators_sockets_take_a_snapshot_frame_whatever_the_request_limit(tiny_q4_path):
    from shared.state import kv_slot_nbytes
    from coordinator.daemon import Coordinator
    from coordinator.options import parse_options
    from tests.support.serving_harness import free_port
    opts = parse_options(["--model", str(tiny_q4_path), "--bind", f"tcp://127.0.0.1:{free_port()}", "--snapshot-mem",
                          "0", "--block", "4096", "--max-request-size", "1KiB"])
    coord = Coordinator(opts)
    try:
        slot = kv_slot_nbytes(coord.model.config, 4096, opts.kv_cache_dtype)
        assert slot > 2 << 20 and coord.workers_sock.getsockopt(zmq.MAXMSGSIZE) > slot
        assert P.max_message_bytes() == 1024
    finally:
        coord.shutdown()
        P.set_max_message_bytes(P.MAX_MESSAGE_BYTES)


@pytest.mark.parametrize("text, expected", [("*", ("*",)), ("", ()), ("http://a.b:3000/, https://c", (
    "http://a.b:3000", "https://c"))])
def test_cors_origins(text, expected):
    from shared.http_options import parse_origins
    assert parse_origins(text) == expected


@pytest.mark.parametrize("text", ["*,http://a", "page.example", "http://a/path"])
def test_bad_cors_origins_are_named(text):
    from shared.http_options import parse_origins
    with pytest.raises(FermoeError, match="--cors-origins"):
        parse_origins(text)


def test_http_options_on_the_coordinators_command_line():
    from coordinator.options import parse_options
    opts = parse_options(["--model", "tiny", "--alias", "qwen", "--max-request-size", "8MiB", "--http", "8080",
                          "--cors-origins", "http://localhost:3000"])
    assert (opts.alias, opts.max_request_size, opts.cors_origins) == ("qwen", 8 << 20, ("http://localhost:3000",))
    opts = parse_options(["--model", "tiny"])
    assert (opts.model, opts.alias, opts.max_request_size) == ("tiny", None, P.MAX_MESSAGE_BYTES)
    for bad, word in [(["--max-request-size", "12"], "at least"), (["--max-request-size", "lots"], "size"),
                      (["--cors-origins", "*"], "needs --http")]:
        with pytest.raises(FermoeError, match=f"--(max-request-size|cors-origins).*{word}"):
            parse_options(["--model", "tiny", *bad])


# ---- /metrics: a request whose client left is counted, once, as an abort ----------
class _Cancelling:
    """An upstream whose one request is open until the first cancel(), which keeps its callback."""

    def __init__(self):
        self.open, self.on_done = True, None

    def cancel(self, rid, on_done=None):
        was_open, self.open = self.open, False
        if was_open:
            self.on_done = on_done
        return was_open


def test_a_request_whose_client_left_is_counted_as_an_abort_once():
    from frontend.metrics import Metrics
    from frontend.streaming import GenerationResponse, TextFormat
    from frontend.upstream import RequestStream

    async def go():
        metrics, stream, upstream = Metrics(), RequestStream("r"), _Cancelling()
        response = GenerationResponse(upstream, stream, TextFormat(), "m", True, False, metrics)
        stream.push(token("r", 1))
        stream.push(token("r", 2))
        left = asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            left.set()                              # the client leaves once the stream has begun
        await response(None, receive, send)
        upstream.on_done(P.Done(request_id="r", finish_reason="cancelled", prompt_tokens=7, completion_tokens=5))
        upstream.on_done(P.Done(request_id="r", finish_reason="cancelled", prompt_tokens=7, completion_tokens=5))
        return metrics

    metrics = run(go())
    get = metrics.registry.get_sample_value
    assert get("fermoe:request_success_total", {"finished_reason": "abort"}) == 1
    assert (get("fermoe:generation_tokens_total"), get("fermoe:prompt_tokens_total")) == (5, 7)
    assert get("fermoe:e2e_request_latency_seconds_count") == 1


def test_a_request_that_had_ended_when_its_client_left_is_counted_by_its_own_reason():
    from frontend.metrics import Metrics
    from frontend.streaming import GenerationResponse, TextFormat
    from frontend.upstream import RequestStream

    class Closed:                                   # its Done came: nothing left to cancel
        def cancel(self, rid, on_done=None):
            return False

    async def go():
        metrics, stream = Metrics(), RequestStream("r")
        for msg in (token("r", 1), token("r", 2), P.Done(request_id="r", finish_reason="length", prompt_tokens=3,
                                                          completion_tokens=2)):
            stream.push(msg)
        left = asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            left.set()
            await asyncio.sleep(0.05)               # the client is gone before the Done is read
        await GenerationResponse(Closed(), stream, TextFormat(), "m", True, False, metrics)(None, receive, send)
        return metrics

    get = run(go()).registry.get_sample_value
    assert get("fermoe:request_success_total", {"finished_reason": "length"}) == 1
    assert get("fermoe:request_success_total", {"finished_reason": "abort"}) is None
    assert get("fermoe:generation_tokens_total") == 2


def test_a_cancelled_requests_done_reaches_whoever_cancelled_it():
    fake = FakeCoordinator()

    async def go():
        up = Upstream(fake.addr)
        up.start()
        up.submit(P.Generate(request_id="a", prompt="x"))
        fake.recv()
        got = []
        assert up.cancel("a", got.append) and not up.cancel("a", got.append)
        assert isinstance(fake.recv(), P.Cancel)
        fake.send(token("a", 1))                                    # late: dropped
        fake.send(P.Done(request_id="a", finish_reason="cancelled", completion_tokens=1))
        await asyncio.sleep(0.2)
        assert [d.finish_reason for d in got] == ["cancelled"] and not up.draining
        await up.close()
    run(go())
    fake.close()


# ---- system_fingerprint ------------------------------------------------------------
def test_system_fingerprint_is_one_per_model():
    from frontend.core import system_fingerprint
    a = system_fingerprint("df81f6403566e03a")
    assert a == system_fingerprint("df81f6403566e03a") != system_fingerprint("0123456789abcdef")
    assert a.startswith("fp_") and len(a) == 13


def test_llama_servers_metrics_from_what_requests_did():
    """Guards: the cached part counted as processed, the first token's time in the generation's,
    or a rate of the wrong totals (llama-server's dashboards read these names)."""
    from frontend.metrics import Metrics
    metrics = Metrics()
    metrics.finished(P.Done(request_id="a", finish_reason="stop", prompt_tokens=100, cached_prompt_tokens=40,
                            completion_tokens=11, prefill_ms=300.0, decode_tok_s=50.0), 1.0)
    metrics.finished(P.Done(request_id="b", finish_reason="stop", prompt_tokens=20, cached_prompt_tokens=20,
                            completion_tokens=1, prefill_ms=0.0, decode_tok_s=0.0), 1.0)
    st = P.StatusReply(model="m", workers=[], queued=3, running=2, n_ctx=4096,
                       snapshots={"slots": 100, "free_slots": 75, "block": 8})
    text = metrics.render(st).decode()
    get = metrics.registry.get_sample_value
    assert (get("llamacpp:prompt_tokens_total"), get("llamacpp:prompt_seconds_total")) == (60, 0.3)
    assert (get("llamacpp:tokens_predicted_total"), get("llamacpp:tokens_predicted_seconds_total")) == (12, 0.2)
    assert (get("llamacpp:prompt_tokens_seconds"), get("llamacpp:predicted_tokens_seconds")) == (200.0, 60.0)
    for line in ("llamacpp:requests_processing 2.0", "llamacpp:requests_deferred 3.0",
                 "llamacpp:kv_cache_usage_ratio 0.25", "llamacpp:kv_cache_tokens 200.0", "llamacpp:n_tokens_max 4096.0"):
        assert f"\n{line}\n" in text, line


@pytest.mark.parametrize("origin, loopback", [
    (b"http://localhost", True), (b"http://localhost:5173", True), (b"https://127.0.0.1:8443", True),
    (b"http://127.1.2.3:80", True), (b"http://[::1]:3000", True), (b"http://[::1]", True),
    (b"http://localhost.example.com", False), (b"http://127.0.0.1.example.com", False),
    (b"ftp://localhost", False), (b"localhost", False), (b"http://10.0.0.1:3000", False)])
def test_cors_origins_localhost_means_any_loopback_origin(origin, loopback):
    """Guards: `localhost` read as the literal origin only, or a host that merely starts like one let in."""
    from frontend.cors import CORS

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [(b"origin", origin)]}
    asyncio.run(CORS(app, parse_origins("localhost,http://page.example"))(scope, None, send))
    headers = dict(sent[0]["headers"])
    assert (headers.get(b"access-control-allow-origin") == origin) is loopback
