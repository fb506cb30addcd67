"""What the GPU worker's tests share: the tiny Q4_0 model, loaded once a module."""
from __future__ import annotations

import pytest

from shared.model import Model


@pytest.fixture(scope="module")
def tiny(tiny_q4_path):
    return Model(tiny_q4_path)
