"""Images into the text model: a prompt's image placeholders expanded to the tower's
merged tokens, their embeddings and every token's (t, h, w) M-RoPE position.

As Hugging Face's Qwen3VLProcessor and Qwen3_5MoeModel (llama.cpp's mtmd does the same):

- the chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per image; the one
  `<|image_pad|>` becomes gh*gw/4 of them (the merged patches of a gh x gw patch grid);
- the i-th `<|image_pad|>` of the prompt takes the i-th merged token, images in order,
  each image's tokens row-major over its (gh/2) x (gw/2) grid;
- positions: text tokens (p, p, p) counting up; an image starting at p takes
  (p, p + row, p + col) and the text after it goes on from p + max(gh/2, gw/2)
  (shared/reference.py: M-RoPE).
"""
from __future__ import annotations

from dataclasses import dataclass

import time

import numpy as np

from ..errors import FermoeError
from ..reference import text_positions

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class TokenMedia:
    """What a run of tokens carries besides their ids.

    positions [T, 3] int64: each token's (t, h, w) M-RoPE position;
    rows [n] int64, ascending: the tokens (indices into the run) whose embedding is replaced;
    embeds [n, n_embd] float32: what replaces them, in order."""
    positions: np.ndarray
    rows: np.ndarray
    embeds: np.ndarray

    def check(self, n_tokens: int, n_embd: int) -> None:
        if self.positions.shape != (n_tokens, 3):
            raise FermoeError(f"image positions of shape {self.positions.shape} for {n_tokens} tokens")
        if self.embeds.shape != (len(self.rows), n_embd):
            raise FermoeError(f"image embeddings of shape {self.embeds.shape}: expected "
                              f"({len(self.rows)}, {n_embd}), one row of the model's width per image token")
        if len(self.rows) and (self.rows.min() < 0 or self.rows.max() >= n_tokens):
            raise FermoeError("image token rows outside the tokens they belong to")

    def slice(self, start: int, end: int) -> "TokenMedia":
        """The part of tokens [start, end) (rows renumbered from start)."""
        a, b = np.searchsorted(self.rows, [start, end])
        return TokenMedia(self.positions[start:end], self.rows[a:b] - start, self.embeds[a:b])

    def next_position(self) -> int:
        """The M-RoPE position of the token after these (the text after an image goes on
        from its largest position + 1)."""
        return int(self.positions[-1].max()) + 1


def media_for(state, n_tokens: int, media: TokenMedia | None) -> TokenMedia | None:
    """The media of n tokens about to run on `state`: as given, or for text after an image
    (the state's rope delta not 0) text positions from its next one; None for plain text
    where every engine's own text path runs."""
    if media is not None:
        return media
    if state.rope_delta == 0:
        return None
    return TokenMedia(text_positions(state.position + state.rope_delta, n_tokens), np.zeros(0, np.int64),
                      np.zeros((0, state.cfg.n_embd), np.float32))


@dataclass(frozen=True)
class ImageSpan:
    """One image in an expanded prompt: its tokens [start, start + n) and merged grid."""
    start: int
    rows: int           # gh / 2
    cols: int           # gw / 2

    @property
    def n(self) -> int:
        return self.rows * self.cols


