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
    with pytest.raises(FermoeError, match=r"^the prompt has 2 image placeholder\(s\) \(<\|image_pad\|>\) for 1 image\(s\): "
                                          r"the chat template must place each image once \(as Qwen3.5's does\)$"):
        plan(tokenizer, messages, vision=CFG)


def test_a_chat_without_images_is_its_rendered_prompt(tokenizer, monkeypatch):
    """Fault guarded: a text-only chat's tokens, or the tools, template variables and ending
    (`turn`) that plan() and chat_prompt() pass to the template, dropped or swapped."""
    from shared.chat import render_chat
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kw = {"enable_thinking": False}
    text = [{"role": "user", "content": "Hi"}]
    want = tokenizer.encode(render_chat(tokenizer, text, tools, kw, add_generation_prompt=False))
    assert want != tokenizer.encode(render_chat(tokenizer, text))
    seen = []

    def spy(tok, messages, tools=None, chat_template_kwargs=None, **turn):
        seen.append((tools, chat_template_kwargs, turn))
        return render_chat(tok, messages, tools, chat_template_kwargs, **turn)
    monkeypatch.setattr(vchat, "render_chat", spy)
    p = plan(tokenizer, text, tools, kw, add_generation_prompt=False)
    assert (p.tokens, p.spans, p.data, p.grids) == (want, [], [], [])
    chat_prompt(tokenizer, chat(png(1)), tools, kw, vision=CFG)
    assert seen == [(tools, kw, {"add_generation_prompt": False}), (tools, kw, {})]


def test_images_need_a_tower_and_a_placeholder_token(tokenizer, monkeypatch):
    """Fault guarded: images taken with no tower loaded, or by a vocabulary without
    <|image_pad|>, instead of refused saying why."""
    with pytest.raises(FermoeError, match=r"^the messages hold 2 image\(s\), but no vision tower is loaded \(start "
                                          r"with --mmproj FILE, the model's mmproj GGUF\)$"):
        plan(tokenizer, chat(png(1), png(2)))
    monkeypatch.delitem(tokenizer.token_to_id, "<|image_pad|>")
    assert not template_places_images(tokenizer)
    with pytest.raises(FermoeError, match=r"^the model's vocabulary has no <\|image_pad\|> token: it cannot take "
                                          r"images$"):
        plan(tokenizer, chat(png(1)), vision=CFG)


def test_a_template_that_refuses_an_image_takes_none(tokenizer, monkeypatch):
    """Fault guarded: a template that raises on an image part reported as placing images."""
    def refuse(*args, **kwargs):
        raise FermoeError("no")
    monkeypatch.setattr(vchat, "render_chat", refuse)
    assert template_places_images(tokenizer) is False


def test_the_byte_limit_and_the_decode_name_each_image(tokenizer):
    """Fault guarded: the byte limit off by one or not passed on by chat_prompt, and errors that
    name the wrong image (its number off by one)."""
    a, b = png(1, (32, 32)), png(2)
    assert len(chat_prompt(tokenizer, chat(a, b), vision=CFG, max_image_bytes=len(b)).images) == 2
    with pytest.raises(FermoeError, match=f"^image 2: {len(b)} bytes, over the limit of {len(b) - 1} bytes$"):
        chat_prompt(tokenizer, chat(a, b), vision=CFG, max_image_bytes=len(b) - 1)
    with pytest.raises(ImageError, match=r"^image 2: corrupt or truncated PNG image"):
        chat_prompt(tokenizer, chat(a, b[:-40]), vision=CFG)
    with pytest.raises(ImageError, match=r"^image: corrupt or truncated PNG image"):
        vchat.decode_image(b[:-40], CFG)


def test_limits_and_merge_size_shape_the_grid(tokenizer):
    """Fault guarded: grid_of ignoring the limits' max_pixels, or expand() not told the tower's
    merge size (a 1-merge tower's tokens counted as 2x2 merges)."""
    from dataclasses import replace
    small = ImageLimits(min_pixels=1024, max_pixels=4096)
    assert plan(tokenizer, chat(png(1, (640, 480))), vision=CFG, limits=small).grids == [(2, 4)]
    p = plan(tokenizer, chat(png(1)), vision=replace(CFG, n_merge=1))
    assert p.grids == [(14, 20)] and p.spans[0].n == 280


def test_a_header_that_lied_is_refused_at_prompt(tokenizer):
    """Fault guarded: a decoded grid unlike the planned one taken (the prompt's length wrong for
    its pixels), the refusal naming the wrong image or size, or decode results matched to
    planned images when their counts differ; the prompt keeps each image's bytes and digest."""
    p = plan(tokenizer, chat(png(1), png(2)), vision=CFG)
    g = p.grids[1]
    with pytest.raises(ImageError, match=f"^image 2: decoded to a 4x6 patch grid, its header promised {g[0]}x{g[1]}$"):
        p.prompt([(p.grids[0], b"d1"), ((4, 6), b"d2")])
    with pytest.raises(ValueError):
        p.prompt([(p.grids[0], b"d1")])
    images = p.prompt([(p.grids[0], b"d1"), (g, b"d2")]).images
    assert [(im.data, im.grid, im.digest) for im in images] == [(p.data[0], p.grids[0], b"d1"), (p.data[1], g, b"d2")]


def test_the_pixel_hash():
    """Fault guarded: a digest of something other than the decoded pixels and their shape
    (the same bytes in another shape, or other pixels, hashed alike) or of another size or key."""
    import hashlib
    rgb = np.random.default_rng(5).integers(0, 256, (32, 48, 3), dtype=np.uint8)

    def encoded(a, level):
        out = io.BytesIO()
        Image.fromarray(a).save(out, "PNG", compress_level=level)
        return out.getvalue()
    grid, digest = vchat.decode_image(encoded(rgb, 1), CFG)
    want = hashlib.blake2b(rgb.tobytes(), digest_size=16, person=b"fermoe-image")
    want.update(np.array([32, 48, 3], "<i8").tobytes())
    assert digest == want.digest() and vchat.decode_image(encoded(rgb, 9), CFG)[1] == digest
    assert vchat.decode_image(encoded(rgb.reshape(48, 32, 3), 1), CFG)[1] != digest
