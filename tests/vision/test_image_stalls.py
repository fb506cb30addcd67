"""Hostile images against a serving daemon: a stream running meanwhile keeps getting its
tokens (no gap of a second), and the image requests get their refusal within seconds.
Images that the headers already condemn (the context, the request's pixel budget, a
template that places no image) are refused without being decoded; images that only a
full decode finds broken are decoded off the coordinator's event loop."""
from __future__ import annotations

import threading
import time

import pytest

from coordinator.client import Client
from shared import protocol as P
from shared.errors import FermoeError
from shared.model import Model
from shared.builtin import BUILTIN
from modeltools.vision.synth import preset_config, synth_mmproj
from tests.support.big_png import blank_png
from tests.support.vision_model import chat, vision_model
from tests.support.serving_harness import Daemon, wait_until

pytest.importorskip("PIL.Image")
CONTEXT = 16500             # one 8192 x 8192 image (16384 tokens) and its text fit; two large ones do not
MAX_GAP_S = 1.0
REFUSED_WITHIN_S = 20.0     # a few seconds, on two busy cores; the decodes take ~1 s each




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return vision_model(tmp_path_factory.mktemp("stalls"))


class Stream:
    """Text requests one after another in a thread, every reply's arrival time recorded."""

    def __init__(self, addr: str):
        self.addr, self.times, self.done = addr, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        wait_until(lambda: len(self.times) > 20, 60, "the stream's first tokens")

    def _run(self):
        with Client(self.addr, timeout_s=60) as c:
            while not self.done.is_set():
                self.times.append(time.monotonic())
                for _ in c.generate(prompt="Once upon a time", max_tokens=400, ignore_eos=True, seed=1):
                    self.times.append(time.monotonic())

    def stop(self) -> float:
        """The largest gap between replies (a request's send to its first token too)."""
        self.done.set()
        self.thread.join(120)
        return max(b - a for a, b in zip(self.times, self.times[1:]))


def outcome(addr: str, images: list[bytes], cancel_after_s: float | None = None):
    """(the refusal's message or the Done, seconds until it came)."""
    with Client(addr, timeout_s=120) as c:
        t0 = time.monotonic()
        rid = c.submit(messages=chat(*images), max_tokens=4)
        if cancel_after_s is not None:
            time.sleep(cancel_after_s)
            c.cancel(rid)
        try:
            return list(c.stream(rid))[-1], time.monotonic() - t0
        except FermoeError as e:
            return str(e), time.monotonic() - t0


def all_at_once(addr: str, requests: list[tuple]) -> list:
    out = [None] * len(requests)

    def one(i, args):
        out[i] = outcome(addr, *args)
    threads = [threading.Thread(target=one, args=(i, args)) for i, args in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_hostile_images_stall_no_stream(files):
    daemon = Daemon(files[0], "--mmproj", files[1], "--max-model-len", str(CONTEXT))
    try:
        big = blank_png(8192, 8192)                         # at the pixel limit: 11-20 KB
        two = [blank_png(5792, 5792)] * 2                    # within the request's pixels, 2 x 16384 tokens
        cut = blank_png(8192, 8192, rows=8191, rgb=True)     # only a whole decode finds its last row missing
        stream = Stream(daemon.addr)
        # condemned by their headers: refused without a decode
        early = all_at_once(daemon.addr, [(two,), (two,), ([big] * 4,)])
        # fit: decoded (off the loop), then refused; one cancelled while its images decode
        late = all_at_once(daemon.addr, [([cut],), ([cut],), ([cut],), ([cut], 0.2)])
        gap = stop_gap = stream.stop()
        for message, took in early[:2]:
            assert f"longer than --max-model-len {CONTEXT}" in message and took < REFUSED_WITHIN_S, (message, took)
        message, took = early[2]
        assert f"over the limit of {64 << 20} pixels a request" in message and took < REFUSED_WITHIN_S
        for message, took in late[:3]:
            assert "image 1: corrupt or truncated PNG image" in message and took < REFUSED_WITHIN_S, (message, took)
        done, _ = late[3]
        assert isinstance(done, P.Done) and done.finish_reason == "cancelled", done
        assert gap < MAX_GAP_S, f"a running stream waited {stop_gap:.2f} s for a token"
        # the daemon serves images on
        final, _ = outcome(daemon.addr, [blank_png(64, 64)])
        assert isinstance(final, P.Done) and final.finish_reason == "length", final
    finally:
        assert daemon.stop() == 0


def test_a_template_without_images_is_said_at_start_and_refuses_them(tmp_path):
    """The built-in model with a tower: a warning at start; an image request refused at once,
    naming the template, without decoding its images."""
    synth_mmproj(tmp_path / "mm.gguf", preset_config("tiny", projection_dim=Model(BUILTIN["tiny"]).config.n_embd),
                 "f32", seed=1)
    daemon = Daemon("tiny", "--mmproj", tmp_path / "mm.gguf")
    try:
        assert any("chat template places no image" in line and "will be refused" in line for line in daemon.log)
        message, took = outcome(daemon.addr, [blank_png(8192, 8192)] * 2)
        assert "chat template places no image placeholder" in message and took < 2.0, (message, took)
    finally:
        assert daemon.stop() == 0
