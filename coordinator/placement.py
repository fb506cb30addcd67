"""Where a prompt is prefilled, pure policy: on a GPU worker or on the CPU worker that
will decode it.

Each kind's time for the part of the prompt not in the snapshot cache is estimated from
what the workers measured at start and update as they serve: a fixed cost (a GPU worker
streams the expert layers it does not hold, however short the prompt) plus the tokens at
the worker's prefill rate. A GPU worker takes the prompts waiting on it into one batch
after the one it is running, so a prompt sent to a busy one waits for the running batch
and then shares the next one's fixed cost: its estimate counts the fixed cost twice and
the tokens queued before it. A CPU worker interleaves a prompt with its running
sequences, so its estimate is the prompt alone. A prompt's images past the cache add their tokens at the
rate each kind's vision tower has shown (learned from the images it served: until both kinds
have encoded one, images are left out of the comparison). `--prefill gpu|cpu` overrides the
choice.
"""
from __future__ import annotations

from dataclasses import dataclass

PREFILL_MODES = ("auto", "gpu", "cpu")
GPU_QUEUE = 8               # prompts a GPU worker holds at once: those running and the next batch


@dataclass(frozen=True)
class Placement:
    device: str                  # "gpu" or "cpu"
    worker: str | None           # the GPU worker's id ("gpu"), or None: the CPU scheduler picks
    estimates: dict              # {"gpu": ms, "cpu": ms} of what could be estimated


def estimate_ms(tokens: int, tok_s: float, fixed_ms: float = 0.0) -> float | None:
    return fixed_ms + 1000.0 * tokens / tok_s if tok_s > 0 else None


def gpu_estimate_ms(worker, uncached: int, queued_tokens: int = 0, image_ms: float = 0.0) -> float | None:
    """A GPU worker's time to prefill `uncached` tokens behind the `queued_tokens` of the
    prompts it holds (a busy worker: the running batch's fixed cost, then the next's), and
    to encode the prompt's images (image_ms)."""
    fixed = worker.prefill_fixed_ms * (2 if worker.requests else 1) + image_ms
    return estimate_ms(queued_tokens + uncached, worker.prefill_tok_s, fixed)


def image_ms(image_tokens: int, gpu_vision_tok_s: float, cpu_vision_tok_s: float) -> tuple[float, float]:
    """The images' tower time on a GPU worker and on a CPU worker, both 0 unless both rates
    are known (a guess for one kind only would tilt the choice)."""
    if image_tokens <= 0 or gpu_vision_tok_s <= 0 or cpu_vision_tok_s <= 0:
        return 0.0, 0.0
    return 1000.0 * image_tokens / gpu_vision_tok_s, 1000.0 * image_tokens / cpu_vision_tok_s


def place_prefill(mode: str, uncached: int, gpu_workers: list, cpu_tok_s: float,
                  queued: dict[str, int] | None = None, image_tokens: int = 0,
                  cpu_vision_tok_s: float = 0.0) -> Placement | None:
    """The placement of a prefill of `uncached` tokens, `image_tokens` of them an image's
    (to encode first); None: wait (only `--prefill gpu` with every GPU worker full).
    gpu_workers: the ready GPU workers' views (their prefill_tok_s, vision_tok_s and the
    prompts they hold); queued: each one's tokens still to prefill."""
    queued = queued or {}
    cpu_ms = estimate_ms(uncached, cpu_tok_s)
    free = [w for w in gpu_workers if len(w.requests) < GPU_QUEUE]
    if uncached == 0 or mode == "cpu" or not gpu_workers:
        return Placement("cpu", None, {"cpu": cpu_ms} if cpu_ms is not None else {})
    if not free:
        return None if mode == "gpu" else Placement("cpu", None, {"cpu": cpu_ms} if cpu_ms is not None else {})

    def gpu_ms_of(w) -> float | None:
        return gpu_estimate_ms(w, uncached, queued.get(w.worker_id, 0),
                               image_ms(image_tokens, w.vision_tok_s, cpu_vision_tok_s)[0])
    best = min(free, key=lambda w: (gpu_ms_of(w) or float("inf"), w.worker_id))
    gpu_ms = gpu_ms_of(best)
    if cpu_ms is not None:
        cpu_ms += image_ms(image_tokens, best.vision_tok_s, cpu_vision_tok_s)[1]
    estimates = {k: v for k, v in (("gpu", gpu_ms), ("cpu", cpu_ms)) if v is not None}
    if mode == "gpu" or cpu_ms is None or (gpu_ms is not None and gpu_ms < cpu_ms):
        return Placement("gpu", best.worker_id, estimates)
    return Placement("cpu", None, estimates)
