"""The JSON field types of the request bodies, with their ranges.

Every integer is bounded: an unbounded one (a seed of 2**64, say) would decode here
and then fail to serialise as MessagePack on its way to the coordinator, a 500 where
the client deserves a 400 naming the field. MessagePack carries integers in
[-2**63, 2**64); the bounds below are tighter where the field means less, and a
seed's upper bound (2**64 - 1, past msgspec's int64 bounds) is checked in openai_request.py.
"""
from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

INT64_MIN, INT64_MAX, UINT64_MAX = -2**63, 2**63 - 1, 2**64 - 1

Int = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepeatPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]           # vLLM's -1 and llama.cpp's 0: off
MaxTokens = Annotated[int, Meta(ge=1, le=INT64_MAX)]
NPredict = Annotated[int, Meta(ge=-1, le=INT64_MAX)]       # llama.cpp's -1: until the end
# -1: random, as llama.cpp's; a seed is 64 bits, above what msgspec bounds (int64): openai_request.py checks it
Seed = Annotated[int, Meta(ge=-1)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Stop = str | Annotated[list[str], Meta(max_length=16)] | None


class Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A request body: strict, as OpenAI's ("Unrecognized request argument supplied")."""
