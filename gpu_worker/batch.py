"""The prompts of a batched GPU prefill (GPUEngine.prefill_batch). Their tokens form one
stream that passes cut where the memory plan says; the rows of a pass that belong to
one prompt are a Segment. Every row-wise step (norms, projections, experts) runs on the
whole pass; the steps that carry a sequence's history (the GDN convolution and
recurrence, attention) run a segment at a time on that prompt's Lane."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.reference import text_positions
from shared.state import SequenceState

from .buffers import DeviceArray


@dataclass
class PrefillJob:
    """One prompt of a batched prefill: its tokens from `state`'s position on, and the
    snapshots wanted (positions, or {position: state slot} with the KV block size);
    media: the tokens' images and M-RoPE positions (shared/vision/prompt.TokenMedia)."""
    tokens: object
    state: SequenceState
    snapshot_at: tuple = ()
    into: dict | None = None
    block: int | None = None
    media: object = None


@dataclass
class Prompt:
    """A job in flight: its rows' place in the batch's stream of tokens, its device lane
    and where its results land."""
    tokens: np.ndarray
    state: SequenceState
    start: int                  # the position of its first token
    offset: int                 # its first row's index in the batch's stream
    boundaries: list[int]       # snapshot positions
    media: object = None        # its TokenMedia; None: text at positions from `start` on
    lane: "Lane | None" = None
    snaps: dict = field(default_factory=dict)
    site: object = None         # its Landing site
    logits: dict = field(default_factory=dict)  # position -> the logits that predict it
    rows: list = field(default_factory=list)    # every row's logits, when all are asked for


@dataclass
class Segment:
    """The rows [begin, end) of a pass that belong to one prompt, the first at `position`."""
    prompt: Prompt
    begin: int
    end: int
    position: int
    cuts: list[int]             # snapshot positions inside, as row counts from begin (1..length)
    last: bool                  # the prompt ends here: its recurrent state is the result

    @property
    def length(self) -> int:
        return self.end - self.begin

    def snapshot(self, c: int) -> SequenceState:
        """Where the recurrent state after c of these rows lands (c one of `cuts`): the
        snapshot at that position."""
        return self.prompt.snaps[self.position + c]

    @property
    def result(self) -> SequenceState:
        """Where the prompt's final recurrent state lands (the segment is its `last`)."""
        return self.prompt.site.out

    def media(self):
        """The part of its prompt's TokenMedia in these rows (rows numbered from begin), or None."""
        m, i = self.prompt.media, self.position - self.prompt.start
        return m.slice(i, i + self.length) if m is not None else None

    def positions(self) -> np.ndarray:
        """Its rows' (t, h, w) M-RoPE positions [length, 3]."""
        m = self.media()
        return m.positions if m is not None else text_positions(self.position, self.length)


class Lane:
    """One sequence's state on the device: each GDN layer's S and conv state, each
    attention layer's K and V of every position the prompt reaches (fp32): the first
    `kv_layers` layers' in buffers of their own, the others' (None here) in the engine's
    slot, rows [slot_row, slot_row + positions), filled from host memory before each use."""

    def __init__(self, device, cfg):
        self.device, self.cfg = device, cfg
        self.S = {L: DeviceArray(device, (cfg.ssm_v_heads, cfg.ssm_head_k_dim, cfg.ssm_head_v_dim))
                  for L in cfg.gdn_layers}
        self.conv = {L: DeviceArray(device, (cfg.ssm_conv_kernel - 1, cfg.conv_channels)) for L in cfg.gdn_layers}
        self.Kc, self.Vc, self.positions, self.kv_layers, self.slot_row = [], [], 0, 0, 0
        self.prior: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # a spilled layer's K, V before the prefill (page-locked)

    def free_kv(self) -> None:
        for buf in self.Kc + self.Vc:
            if buf is not None:
                buf.free()
        self.Kc, self.Vc, self.positions, self.kv_layers = [], [], 0, 0

    def alloc_kv(self, positions: int, kv_layers: int) -> None:
        shape = (positions, self.cfg.n_head_kv, self.cfg.head_dim)
        n = len(self.cfg.attention_layers)
        self.Kc = [DeviceArray(self.device, shape) if a < kv_layers else None for a in range(n)]
        self.Vc = [DeviceArray(self.device, shape) if a < kv_layers else None for a in range(n)]
        self.positions, self.kv_layers = positions, kv_layers

    def free(self) -> None:
        self.free_kv()
        for buf in [*self.S.values(), *self.conv.values()]:
            buf.free()


def segment_of(p: Prompt, a: int, b: int) -> Segment:
    """Prompt p's rows within the pass over the batch's rows [a, b)."""
    begin, end = max(p.offset, a), min(p.offset + len(p.tokens), b)
    position = p.start + begin - p.offset
    return Segment(p, begin - a, end - a, position,
                   [q - position for q in p.boundaries if position < q <= position + end - begin],
                   last=end == p.offset + len(p.tokens))


def logit_rows(segments: list[Segment], all_logits: bool) -> dict[int, tuple[Prompt, int]]:
    """The pass rows whose logits are kept, ascending: row -> (its prompt, the position the
    logits predict): a snapshot's, a prompt's last, or all of them."""
    rows = {}
    for g in segments:
        ends = {c - 1 for c in g.cuts} | ({g.length - 1} if g.last else set())
        wanted = range(g.length) if all_logits else sorted(ends)
        for r in wanted:
            rows[g.begin + r] = (g.prompt, g.position + r + 1)
    return rows
