"""A chat with images -> its expanded prompt: what the coordinator and `fermoe generate
--image` do before any model runs.

Each image is decoded once here (a bad one is refused now, by name), its patch grid
found (smart_resize), and its pixels hashed: the prefix cache's keys carry that hash in
place of the image's tokens (all `<|image_pad|>`), so two prompts that differ only in
an image part where it begins, and the same image with the same text is found again.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..chat import chat_images, render_chat
from ..errors import FermoeError
from .config import VisionConfig
from .image import ImageLimits, decode, smart_resize
from .prompt import IMAGE_PAD, ImageSpan, expand

# Cache-key values of image tokens: [2**30, 2**31), above any vocabulary, 30 random bits
# each drawn from the image's hash, a different value at every token of the image.
_KEY_BASE = 1 << 30


@dataclass(frozen=True)
class PromptImage:
    data: bytes                 # PNG or JPEG, as sent
    grid: tuple[int, int]       # the patch grid (gh, gw) after smart_resize
    digest: bytes               # blake2b of the decoded RGB pixels and their shape


def inspect(data: bytes, cfg: VisionConfig, limits: ImageLimits = ImageLimits(), name: str = "image") -> PromptImage:
    """Decode and check one image: its grid and pixel hash, or one ImageError naming it."""
    rgb = decode(data, limits, name)
    h, w = rgb.shape[:2]
    th, tw = smart_resize(h, w, cfg.factor, limits.min_pixels, limits.max_pixels)
    digest = hashlib.blake2b(np.ascontiguousarray(rgb).tobytes(), digest_size=16, person=b"fermoe-image")
    digest.update(np.asarray(rgb.shape, "<i8").tobytes())
    return PromptImage(data, (th // cfg.patch_size, tw // cfg.patch_size), digest.digest())


@dataclass(frozen=True)
class ChatPrompt:
    tokens: list[int]           # the expanded prompt
    spans: list[ImageSpan]      # where each image's tokens lie
    images: list[PromptImage]

    def cache_key(self) -> list[int]:
        """The tokens, with each image's tokens replaced by values drawn from its pixel hash."""
        if not self.images:
            return self.tokens
        key = np.asarray(self.tokens, np.int64)
        for span, image in zip(self.spans, self.images):
            rng = np.random.default_rng(int.from_bytes(image.digest, "little"))
            key[span.start:span.start + span.n] = _KEY_BASE + rng.integers(0, _KEY_BASE, span.n)
        return key.tolist()


def chat_prompt(tokenizer, messages, tools=None, chat_template_kwargs=None, vision: VisionConfig | None = None,
                limits: ImageLimits = ImageLimits(), max_image_bytes: int | None = None) -> ChatPrompt:
    """The token ids of a chat, each image's placeholder expanded to its merged tokens."""
    data = chat_images(messages)
    if data and vision is None:
        raise FermoeError(f"the messages hold {len(data)} image(s), but no vision tower is loaded "
                          "(start with --mmproj FILE, the model's mmproj GGUF)")
    for i, d in enumerate(data):
        if max_image_bytes is not None and len(d) > max_image_bytes:
            raise FermoeError(f"image {i + 1}: {len(d)} bytes, over the limit of {max_image_bytes} bytes")
    images = [inspect(d, vision, limits, f"image {i + 1}") for i, d in enumerate(data)]
    ids = tokenizer.encode(render_chat(tokenizer, messages, tools, chat_template_kwargs))
    if not images:
        return ChatPrompt(ids, [], [])
    pad = tokenizer.token_to_id.get(IMAGE_PAD)
    if pad is None:
        raise FermoeError(f"the model's vocabulary has no {IMAGE_PAD} token: it cannot take images")
    tokens, spans = expand(ids, [im.grid for im in images], pad, vision.n_merge)
    return ChatPrompt(tokens, spans, images)
