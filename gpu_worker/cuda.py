"""The real GPU through pycuda, behind the interface the engine uses (the host
emulation in emulator.py has the same one). pycuda is an optional dependency:
`pip install -e '.[gpu]'`."""
from __future__ import annotations

import ctypes
import os

from shared.errors import FermoeError

from .cuda_source import compose

NO_PYCUDA = ("--engine gpu needs pycuda and a CUDA driver ({why}); install them with "
             "pip install -e '.[gpu]', or set FERMOE_GPU=emulate to run the kernels on the CPU")


class CudaDevice:
    """One CUDA device with a context of its own, made current for this thread."""

    def __init__(self, index: int = 0):
        try:
            import pycuda.driver as drv
        except ImportError as e:
            raise FermoeError(NO_PYCUDA.format(why=f"import pycuda: {e}")) from None
        try:
            drv.init()
            count = drv.Device.count()
        except drv.Error as e:
            raise FermoeError(NO_PYCUDA.format(why=f"CUDA: {e}")) from None
        if not 0 <= index < count:
            raise FermoeError(f"--gpu {index}: this machine has {count} CUDA device(s)")
        self.drv = drv
        self.dev = drv.Device(index)
        self.name = self.dev.name()
        self.multiprocessors = self.dev.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        self.ctx = self.dev.make_context()
        self._module = None
        for name in ("mem_alloc", "mem_get_info", "memcpy_htod", "memcpy_htod_async", "memcpy_dtoh",
                     "memcpy_dtoh_async", "memcpy_dtod", "memcpy_dtod_async", "memset_d8", "memset_d8_async",
                     "pagelocked_empty"):
            setattr(self, name, getattr(drv, name))

    def register_host_memory(self, array, flags: int = 0) -> "HostRegistration":
        """Page-lock the memory under a C-contiguous array (whole host pages) for the
        device's asynchronous copies, until unregister(). Straight through the driver API:
        pycuda's register_host_memory fails on arrays that already have a base under
        numpy 2 ("Cannot set the NumPy array 'base' dependency more than once")."""
        return HostRegistration(array, flags)

    def stream(self, role: str):
        return self.drv.Stream()

    def event(self):
        return self.drv.Event()

    def synchronize(self):
        self.ctx.synchronize()

    def module(self, signatures: dict[str, str]):
        """The kernels, compiled once a process (pycuda also caches the binary on disk)."""
        if self._module is None:
            from pycuda.compiler import SourceModule
            # -lineinfo: profilers map time to source lines; no fast-math (the prelude picks intrinsics)
            self._module = SourceModule(compose("nvcc"), no_extern_c=True, options=["-lineinfo", "-std=c++17"])
        return self._module

    def close(self):
        if getattr(self, "ctx", None) is not None:
            self.ctx.pop()
            self.ctx.detach()
            self.ctx = None


def open_device(index: int = 0):
    """The device `--engine gpu` runs on: the host emulation when FERMOE_GPU=emulate."""
    mode = os.environ.get("FERMOE_GPU", "")
    if mode == "emulate":
        from .emulator import EmulatedDevice
        return EmulatedDevice()
    if mode:
        raise FermoeError(f"FERMOE_GPU={mode!r}: expected emulate (or unset for the CUDA device)")
    return CudaDevice(index)


class HostRegistration:
    """cuMemHostRegister of an array's memory; the array is kept alive until unregister()."""

    def __init__(self, array, flags: int = 0):
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        self.array = array
        rc = self._lib.cuMemHostRegister_v2(array.ctypes.data, array.nbytes, flags)
        if rc != 0:
            raise FermoeError(f"cuMemHostRegister of {array.nbytes} bytes failed (CUresult {rc})")

    def unregister(self) -> None:
        if self.array is not None:
            self._lib.cuMemHostUnregister(self.array.ctypes.data)
            self.array = None
