"""Huge images in a few KB: 1-bit greyscale PNGs written by hand (Pillow would hold every
pixel in a byte to write one), white, the pixel data compressed in a stream."""
from __future__ import annotations

import struct
import zlib


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def blank_png(w: int, h: int, rows: int | None = None, rgb: bool = False) -> bytes:
    """A w x h 1-bit PNG (8-bit RGB with `rgb`: slower to decode); with `rows`, its pixel
    data stops after that many rows (the header is whole: only a full decode finds the cut)."""
    row = b"\x00" + b"\xff" * (3 * w if rgb else (w + 7) // 8)      # filter 0, white pixels
    z = zlib.compressobj(9)
    out = []
    left = h if rows is None else rows
    while left:
        n = min(left, 256)
        out.append(z.compress(row * n))
        left -= n
    idat = b"".join(out) + (z.flush() if rows is None else z.flush(zlib.Z_SYNC_FLUSH))
    ihdr = struct.pack(">IIBBBBB", w, h, *((8, 2) if rgb else (1, 0)), 0, 0, 0)    # deflate, filter 0, no interlace
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
