"""The coordinator's image decoding pool (coordinator/images.py): results come back through
the pipe the loop polls; a bad image is its request's error; a pool process that dies
fails only the requests it held and the next request gets a new pool; a cancelled
request's result is dropped."""
from __future__ import annotations

import os
import select
import time

import pytest

from coordinator.images import ImageDecoder, decode_all
from shared.errors import FermoeError
from shared.vision.chat import grid_of
from shared.vision.image import ImageError, ImageLimits
from modeltools.vision.synth import preset_config
from tests.support.big_png import blank_png

CFG = preset_config("tiny")


def die_on_empty(data, cfg, limits):
    """decode_all, but the process dies on a request with no image (a crash in the pool)."""
    if not data:
        os._exit(3)
    return decode_all(data, cfg, limits)


def results(decoder: ImageDecoder, n: int, timeout_s: float = 60) -> dict:
    """The next n results, waiting on the decoder's pipe as the event loop does."""
    out, deadline = {}, time.monotonic() + timeout_s
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(out)} of {n} decodes came back"
        select.select([decoder.fd], [], [], left)
        out.update({key: (value, error) for key, value, error in decoder.finished()})
    return out


@pytest.fixture
def decoder():
    d = ImageDecoder(die_on_empty)
    yield d
    d.close()


def test_results_and_errors_come_back_by_request(decoder):
    assert decoder.pool is None                     # nothing started until an image comes
    decoder.submit("a", [blank_png(64, 32)], CFG, ImageLimits())
    decoder.submit("b", [blank_png(64, 32), blank_png(640, 480, rows=10)], CFG, ImageLimits())
    got = results(decoder, 2)
    (grids, error) = got["a"]
    assert error is None and [g for g, _ in grids] == [grid_of(64, 32, CFG, ImageLimits())]
    assert got["b"][0] is None and isinstance(got["b"][1], ImageError)
    assert str(got["b"][1]).startswith("image 2: corrupt or truncated PNG image")


def test_a_dead_pool_fails_its_requests_and_is_made_again(decoder):
    decoder.submit("crash", [], CFG, ImageLimits())
    got = results(decoder, 1)
    value, error = got["crash"]
    assert value is None and isinstance(error, FermoeError) and "process decoding the images died" in str(error)
    assert decoder.pool is None
    decoder.submit("after", [blank_png(64, 64)], CFG, ImageLimits())
    assert results(decoder, 1)["after"][1] is None


def test_a_cancelled_request_gets_no_result(decoder):
    decoder.submit("slow", [blank_png(4096, 4096)], CFG, ImageLimits())
    decoder.submit("gone", [blank_png(64, 64)], CFG, ImageLimits())
    decoder.cancel("gone")
    decoder.submit("last", [blank_png(64, 64)], CFG, ImageLimits())
    got = results(decoder, 2)
    assert set(got) == {"slow", "last"} and not decoder.pending
