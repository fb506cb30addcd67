"""Where a pass's GPU time goes: events recorded on the compute stream at each
phase boundary; the time from one mark to the next is the earlier mark's phase.
A mark just before the wait for an expert layer's copy and one just after it time
the stall (`copy_wait`)."""
from __future__ import annotations

from collections import defaultdict


class PhaseTimer:
    def __init__(self, device, stream):
        self.device, self.stream = device, stream
        self.marks: list[tuple[str, object]] = []

    def mark(self, phase: str) -> None:
        event = self.device.event()
        event.record(self.stream)
        self.marks.append((phase, event))

    def milliseconds(self) -> dict[str, float]:
        """Milliseconds by phase since the first mark (waits for the stream); clears the marks."""
        self.stream.synchronize()
        out: dict[str, float] = defaultdict(float)
        for (phase, start), (_, end) in zip(self.marks, self.marks[1:]):
            out[phase] += end.time_since(start)
        self.marks.clear()
        return dict(out)
