"""The devices the GPU tests run on: the host emulation everywhere, and the CUDA
device where there is one (marked `gpu`: `pytest -m gpu` on the GPU machine; a
reported skip elsewhere)."""
from __future__ import annotations

import atexit
import functools

import numpy as np
import pytest

from shared.errors import FermoeError

DEVICES = ["emulate", pytest.param("cuda", marks=pytest.mark.gpu)]


def assert_close(got, want, rtol: float, floor: float | None = None) -> None:
    """max |got - want| (in float64) within rtol of want's scale, its largest magnitude.
    With floor, a scale at or below it fails: the values collapsed (logits near 0) and
    the comparison would test nothing."""
    scale = float(np.abs(want).max())
    if floor is not None:
        assert scale > floor, f"scale {scale:.3g}: the values collapsed, the comparison would test nothing"
    scale = max(scale, 1e-30)               # an all-zero want: got must be zero too
    err = float(np.abs(np.asarray(got, np.float64) - want).max())
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol} x scale {scale:.3g}"


@functools.cache
def cuda_device():
    from gpu_worker.cuda import CudaDevice
    device = CudaDevice(0)
    atexit.register(device.close)       # pycuda aborts the process if a context is left pushed
    return device


def open_test_device(kind: str):
    if kind == "emulate":
        from gpu_worker.emulator import EmulatedDevice
        return EmulatedDevice()
    try:
        return cuda_device()
    except FermoeError as e:
        pytest.skip(f"no CUDA device here: {e}")


@functools.cache
def _ops(kind: str):
    from gpu_worker.ops import Ops
    return Ops(open_test_device(kind))


@pytest.fixture(scope="module", params=DEVICES)
def ops(request):
    """Kernel launchers on each test device."""
    return _ops(request.param)
