"""Shared fixtures: the built-in tiny model, made once per test session."""
from __future__ import annotations

import pytest

from shared.synth import synth


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """The tiny preset in Q8_0 (every structural feature; a few hundred KB)."""
    path = tmp_path_factory.mktemp("models") / "tiny-q8_0.gguf"
    synth(path, "tiny", out_type="q8_0", seed=0, progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_q4_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-q4_0.gguf"
    synth(path, "tiny", out_type="q4_0", seed=0, progress=False)
    return path
