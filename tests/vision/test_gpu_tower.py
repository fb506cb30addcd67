"""The vision tower on the GPU (gpu_worker/vision.py, native/cuda/vision.cu) against the
float64 reference (shared/vision/reference.py) on tiny random towers of odd sizes, two
images of different grids each, in the host emulation and (`-m gpu`) on the device; the
mmproj's stored types (f16, q8_0) read by the GEMMs as they are; the reserved workspace
and a larger image beside it; the activations' kernels over their whole range."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_worker.buffers import DeviceArray
from gpu_worker.vision import GELU_ERF, GELU_TANH, GPUVisionEngine, workspace_floats
from shared.errors import FermoeError
from shared.vision.config import VisionConfig
from shared.vision.mmproj import Mmproj
from shared.vision.reference import encode_image, gelu_erf, gelu_tanh
from modeltools.vision.synth import RandomTower, synth_mmproj
from tests.support.gpu_device import DEVICES, assert_close, open_test_device

# fp32 against float64: sums in another order, the GPU's exp2 approximation (~2 ulp)
# and erf to 1.5e-7, through a few blocks; relative to the largest output
TOWER_RTOL = 3e-5


def config(n_embd, n_head, n_ff, n_layer=2, projection_dim=40, image_size=768):
    return VisionConfig(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_head, patch_size=16,
                        image_size=image_size, n_merge=2, projection_dim=projection_dim)


# head sizes 12 (one 16-wide register column), 72 (the real tower's), 100 (a partial 32-dim
# chunk), 128 (the kernel's largest); widths and MLPs no multiple of anything in particular
TOWERS = {
    "hd12": config(48, 4, 72),
    "hd72": config(144, 2, 100, n_layer=1, projection_dim=56),
    "hd100": config(200, 2, 84, n_layer=1, projection_dim=24, image_size=16 * 20),
    "hd128": config(128, 1, 96, n_layer=1),
}
# patch grids: under one tile of 64 rows, and over two with a partial third
GRIDS = [(4, 6), (10, 14)]


def pixels(gh: int, gw: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (gh * gw, 1536)).astype(np.float32)


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return open_test_device(request.param)


@pytest.mark.parametrize("shape", sorted(TOWERS))
def test_tower_matches_the_reference(device, shape):
    tower = RandomTower(TOWERS[shape], seed=3)
    engine = GPUVisionEngine(tower, device)
    try:
        for i, grid in enumerate(GRIDS):
            px = pixels(*grid, seed=i)
            got = engine.encode(px, grid)
            assert got.dtype == np.float32 and got.shape == (grid[0] * grid[1] // 4, tower.config.projection_dim)
            assert_close(got, encode_image(tower, px, grid), TOWER_RTOL, floor=0.1)
    finally:
        engine.close()


def test_one_block_of_the_real_tower(device):
    """The real widths (1152, 16 heads of 72, MLP 4304, merger 4608 -> 2048; one block of the
    27): the shapes the GEMMs tile and split differently, over two 64-row tiles of patches."""
    from dataclasses import replace

    from modeltools.vision.synth import preset_config
    tower = RandomTower(replace(preset_config("qwen3.6-35b-a3b"), n_layer=1), seed=0)
    engine = GPUVisionEngine(tower, device)
    try:
        px = pixels(8, 10, seed=7)
        assert_close(engine.encode(px, (8, 10)), encode_image(tower, px, (8, 10)), TOWER_RTOL, floor=0.1)
    finally:
        engine.close()


@pytest.mark.oracle
@pytest.mark.parametrize("shape", ["a", "b"])
def test_tower_matches_hf(device, shape):
    """Against Hugging Face's Qwen3_5MoeVisionModel (float32, eager attention) within 1e-4,
    as the CPU engine is held to."""
    vo = pytest.importorskip("tests.vision_oracle")
    model = vo.build_hf_tower(shape, seed=5)
    engine = GPUVisionEngine(vo.StateDictTower(model), device)
    images = [vo.random_image(96, 160, seed=1), vo.random_image(224, 64, seed=2)]
    pooled, _ = vo.hf_encode(model, images)
    try:
        for image, want in zip(images, pooled):
            got = engine.encode(vo.hf_patchify(image), (image.shape[1] // 16, image.shape[2] // 16))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_stored_types_are_read_as_stored(device, tmp_path, kind):
    """An mmproj file's matrices stay f16 / q8_0 on the device (the GEMMs dequantise them):
    the result is the reference's on the same (dequantised) weights."""
    path = tmp_path / f"tower-{kind}.gguf"
    synth_mmproj(path, config(64, 2, 96, projection_dim=32), kind, seed=4)
    tower = Mmproj(path)
    engine = GPUVisionEngine(tower, device)
    try:
        assert engine.blocks[0]["attn_qkv.weight"].wtype == kind and engine.merger["mm.0.bias"].wtype == "f32"
        px = pixels(6, 4, seed=5)
        assert_close(engine.encode(px, (6, 4)), encode_image(tower, px, (6, 4)), TOWER_RTOL, floor=0.1)
    finally:
        engine.close()
        tower.close()