def expand(ids, grids, image_pad_id: int, merge: int = 2) -> tuple[list[int], list[ImageSpan]]:
    """Token ids with one `<|image_pad|>` per image -> each one repeated to its image's
    merged token count; grids: each image's patch grid (gh, gw), in prompt order."""
    ids = list(ids)
    where = [i for i, t in enumerate(ids) if t == image_pad_id]
    if len(where) != len(grids):
        raise FermoeError(f"the prompt has {len(where)} image placeholder(s) ({IMAGE_PAD}) for {len(grids)} "
                          "image(s): the chat template must place each image once (as Qwen3.5's does)")
    out, spans, prev = [], [], 0
    for i, (gh, gw) in zip(where, grids):
        if gh % merge or gw % merge:
            raise FermoeError(f"image grid {gh}x{gw} is not a multiple of the merge size {merge}")
        out += ids[prev:i]
        span = ImageSpan(len(out), gh // merge, gw // merge)
        out += [image_pad_id] * span.n
        spans.append(span)
        prev = i + 1
    return out + ids[prev:], spans


def positions(n_tokens: int, spans: list[ImageSpan]) -> np.ndarray:
    """The (t, h, w) positions [n_tokens, 3] of a prompt whose images lie at `spans`."""
    out = np.empty((n_tokens, 3), np.int64)
    pos, at = 0, 0                              # next M-RoPE position, next token
    for s in sorted(spans, key=lambda s: s.start):
        out[at:s.start] = text_positions(pos, s.start - at)
        pos += s.start - at
        r, c = np.divmod(np.arange(s.n), s.cols)
        out[s.start:s.start + s.n] = np.stack([np.full(s.n, pos), pos + r, pos + c], axis=1)
        pos += max(s.rows, s.cols)
        at = s.start + s.n
    out[at:] = text_positions(pos, n_tokens - at)
    return out


def prompt_media(n_tokens: int, spans: list[ImageSpan], embeds: list[np.ndarray], n_embd: int) -> TokenMedia:
    """The TokenMedia of a whole expanded prompt: each image's tower output [n, n_embd] at its span."""
    for s, e in zip(spans, embeds, strict=True):
        if e.shape != (s.n, n_embd):
            raise FermoeError(f"an image of {s.rows}x{s.cols} merged tokens got embeddings of shape {e.shape}, "
                              f"expected ({s.n}, {n_embd})")
    rows = [np.arange(s.start, s.start + s.n, dtype=np.int64) for s in spans]
    return TokenMedia(positions(n_tokens, spans), np.concatenate(rows) if rows else np.zeros(0, np.int64),
                      np.concatenate(embeds).astype(np.float32) if embeds else np.zeros((0, n_embd), np.float32))


def build(ids, images, encode, image_pad_id: int, n_embd: int, merge: int = 2) -> tuple[list[int], TokenMedia]:
    """A prompt's token ids (one `<|image_pad|>` per image) and its images [(pixels, (gh, gw))]
    -> the expanded ids and their TokenMedia; encode(pixels, grid) is the tower's forward."""
    ids, spans = expand(ids, [grid for _, grid in images], image_pad_id, merge)
    return ids, prompt_media(len(ids), spans, [encode(p, g) for p, g in images], n_embd)


class ImageEncoder:
    """PNG/JPEG bytes -> the tower's merged tokens [rows * cols, n_embd] and (rows, cols):
    the image processor, then forward(pixels, (gh, gw)) (a VisionEngine's encode, or the
    reference's)."""

    def __init__(self, config, forward, limits=None):
        from .image import ImageLimits
        self.config, self.forward, self.limits = config, forward, limits or ImageLimits()
        self.seconds, self.tokens = 0.0, 0      # what it has encoded so far: a worker reports its rate

    def __call__(self, data: bytes, name: str = "image") -> tuple[np.ndarray, tuple[int, int]]:
        from .image import load
        t0 = time.perf_counter()
        pixels, (gh, gw) = load(data, self.config, self.limits, name)
        m = self.config.n_merge
        out = np.asarray(self.forward(pixels, (gh, gw)), np.float32)
        self.seconds += time.perf_counter() - t0
        self.tokens += (gh // m) * (gw // m)
        return out, (gh // m, gw // m)


def media_of_images(n_tokens: int, images, n_embd: int, encode: ImageEncoder, start: int = 0) -> TokenMedia:
    """The TokenMedia of a prompt of n_tokens whose images (each with .data, .start, .rows,
    .cols: protocol ImageInputs) lie where they say; only the images that reach past
    `start` (where the prompt resumes) are encoded, as only their rows are read."""
    spans = [ImageSpan(im.start, im.rows, im.cols) for im in images]
    for s in spans:
        if s.start < 0 or s.start + s.n > n_tokens:
            raise FermoeError(f"an image's tokens [{s.start}, {s.start + s.n}) lie outside the prompt's {n_tokens}")
    rows, embeds = [], []
    for i, (s, im) in enumerate(zip(spans, images)):
        if s.start + s.n <= start:
            continue
        e, grid = encode(im.data, f"image {i + 1}")
        if grid != (s.rows, s.cols):
            raise FermoeError(f"image {i + 1}: a {grid[0]}x{grid[1]} merged grid, but the prompt holds "
                              f"{s.rows}x{s.cols} tokens for it")
        rows.append(np.arange(s.start, s.start + s.n, dtype=np.int64))
        embeds.append(e)
    return TokenMedia(positions(n_tokens, spans), np.concatenate(rows) if rows else np.zeros(0, np.int64),
                      np.concatenate(embeds) if embeds else np.zeros((0, n_embd), np.float32))
