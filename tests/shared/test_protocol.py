"""The wire messages (shared/protocol.py): a whole context fits one message, and the one
size limit names the option that raises it."""
from __future__ import annotations

import pytest

from shared import protocol as P
from shared.errors import FermoeError
from shared.sampling import SamplingParams


def test_a_whole_context_of_token_ids_fits_in_an_assign():
    tokens = [248319] * 262144                       # the largest ids of Qwen3.5's vocabulary: 5 bytes each
    msg = P.Assign(request_id="r", tokens=tokens, resume=[], snapshots=[], max_tokens=1,
                   sampling=SamplingParams(seed=1))
    data = P.encode(msg)
    assert len(data) > 1 << 20 and P.decode(data, P.TO_WORKER).tokens == tokens


def test_the_message_limit_names_the_option_that_raises_it():
    data = P.encode(P.Generate(request_id="r", prompt="x" * 5000))
    P.set_max_message_bytes(4096)
    try:
        with pytest.raises(FermoeError, match=r"the message is \d+ bytes, over the limit of 4096 bytes .*"
                                              r"--max-request-size"):
            P.decode(data, P.CLIENT_MESSAGES)
    finally:
        P.set_max_message_bytes(P.MAX_MESSAGE_BYTES)
    assert P.decode(data, P.CLIENT_MESSAGES).prompt == "x" * 5000
