"""The CPU vision engine (float32, BLAS) against Hugging Face's tower on tiny random towers
(within 1e-4, one and two threads) and against the float64 reference on a synth tower."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cpu_worker.vision_engine import VisionEngine, erf
from shared.errors import FermoeError
from shared.vision.reference import encode_image
from modeltools.vision.synth import RandomTower, preset_config

vo = pytest.importorskip("tests.support.vision_oracle")


@pytest.mark.oracle
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", sorted(vo.TOWERS))
def test_engine_matches_hf(shape, threads):
    model = vo.build_hf_tower(shape, seed=5)
    engine = VisionEngine(vo.StateDictTower(model), threads=threads)
    images = [vo.random_image(96, 160, seed=1), vo.random_image(224, 64, seed=2)]
    pooled, _ = vo.hf_encode(model, images)
    try:
        for image, want in zip(images, pooled):
            got = engine.encode(vo.hf_patchify(image), (image.shape[1] // 16, image.shape[2] // 16))
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    finally:
        engine.close()


def test_engine_matches_the_reference_on_a_larger_image():
    tower = RandomTower(preset_config("tiny"), seed=2)
    pixels = np.random.default_rng(0).uniform(-1, 1, (24 * 40, 1536)).astype(np.float32)
    engine = VisionEngine(tower, threads=2)
    try:
        got = engine.encode(pixels, (24, 40))
    finally:
        engine.close()
    want = encode_image(tower, pixels, (24, 40))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_erf_is_accurate():
    x = np.linspace(-8, 8, 20001, dtype=np.float32)
    want = np.array([math.erf(v) for v in x.astype(float)])
    assert np.abs(erf(x) - want).max() < 1e-6


def test_bad_thread_counts_are_refused():
    with pytest.raises(FermoeError, match="--threads 100000: must be between 1 and"):
        VisionEngine(RandomTower(preset_config("tiny")), threads=100000)
