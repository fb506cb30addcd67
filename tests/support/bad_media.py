"""The checks every engine makes of a prompt's image rows before it runs them."""
from __future__ import annotations

import numpy as np
import pytest

from shared.errors import FermoeError
from shared.reference import text_positions
from shared.vision.prompt import TokenMedia


def assert_refuses_bad_media(engine) -> None:
    """Embeddings of the wrong width and positions for the wrong number of tokens are refused."""
    bad = TokenMedia(text_positions(0, 3), np.array([1]), np.zeros((1, 7), np.float32))
    with pytest.raises(FermoeError, match=r"image embeddings of shape \(1, 7\)"):
        engine.forward([1, 2, 3], engine.new_state(), media=bad)
    with pytest.raises(FermoeError, match="image positions of shape"):
        engine.forward([1, 2], engine.new_state(), media=bad)
