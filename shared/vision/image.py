"""Images in: PNG or JPEG bytes -> the tower's pixel patches, as Hugging Face's image
processor for Qwen3.5/3.6 makes them (Qwen2VLImageProcessor with the model's
preprocessor_config.json: patch 16, merge 2, mean = std = 0.5, 65536..16777216 pixels).

    decode (Pillow) -> RGB, transparency onto white -> smart_resize to multiples of 32
    -> bicubic resize -> x/255, (x - mean)/std -> patchify in merge-block order

A bad image (empty, corrupt, not PNG/JPEG, an unsupported mode, over the pixel limit)
is one ImageError naming the image and what is wrong with it.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from ..errors import FermoeError
from .config import VisionConfig

# Pillow modes that convert to RGB without losing what they mean; 16-bit and float
# greyscale (I, I;16, F) would be clipped to 8 bits by Pillow's conversion.
MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")


class ImageError(FermoeError):
    """An image cannot be used: unreadable, of a kind we do not take, or too large."""


@dataclass(frozen=True)
class ImageLimits:
    """max_input_pixels: the largest image decoded at all, and max_request_pixels: the most
    pixels all the images of one request may hold together (guards on memory and on the
    time their decoding takes, both checked from the headers); min_pixels and max_pixels:
    the resized area's bounds (the model's preprocessor_config.json values)."""
    max_input_pixels: int = 64 << 20
    max_request_pixels: int = 64 << 20
    min_pixels: int = 65536
    max_pixels: int = 16777216


def header(data: bytes, limits: ImageLimits = ImageLimits(), name: str = "image") -> tuple[int, int]:
    """An image's (width, height), read and checked from its header alone (nothing decoded)."""
    return _open(data, limits, name).size


def decode(data: bytes, limits: ImageLimits = ImageLimits(), name: str = "image") -> np.ndarray:
    """PNG or JPEG bytes -> uint8 [H, W, 3] RGB, transparency composited onto white (as HF)."""
    img = _open(data, limits, name)
    try:
        img.load()
    except Exception as e:      # Pillow's words for truncated and corrupt data (OSError, ValueError, SyntaxError...)
        raise ImageError(f"{name}: corrupt or truncated {img.format} image: {e}") from None
    return _to_rgb(img)


def _open(data: bytes, limits: ImageLimits, name: str):
    """The image, its header read and checked. PNG and JPEG are opened by their own plugins,
    not Image.open: that one applies Pillow's decompression-bomb check (its own two limits
    and wording) before ours could speak; no other format's parser ever sees the data."""
    from PIL import JpegImagePlugin, PngImagePlugin

    if not data:
        raise ImageError(f"{name}: the image is empty (0 bytes)")
    prefix = data[:16]
    plugins = {"PNG": (PngImagePlugin._accept, PngImagePlugin.PngImageFile),
               "JPEG": (JpegImagePlugin._accept, JpegImagePlugin.JpegImageFile)}
    fmt = next((f for f, (accept, _) in plugins.items() if accept(prefix)), None)
    if fmt is None:
        other = _format_of(prefix)
        if other is None:
            raise ImageError(f"{name}: not a PNG or JPEG image, or a corrupt one ({len(data)} bytes)")
        raise ImageError(f"{name}: {other} images are not supported; send PNG or JPEG")
    try:
        img = plugins[fmt][1](io.BytesIO(data))
    except Exception as e:      # a header cut short or broken: OSError, SyntaxError, struct.error...
        raise ImageError(f"{name}: corrupt or truncated {fmt} image ({len(data)} bytes): {e}") from None
    _check_header(img, limits, name)
    return img


def _format_of(prefix: bytes) -> str | None:
    """The format Pillow would take these first bytes for (only its name is wanted)."""
    from PIL import Image

    Image.init()
    for fmt, (_, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(prefix):
                return fmt
        except Exception:
            continue
    return None


def _check_header(img, limits: ImageLimits, name: str) -> None:
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ImageError(f"{name}: the image has no pixels ({w}x{h})")
    if w * h > limits.max_input_pixels:
        raise ImageError(f"{name}: the image is {w}x{h} = {w * h} pixels, over the limit of "
                         f"{limits.max_input_pixels} pixels")
    if img.mode not in MODES:
        raise ImageError(f"{name}: {img.format} mode {img.mode} (16-bit or float samples) is not supported; "
                         "send 8-bit RGB, RGBA, greyscale or palette images")


def _to_rgb(img) -> np.ndarray:
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(img.convert("RGB"))


def smart_resize(h: int, w: int, factor: int = 32, min_pixels: int = 65536, max_pixels: int = 16777216):
    """HF's target size: sides multiples of `factor`, area within [min_pixels, max_pixels],
    the aspect ratio kept as closely as that allows (Python's round: half to even)."""
    if max(h, w) / min(h, w) > 200:
        raise ImageError(f"the image is {w}x{h}: its aspect ratio {max(h, w) / min(h, w):.0f} is over 200")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def patchify(img: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """[3, H, W] -> [gh*gw, 3*2*patch*patch]: rows in merge-block order, each row (c, t, py, px)
    with the frame repeated for the Conv3d's two temporal taps."""
    c, h, w = img.shape
    gh, gw = h // patch, w // patch
    x = img.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (2,) + x.shape[5:])
    return np.ascontiguousarray(x).reshape(gh * gw, c * 2 * patch * patch)


def preprocess(rgb: np.ndarray, cfg: VisionConfig, limits: ImageLimits = ImageLimits()):
    """uint8 [H, W, 3] -> (float32 pixel patches [gh*gw, patch_dim], (gh, gw))."""
    from PIL import Image

    h, w = rgb.shape[:2]
    th, tw = smart_resize(h, w, cfg.factor, limits.min_pixels, limits.max_pixels)
    if (th, tw) != (h, w):
        rgb = np.asarray(Image.fromarray(rgb).resize((tw, th), Image.Resampling.BICUBIC))
    x = rgb.astype(np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
    mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, np.float32)[:, None, None]
    x = (x - mean) / std
    return patchify(x, cfg.patch_size, cfg.n_merge), (th // cfg.patch_size, tw // cfg.patch_size)


def load(data: bytes, cfg: VisionConfig, limits: ImageLimits = ImageLimits(), name: str = "image"):
    """PNG/JPEG bytes -> (pixel patches, (gh, gw)), or one ImageError."""
    return preprocess(decode(data, limits, name), cfg, limits)
