"""A chat with images -> its expanded prompt: what the coordinator and `fermoe generate
--image` do before any model runs, in two steps:

- plan(): everything the image headers tell, cheaply, before any pixel is decoded: each
  image's size and kind (a bad one is refused now, by name), the pixels of all of them
  against the request's budget, the placeholders the chat template places against the
  images, each image's patch grid (smart_resize) and so the expanded prompt and its length;
- decode_image(): the full decode and the hash of the pixels, the slow part (seconds for a
  large image), which the coordinator runs off its event loop (coordinator/images.py).

The prefix cache's keys carry each image's pixel hash in place of its tokens (all
`<|image_pad|>`), so two prompts that differ only in an image part where it begins, and
the same image with the same text is found again.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..chat import chat_images, render_chat
from ..errors import FermoeError
from .config import VisionConfig
from .image import ImageError, ImageLimits, decode, header, smart_resize
from .prompt import IMAGE_PAD, ImageSpan, expand

# Cache-key values of image tokens: [2**30, 2**31), above any vocabulary, 30 random bits
# each drawn from the image's hash, a different value at every token of the image.
_KEY_BASE = 1 << 30


@dataclass(frozen=True)
class PromptImage:
    data: bytes                 # PNG or JPEG, as sent
    grid: tuple[int, int]       # the patch grid (gh, gw) after smart_resize
    digest: bytes               # blake2b of the decoded RGB pixels and their shape


def grid_of(w: int, h: int, cfg: VisionConfig, limits: ImageLimits) -> tuple[int, int]:
    """The patch grid (gh, gw) of a w x h image."""
    th, tw = smart_resize(h, w, cfg.factor, limits.min_pixels, limits.max_pixels)
    return th // cfg.patch_size, tw // cfg.patch_size


def decode_image(data: bytes, cfg: VisionConfig, limits: ImageLimits = ImageLimits(),
                 name: str = "image") -> tuple[tuple[int, int], bytes]:
    """Decode one image whole: (its grid, its pixel hash), or one ImageError naming it."""
    rgb = decode(data, limits, name)
    h, w = rgb.shape[:2]
    digest = hashlib.blake2b(np.ascontiguousarray(rgb).tobytes(), digest_size=16, person=b"fermoe-image")
    digest.update(np.asarray(rgb.shape, "<i8").tobytes())
    return grid_of(w, h, cfg, limits), digest.digest()


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


@dataclass(frozen=True)
class ChatPlan:
    """A chat's expanded prompt as the image headers give it, its images not decoded yet."""
    tokens: list[int]
    spans: list[ImageSpan]
    data: list[bytes]           # each image as sent
    grids: list[tuple[int, int]]

    def prompt(self, decoded: list[tuple[tuple[int, int], bytes]]) -> ChatPrompt:
        """The ChatPrompt, from decode_image()'s (grid, digest) of each image."""
        for i, ((grid, _), planned) in enumerate(zip(decoded, self.grids, strict=True)):
            if grid != planned:                 # the header said another size than the pixels have
                raise ImageError(f"image {i + 1}: decoded to a {grid[0]}x{grid[1]} patch grid, its header "
                                 f"promised {planned[0]}x{planned[1]}")
        images = [PromptImage(d, grid, digest) for d, (grid, digest) in zip(self.data, decoded)]
        return ChatPrompt(self.tokens, self.spans, images)


def plan(tokenizer, messages, tools=None, chat_template_kwargs=None, vision: VisionConfig | None = None,
         limits: ImageLimits = ImageLimits(), max_image_bytes: int | None = None, **turn) -> ChatPlan:
    """The token ids of a chat, each image's placeholder expanded to its merged tokens, from the
    images' headers: every check that needs no decoded pixel, cheapest first. `turn`: how it
    ends (render_chat's continue_final, add_generation_prompt)."""
    data = chat_images(messages)
    if data and vision is None:
        raise FermoeError(f"the messages hold {len(data)} image(s), but no vision tower is loaded "
                          "(start with --mmproj FILE, the model's mmproj GGUF)")
    ids = tokenizer.encode(render_chat(tokenizer, messages, tools, chat_template_kwargs, **turn))
    if not data:
        return ChatPlan(ids, [], [], [])
    pad = tokenizer.token_to_id.get(IMAGE_PAD)
    if pad is None:
        raise FermoeError(f"the model's vocabulary has no {IMAGE_PAD} token: it cannot take images")
    placed = ids.count(pad)
    if placed == 0:
        raise FermoeError(f"the model's chat template places no image placeholder ({IMAGE_PAD}) for the "
                          f"{len(data)} image(s) sent: this model cannot take images")
    if placed != len(data):
        raise FermoeError(f"the prompt has {placed} image placeholder(s) ({IMAGE_PAD}) for {len(data)} image(s): "
                          "the chat template must place each image once (as Qwen3.5's does)")
    sizes = []
    for i, d in enumerate(data):
        if max_image_bytes is not None and len(d) > max_image_bytes:
            raise FermoeError(f"image {i + 1}: {len(d)} bytes, over the limit of {max_image_bytes} bytes")
        sizes.append(header(d, limits, f"image {i + 1}"))
    total = sum(w * h for w, h in sizes)
    if total > limits.max_request_pixels:
        raise ImageError(f"the request's {len(data)} images hold {total} pixels together, over the limit of "
                         f"{limits.max_request_pixels} pixels a request")
    grids = []
    for i, (w, h) in enumerate(sizes):
        try:
            grids.append(grid_of(w, h, vision, limits))
        except ImageError as e:
            raise ImageError(f"image {i + 1}: {e}") from None
    tokens, spans = expand(ids, grids, pad, vision.n_merge)
    return ChatPlan(tokens, spans, data, grids)


def template_places_images(tokenizer) -> bool:
    """Whether the model's chat template places an image's placeholder for an image part."""
    pad = tokenizer.token_to_id.get(IMAGE_PAD)
    one = [{"role": "user", "content": [{"type": "image", "data": b""}, {"type": "text", "text": "?"}]}]
    try:
        return pad is not None and tokenizer.encode(render_chat(tokenizer, one)).count(pad) == 1
    except FermoeError:                         # a template that refuses the message takes no image either
        return False


def chat_prompt(tokenizer, messages, tools=None, chat_template_kwargs=None, vision: VisionConfig | None = None,
                limits: ImageLimits = ImageLimits(), max_image_bytes: int | None = None) -> ChatPrompt:
    """The token ids of a chat, each image's placeholder expanded to its merged tokens: plan(),
    then each image decoded here (`fermoe generate --image`; the coordinator decodes off its loop)."""
    p = plan(tokenizer, messages, tools, chat_template_kwargs, vision, limits, max_image_bytes)
    return p.prompt([decode_image(d, vision, limits, f"image {i + 1}") for i, d in enumerate(p.data)])
