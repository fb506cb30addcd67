"""The devices the GPU tests run on: the host emulation everywhere, and the CUDA
device where there is one (marked `gpu`: `pytest -m gpu` on the GPU machine; a
reported skip elsewhere)."""
from __future__ import annotations

import atexit
import functools

import pytest

from shared.errors import FermoeError

DEVICES = ["emulate", pytest.param("cuda", marks=pytest.mark.gpu)]


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
