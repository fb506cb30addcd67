"""A chat with images planned from the image headers alone (shared/vision/chat.py plan()):
the template's placeholders, the request's pixel budget and the expanded prompt's length
are all known, and every refusal made, before any pixel is decoded."""
from __future__ import annotations

import io

import numpy as np
import pytest

from shared.builtin import BUILTIN
from shared.errors import FermoeError
from shared.model import Model
from shared.vision import chat as vchat
from shared.vision.chat import chat_prompt, plan, template_places_images
from shared.vision.image import ImageError, ImageLimits
from modeltools.synth import synth
from modeltools.vision.synth import preset_config
from tests.support.big_png import blank_png

Image = pytest.importorskip("PIL.Image")
CFG = preset_config("tiny")


def png(seed: int, size=(96, 64)) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "PNG")
    return out.getvalue()


def chat(*images: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "data": d} for d in images] + [{"type": "text",
                                                                                          "text": "What?"}]}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A model whose chat template places images (fermoe synth's, Qwen3.5's)."""
    path = tmp_path_factory.mktemp("plan") / "m.gguf"
    synth(path, "tiny", layers=2, out_type="q8_0", seed=0, progress=False)
    return Model(path).tokenizer


@pytest.fixture
def no_decoding(monkeypatch):
    """Any decode from here on fails the test: plan() must not need one."""
    def refuse(*args, **kwargs):
        raise AssertionError("an image was decoded")
    monkeypatch.setattr(vchat, "decode", refuse)


def test_the_plan_is_the_prompt_the_pixels_give(tokenizer):
    images = [png(1), png(2, (640, 480))]
    p = plan(tokenizer, chat(*images), vision=CFG)
    whole = chat_prompt(tokenizer, chat(*images), vision=CFG)
    assert p.tokens == whole.tokens and p.spans == whole.spans and p.grids == [im.grid for im in whole.images]


def test_a_huge_image_is_counted_from_its_header(tokenizer, no_decoding):
    """An 8192 x 8192 image: 16384 merged tokens, known without decoding it (so the context
    check refuses an over-long prompt at once)."""
    p = plan(tokenizer, chat(blank_png(8192, 8192)), vision=CFG)
    assert p.grids == [(256, 256)] and p.spans[0].n == 16384
    assert len(p.tokens) == 16384 + len(plan(tokenizer, chat(png(1, (32, 32))), vision=CFG).tokens) - 64


def test_the_requests_pixel_budget(tokenizer, no_decoding):
    side = blank_png(8192, 8192)
    assert plan(tokenizer, chat(side), vision=CFG).grids == [(256, 256)]     # at the limit: taken
    with pytest.raises(ImageError, match=f"the request's 2 images hold {(64 << 20) + 1024} pixels together, over the limit "
                                         f"of {64 << 20} pixels a request"):
        plan(tokenizer, chat(side, blank_png(32, 32)), vision=CFG)
    with pytest.raises(ImageError, match="the request's 4 images hold"):
        plan(tokenizer, chat(*[blank_png(4096, 4097)] * 4), vision=CFG)
    small = ImageLimits(max_request_pixels=2 * 96 * 64)
    assert len(plan(tokenizer, chat(png(1), png(2)), vision=CFG, limits=small).grids) == 2
    with pytest.raises(ImageError, match="over the limit of 12288 pixels a request"):
        plan(tokenizer, chat(png(1), png(2), png(3)), vision=CFG, limits=small)


def test_bad_headers_are_refused_before_decoding(tokenizer, no_decoding):
    with pytest.raises(ImageError, match=r"^image 2: corrupt or truncated PNG image \(16 bytes\)"):
        plan(tokenizer, chat(png(1), png(2)[:16]), vision=CFG)
    with pytest.raises(ImageError, match="^image 1: the image is 20000x20000 = 400000000 pixels, over the limit"):
        plan(tokenizer, chat(blank_png(20000, 20000)), vision=CFG)
    with pytest.raises(ImageError, match="^image 1: the image is 500x2: its aspect ratio 250 is over 200"):
        plan(tokenizer, chat(png(1, (500, 2))), vision=CFG)


def test_a_template_that_places_no_image(no_decoding):
    """The built-in model's template writes no placeholder for an image part: refused before
    any decode, saying so."""
    builtin = Model(BUILTIN["tiny"]).tokenizer
    assert not template_places_images(builtin)
    with pytest.raises(FermoeError, match=r"chat template places no image placeholder \(<\|image_pad\|>\) for "
                                          r"the 2 image\(s\) sent: this model cannot take images"):
        plan(builtin, chat(blank_png(8192, 8192), png(1)), vision=CFG)


def test_placeholders_and_images_must_pair(tokenizer, no_decoding):
    """Text that writes a placeholder of its own: the count is checked before anything is decoded."""
    assert template_places_images(tokenizer)
    messages = chat(png(1))
    messages[0]["content"][-1]["text"] = "<|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(FermoeError, match=r"the prompt has 2 image placeholder\(s\) .* for 1 image\(s\)"):
        plan(tokenizer, messages, vision=CFG)
