"""The vision tower's numpy reference against Hugging Face's Qwen3_5MoeVisionModel on tiny
random towers (float64 on both sides, so a wrong GELU or rounding shows), images already
multiples of 32 so nothing is resized; several images in one HF batch stay apart."""
from __future__ import annotations

import numpy as np
import pytest

from shared.vision.reference import encode_image, merge_order, position_embedding

vo = pytest.importorskip("tests.support.vision_oracle")
pytestmark = pytest.mark.oracle

# (height, width) in pixels: non-square both ways, one merged token, the table's own 48x48 grid
SIZES = [(64, 96), (128, 64), (32, 32)]
# float64 against float64. HF's rotary runs in float32 whatever the model's dtype (about 1e-7);
# the merger's tanh GELU in place of erf would be 3e-5 off.
TOL = 2e-6


@pytest.fixture(scope="module", params=sorted(vo.TOWERS))
def tower(request):
    model = vo.build_hf_tower(request.param, seed=3).double()
    return model, vo.StateDictTower(model)


def test_tower_matches_hf(tower):
    model, ours = tower
    images = [vo.random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    pooled, _ = vo.hf_encode(model, images)          # one batch: attention must stay within each image
    for image, want in zip(images, pooled):
        got = encode_image(ours, vo.hf_patchify(image), (image.shape[1] // 16, image.shape[2] // 16))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL * max(1, np.abs(want).max()))


def test_every_block_matches_hf(tower):
    model, ours = tower
    image = vo.random_image(96, 64, seed=7)
    _, hidden_hf = vo.hf_encode(model, [image])
    hidden = []
    encode_image(ours, vo.hf_patchify(image), (6, 4), hidden=hidden)
    assert len(hidden) == len(hidden_hf) == ours.config.n_layer + 1
    for i, (got, want) in enumerate(zip(hidden, hidden_hf)):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=f"hidden state {i}")


def test_the_table_own_grid_is_not_resampled():
    """At the table's own size (768 x 768 pixels) the bilinear resampling is the identity."""
    table = np.random.default_rng(0).standard_normal((48 * 48, 8)).astype(np.float32)
    order = merge_order(48, 48, 2)
    np.testing.assert_array_equal(position_embedding(table, 48, 48, 48, order), table[order])


def test_a_bad_grid_is_refused(tower):
    _, ours = tower
    with pytest.raises(ValueError, match="not a positive multiple of the merge size"):
        encode_image(ours, np.zeros((15, 1536), np.float32), (3, 5))
    with pytest.raises(ValueError, match="needs"):
        encode_image(ours, np.zeros((15, 1536), np.float32), (4, 4))