def test_reserved_workspace_and_a_larger_image(device):
    """Images within the reserve run in it; a larger one gets its own workspace for its pass
    (freed after); the results are the same either way, in any order."""
    tower = RandomTower(TOWERS["hd12"], seed=6)
    small, large = (4, 6), (10, 14)
    plain = GPUVisionEngine(tower, device)
    reserved = GPUVisionEngine(tower, device, reserve_patches=small[0] * small[1])
    try:
        assert reserved.nbytes == plain.nbytes + 4 * workspace_floats(tower.config, 24)
        want = {g: plain.encode(pixels(*g, seed=1), g) for g in (small, large)}
        for g in (large, small, large):
            np.testing.assert_array_equal(reserved.encode(pixels(*g, seed=1), g), want[g])
        assert reserved.ws.n == 24
    finally:
        plain.close()
        reserved.close()


def test_activations_over_their_range(device):
    """vis_bias_act's GELUs (tanh form: no overflow at large |x|; the exact erf form) against
    float64, from -12 to 12."""
    from gpu_worker.ops import Ops
    ops = Ops(device)
    x = np.linspace(-12, 12, 3 * 1001, dtype=np.float32).reshape(3, 1001)
    b = np.float32([0.5]) * np.ones(1001, np.float32)
    from gpu_worker.weights import GpuWeight
    bias = GpuWeight(DeviceArray.of(device, b), "f32", b.shape)
    for act, fn in ((GELU_TANH, gelu_tanh), (GELU_ERF, gelu_erf), (0, lambda v: v)):
        buf = DeviceArray.of(device, x)
        ops.k.vis_bias_act((2,), (256,), ops.stream, buf, bias.data, 3, 1001, act)
        got = buf.download()
        want = fn(x.astype(np.float64) + 0.5)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=5e-7)


def test_bad_inputs_are_refused(device):
    tower = RandomTower(TOWERS["hd12"], seed=1)
    with pytest.raises(FermoeError, match="vision head size 144: the GPU tower takes up to 128"):
        GPUVisionEngine(RandomTower(config(144, 1, 64, n_layer=1)), device)
    engine = GPUVisionEngine(tower, device)
    with pytest.raises(ValueError, match=r"pixels have shape \(24, 1536\); a 4x4 grid needs"):
        engine.encode(pixels(4, 6, seed=0), (4, 4))
    with pytest.raises(ValueError, match="patch grid 3x4 is not a positive multiple"):
        engine.encode(pixels(3, 4, seed=0), (3, 4))
    engine.close()
    with pytest.raises(FermoeError, match="the GPU vision engine is closed"):
        engine.encode(pixels(4, 4, seed=0), (4, 4))


def test_scale_of_the_real_tower_workspace():
    """The docstring's figure: a 1024x1024 image through the real tower's workspace."""
    from modeltools.vision.synth import preset_config
    cfg = preset_config("qwen3.6-35b-a3b")
    assert math.isclose(4 * workspace_floats(cfg, 64 * 64) / 2 ** 20, 112, abs_tol=0.5)


def test_a_tower_or_a_workspace_that_does_not_fit_is_one_error():
    """Out of device memory (an emulated device of a few MiB): one error saying what did not
    fit, and nothing left allocated."""
    from gpu_worker.emulator import EmulatedDevice
    tower = RandomTower(TOWERS["hd12"], seed=1)
    small = EmulatedDevice(total_memory=8 << 20)           # under the split-K scratch
    with pytest.raises(FermoeError, match="the vision tower does not fit the GPU: 0 MiB of its weights"):
        GPUVisionEngine(tower, small)
    assert small.allocated == 0
    roomy = EmulatedDevice(total_memory=24 << 20)
    with pytest.raises(FermoeError, match=r"an image of 65536 patches needs \d+ MiB of GPU memory for the vision "
                                          r"tower's activations; \d+ MiB are free"):
        GPUVisionEngine(tower, roomy, reserve_patches=65536)
    assert roomy.allocated == 0
    engine = GPUVisionEngine(tower, roomy)
    with pytest.raises(FermoeError, match="an image of 9216 patches needs"):
        engine.encode(pixels(96, 96, seed=0), (96, 96))
    engine.close()
    assert roomy.allocated == 0
