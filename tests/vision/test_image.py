"""Images in: the processor against Hugging Face's Qwen2VLImageProcessorPil with the model's
preprocessor_config.json values (resize, normalise, patch order) on PNG and JPEG of several
sizes and modes; every bad image is one ImageError naming it, the header's faults found
from the header alone."""
from __future__ import annotations

import io

import numpy as np
import pytest

from shared.vision.image import ImageError, ImageLimits, decode, header, load, smart_resize
from modeltools.vision.synth import preset_config
from tests.support.big_png import blank_png

Image = pytest.importorskip("PIL.Image")
CFG = preset_config("tiny")


def _encode(array, fmt="PNG", mode=None, **save):
    img = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def _picture(h, w, seed=0):
    """Smooth content plus noise: JPEG and bicubic both have something to do."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([127 + 100 * np.sin(yy / (7 + c) + xx / (11 - c)) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def hf_processor():
    ip = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return ip.Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                       image_std=[0.5] * 3, size={"longest_edge": 16777216, "shortest_edge": 65536})


@pytest.mark.oracle
@pytest.mark.parametrize("h, w, fmt, mode", [
    (256, 256, "PNG", None),          # already multiples of 32, at the minimum area: no resize
    (300, 500, "JPEG", None),         # rounded to 288 x 512
    (100, 80, "PNG", None),           # under the minimum: scaled up
    (1000, 700, "JPEG", None),
    (240, 330, "PNG", "RGBA"),        # transparency onto white
    (200, 400, "PNG", "L"),
    (320, 320, "PNG", "P"),
])
def test_processor_matches_hf(hf_processor, h, w, fmt, mode):
    array = _picture(h, w)
    if mode == "RGBA":
        array = np.dstack([array, np.linspace(0, 255, h * w).reshape(h, w).astype(np.uint8)])
    data = _encode(array, fmt, None if mode == "RGBA" else mode)
    want = hf_processor(Image.open(io.BytesIO(data)), return_tensors="np")
    pixels, grid = load(data, CFG)
    assert [[1, *grid]] == want["image_grid_thw"].tolist()
    np.testing.assert_allclose(pixels, want["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("h, w", [(80, 80), (48, 1000), (100, 9000), (4000, 6000), (31, 33), (2000, 20)])
def test_smart_resize_is_hf_s(h, w):
    ip = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    assert smart_resize(h, w, 32, 65536, 16777216) == ip.smart_resize(h, w, 32, 65536, 16777216)
    assert smart_resize(h, w, 32, 8 * 1024, 4096 * 1024) == ip.smart_resize(h, w, 32, 8 * 1024, 4096 * 1024)


def test_rounding_is_half_to_even():
    """80 / 32 = 2.5 rounds to 2 (Python's round, as HF; llama.cpp would take 3)."""
    assert smart_resize(80, 320, 32, 1, 1 << 30) == (64, 320)


def _bad_images():
    png = _encode(_picture(64, 64))
    sixteen = io.BytesIO()
    Image.new("I;16", (64, 64)).save(sixteen, "PNG")
    return {
        "empty": (b"", "is empty"),
        "corrupt": (b"\x00garbage" * 100, "not a PNG or JPEG image"),
        "truncated": (png[:len(png) // 2], "corrupt or truncated PNG image"),
        "gif": (_encode(_picture(64, 64), "GIF", "P"), "GIF images are not supported"),
        "bmp": (_encode(_picture(64, 64), "BMP"), "BMP images are not supported"),
        "16-bit": (sixteen.getvalue(), "mode I;16 .* is not supported"),
        "too large": (_encode(_picture(300, 300)), "300x300 = 90000 pixels, over the limit of 50000"),
        "aspect": (_encode(_picture(2, 500)), "aspect ratio 250 is over 200"),
    }


@pytest.mark.parametrize("kind", sorted(_bad_images()))
def test_a_bad_image_is_one_error(kind):
    data, message = _bad_images()[kind]
    with pytest.raises(ImageError, match=message) as e:
        load(data, CFG, ImageLimits(max_input_pixels=50000), name="cat.png")
    assert str(e.value).startswith("cat.png: ") or kind == "aspect"
    assert "\n" not in str(e.value)


def test_a_bad_image_harms_no_other():
    good = _encode(_picture(64, 96))
    with pytest.raises(ImageError):
        decode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    pixels, grid = load(good, CFG)
    assert grid == (14, 20) and np.isfinite(pixels).all()        # 64 x 96 is scaled up to the minimum area


@pytest.mark.parametrize("fmt, cut", [("PNG", 16), ("PNG", 30), ("JPEG", 40), ("JPEG", 100), ("JPEG", 200)])
def test_an_image_cut_inside_its_header_is_one_error(fmt, cut):
    data = _encode(_picture(64, 64), fmt)
    assert cut < len(data)
    with pytest.raises(ImageError, match=f"^cat: corrupt or truncated {fmt} image \\({cut} bytes\\)"):
        decode(data[:cut], name="cat")
    with pytest.raises(ImageError, match=f"^cat: corrupt or truncated {fmt}"):
        header(data[:cut], name="cat")


@pytest.mark.parametrize("side", [12000, 20000])
def test_huge_images_meet_fermoes_one_limit(side):
    """Over Pillow's own decompression-bomb limits (89 and 179 million pixels): fermoe's limit
    and message, from the header, whatever Pillow's MAX_IMAGE_PIXELS is."""
    data = blank_png(side, side)
    assert len(data) < 100_000
    message = f"^big.png: the image is {side}x{side} = {side * side} pixels, over the limit of {64 << 20} pixels$"
    for read in (decode, header):
        with pytest.raises(ImageError, match=message):
            read(data, name="big.png")


def test_the_header_is_read_alone():
    """An image whose pixel data is cut passes the header (its size read, nothing decoded);
    the decode finds the cut."""
    data = blank_png(640, 480, rows=100)
    assert header(data, name="x") == (640, 480)
    with pytest.raises(ImageError, match="^x: corrupt or truncated PNG image"):
        decode(data, name="x")
    assert decode(blank_png(64, 32)).shape == (32, 64, 3)
