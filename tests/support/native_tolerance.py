"""How far the native engine's logits may be from the numpy reference's on the same
float weights, and the measure of it: shared by the engine's tests and by those of
files made from a model (a pruned one runs as its original does)."""
from __future__ import annotations

import numpy as np

# Native against the reference: the same arithmetic summed in other orders, in units
# of the largest |logit|. Whole prompts on float weights (F32 and F16 files, which
# round no activation): measured on every ISA with 1 and 2 threads, at most 2.6e-6
# with an f32 KV cache, and 1.3e-5 with f16, where a K or V within float noise of an
# fp16 rounding tie rounds the other way (2^-11 of it). The bounds are twice that.
PROMPT_RTOL = {"f32": 5e-6, "f16": 3e-5}


def rel_error(got, want) -> float:
    """max |got - want| in units of want's largest magnitude."""
    return np.abs(got - want).max() / np.abs(want).max()
