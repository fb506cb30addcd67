"""Images decoded off the coordinator's event loop.

A request's images are checked from their headers on the loop (shared/vision/chat.py
plan(): cheap); their full decode and pixel hash, which take seconds for a large image
and hold the GIL (Pillow's conversions, numpy's copies), run here in a small pool of
processes, so the loop goes on serving every other request meanwhile. The pool starts
with the first image request (a daemon without images pays nothing); a finished decode
writes a byte to a pipe the loop polls, so its request is queued at once. A pool
process that dies (killed, out of memory) fails only the requests it held, and the
next request starts a new pool.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from shared.errors import FermoeError
from shared.vision.chat import decode_image

log = logging.getLogger("fermoe.coordinator")
# Processes decoding images: one keeps at most one image's pixels (up to 64 Mi pixels,
# 192 MiB as RGB) in memory at a time, and the machine's cores to the workers.
DECODE_PROCESSES = 1


def decode_all(data: list[bytes], cfg, limits) -> list[tuple[tuple[int, int], bytes]]:
    """Each image's (grid, pixel hash), in a pool process; the first bad one raises ImageError."""
    return [decode_image(d, cfg, limits, f"image {i + 1}") for i, d in enumerate(data)]


class ImageDecoder:
    """Decodes the images of requests in a process pool; the loop polls `fd` and calls
    finished() when it is readable."""

    def __init__(self, fn=decode_all, processes: int = DECODE_PROCESSES):
        import PIL.JpegImagePlugin, PIL.PngImagePlugin     # noqa: F401  (now, not on the loop with the first image)
        self.fn, self.processes = fn, processes
        self.pool: ProcessPoolExecutor | None = None
        self.pending: list[tuple] = []          # (the caller's key, its future, the pool it runs in), in order
        self.fd, self._wake_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake_fd, False)

    def submit(self, key, data: list[bytes], *args) -> None:
        """Start decoding `data` for `key` (a request): finished() gives it back."""
        if self.pool is None:       # spawn: a fork of the coordinator would copy its sockets and threads
            self.pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        future = self.pool.submit(self.fn, data, *args)
        self.pending.append((key, future, self.pool))
        future.add_done_callback(self._wake)    # (from the pool's thread, or here if done already)

    def _wake(self, _future) -> None:
        try:
            os.write(self._wake_fd, b"\0")
        except (BlockingIOError, OSError):      # full: a wake-up is waiting already; closed: shutting down
            pass

    def cancel(self, key) -> None:
        """Forget `key`'s decode (its request ended): dropped unstarted, or its result when it comes."""
        for entry in [p for p in self.pending if p[0] is key]:
            entry[1].cancel()
            self.pending.remove(entry)

    def finished(self) -> list[tuple[object, list | None, FermoeError | None]]:
        """(key, each image's (grid, digest), None) or (key, None, the error) of each decode done."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        out, broken = [], []
        for key, future, pool in [p for p in self.pending if p[1].done()]:
            self.pending.remove((key, future, pool))
            try:
                out.append((key, future.result(), None))
            except FermoeError as e:
                out.append((key, None, e))
            except BrokenProcessPool:
                broken.append(pool)
                out.append((key, None, FermoeError("the process decoding the images died (killed, or out of "
                                                   "memory); the request's images were not read")))
            except Exception as e:              # a Pillow or numpy fault on hostile data: this request's alone
                out.append((key, None, FermoeError(f"decoding the images failed: {type(e).__name__}: {e}")))
        if self.pool is not None and self.pool in broken:     # (an older pool's stragglers leave the new one be)
            log.error("the image decoding process died: the requests whose images it held failed; a new one "
                      "starts with the next image request")
            self._drop_pool()
        return out

    def _drop_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is None:
            return
        pool.shutdown(wait=False, cancel_futures=True)
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()                 # a decode still running is nobody's now: not waited for

    def close(self) -> None:
        for _, future, _ in self.pending:
            future.cancel()
        self.pending = []
        self._drop_pool()
        for fd in (self.fd, self._wake_fd):
            os.close(fd)
