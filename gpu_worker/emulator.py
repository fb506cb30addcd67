"""The host emulation of the GPU (`FERMOE_GPU=emulate`): the kernels of native/cuda
built with g++ against native/cuda/emulate.h, and a device with the interface of
pycuda.driver (mem_alloc, memcpy_*, memset_*, streams, events, modules whose
functions take `prepare` / `prepared_async_call`), so the GPU engine runs and is
tested on a machine without CUDA or pycuda.

Streams are real queues. Work enqueued on an *eager* stream runs as soon as every
event it waits for has been recorded; a *lazy* stream runs only when the host
synchronises (and then only while no eager stream can progress). Running the copy
stream eagerly and compute lazily (or the reverse) is the most hostile schedule a
GPU could pick, so a missing event between them shows up as wrong results here.
"""
from __future__ import annotations

import bisect
import ctypes
import hashlib
import os
import subprocess
import time
from collections import deque
from pathlib import Path

import numpy as np

from shared.builtin import cache_dir
from shared.errors import FermoeError

from .cuda_source import compose

ORDERS = ("copy-first", "compute-first", "eager")
_CFLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-w"]
ALIGN = 256


class EmulationError(FermoeError):
    """A kernel misused the execution model, or the host misused the device."""


# ---- memory ------------------------------------------------------------------------
class EmuAllocation:
    """Device memory: host memory at a 256-byte aligned address; int() is the address."""

    def __init__(self, device: "EmulatedDevice", nbytes: int):
        self._buf = np.zeros(nbytes + ALIGN, np.uint8)
        base = self._buf.ctypes.data
        self.ptr = base + (-base % ALIGN)
        self.nbytes = nbytes
        self._device = device
        device._register(self)

    def __int__(self):
        return self.ptr

    __index__ = __int__

    def free(self):
        if self._device is not None:
            self._device._unregister(self)
            self._device = None
            self._buf = None


# ---- streams and events ------------------------------------------------------------
class EmuEvent:
    def __init__(self, device: "EmulatedDevice"):
        self.device = device
        self.enqueued = 0          # records enqueued
        self.completed = 0         # records executed
        self.when = None

    def record(self, stream: "EmuStream | None" = None):
        self.enqueued += 1
        if stream is None:
            self.device.synchronize()
            self._done()
        else:
            stream._push(self._done, "record")
        return self

    def _done(self):
        self.completed += 1
        self.when = time.perf_counter()

    def query(self) -> bool:
        return self.completed >= self.enqueued

    def synchronize(self):
        target = self.enqueued
        self.device._pump(until=lambda: self.completed >= target)

    def time_since(self, earlier: "EmuEvent") -> float:
        """Milliseconds between two executed records (as pycuda's Event.time_since)."""
        return 1000.0 * (self.when - earlier.when)


class EmuStream:
    def __init__(self, device: "EmulatedDevice", eager: bool):
        self.device, self.eager = device, eager
        self.ops: deque = deque()          # (callable or None, wait target or None, kind)

    def _push(self, fn, kind: str, wait=None):
        self.ops.append((fn, wait, kind))
        self.device._pump_eager()

    def wait_for_event(self, event: EmuEvent):
        self._push(None, "wait", (event, event.enqueued))

    def runnable(self) -> bool:
        if not self.ops:
            return False
        _, wait, _ = self.ops[0]
        return wait is None or wait[0].completed >= wait[1]

    def step(self):
        fn, _, _ = self.ops.popleft()
        if fn is not None:
            fn()

    def synchronize(self):
        self.device._pump(until=lambda: not self.ops)

    def is_done(self) -> bool:
        return not self.ops


# ---- kernels -------------------------------------------------------------------------
_CTYPE = {"P": ctypes.c_void_p, "i": ctypes.c_int32, "I": ctypes.c_uint32, "f": ctypes.c_float,
          "q": ctypes.c_int64, "Q": ctypes.c_uint64}


class EmuFunction:
    def __init__(self, module: "EmuModule", name: str):
        self.module, self.name = module, name
        self._launch = getattr(module.lib, f"fm_emu_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                 ctypes.POINTER(ctypes.c_void_p)]
        self.signature = None

    def prepare(self, signature: str):
        self.signature = signature
        return self

    def prepared_async_call(self, grid, block, stream, *args):
        if self.signature is None or len(args) != len(self.signature):
            raise EmulationError(f"{self.name}: {len(args)} arguments for signature {self.signature!r}")
        device = self.module.device
        values = []
        for kind, arg in zip(self.signature, args):
            if kind == "P":
                device.check_pointer(int(arg), self.name)
                values.append(ctypes.c_void_p(int(arg)))
            else:
                values.append(_CTYPE[kind](arg))
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        g = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1))[:3])
        b = (ctypes.c_uint * 3)(*(tuple(block) + (1, 1))[:3])

        def run():
            keep = values               # the argument values live until the launch ran
            if self._launch(g, b, argv) != 0:
                raise EmulationError(self.module.lib.fm_emu_error().decode() or f"{self.name}: launch failed")
            del keep

        if stream is None:
            device.synchronize()
            run()
        else:
            stream._push(run, self.name)


class EmuModule:
    def __init__(self, device: "EmulatedDevice", lib: ctypes.CDLL, names: list[str]):
        self.device, self.lib, self.names = device, lib, names
        lib.fm_emu_error.restype = ctypes.c_char_p
        lib.fm_emu_set_threads(ctypes.c_uint(device.threads))

    def get_function(self, name: str) -> EmuFunction:
        if name not in self.names:
            raise EmulationError(f"no kernel {name!r} in the module")
        return EmuFunction(self, name)


def build_library(signatures: dict[str, str], files=None) -> tuple[Path, list[str]]:
    """The emulation shared library of the kernel sources (cached on disk by the
    hash of what is compiled, so each machine builds it once)."""
    source = compose("emulate", files)
    names = list(signatures)        # an entry the sources lack fails to compile, by name
    source += "".join(f'FM_EMU_KERNEL({n}, "{signatures[n]}")\n' for n in names)
    cxx = os.environ.get("CXX", "g++")
    key = hashlib.sha256("\0".join([source, cxx, *_CFLAGS]).encode()).hexdigest()[:24]
    out_dir = cache_dir() / "cuda-emulate"
    lib = out_dir / f"kernels-{key}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        src = out_dir / f"kernels-{key}.{os.getpid()}.cpp"
        src.write_text(source)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        try:
            run = subprocess.run([cxx, *_CFLAGS, "-I", str(Path(__file__).parent), str(src), "-o", str(tmp)],
                                 capture_output=True, text=True)
        except FileNotFoundError:
            raise EmulationError(f"FERMOE_GPU=emulate needs a C++ compiler ({cxx!r} not found)") from None
        finally:
            src.unlink(missing_ok=True)
        if run.returncode != 0:
            raise EmulationError(f"the host emulation of the kernels did not compile:\n{run.stderr[-4000:]}")
        os.replace(tmp, lib)
    return lib, names


# ---- the device ---------------------------------------------------------------------------
class EmulatedDevice:
    """pycuda.driver's interface over host memory and the emulated kernels."""

    name = "host emulation"

    def __init__(self, total_memory: int = 8 << 30, order: str | None = None, threads: int | None = None):
        order = order or os.environ.get("FERMOE_GPU_EMULATE_ORDER", "copy-first")
        if order not in ORDERS:
            raise EmulationError(f"FERMOE_GPU_EMULATE_ORDER={order!r}: expected one of {', '.join(ORDERS)}")
        self.order = order
        self.total_memory = total_memory
        self.threads = threads or int(os.environ.get("FERMOE_GPU_EMULATE_THREADS", 0)) or os.cpu_count() or 1
        self.multiprocessors = self.threads         # the host threads that run blocks
        self._starts: list[int] = []
        self._allocs: dict[int, EmuAllocation] = {}
        self.allocated = 0
        self.streams: list[EmuStream] = []

    # memory
    def mem_alloc(self, nbytes: int) -> EmuAllocation:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise EmulationError(f"mem_alloc({nbytes}): size must be positive")
        if self.allocated + nbytes > self.total_memory:
            raise EmulationError(f"out of device memory: {nbytes} bytes asked, "
                                 f"{self.total_memory - self.allocated} of {self.total_memory} free")
        return EmuAllocation(self, nbytes)

    def _register(self, a: EmuAllocation):
        bisect.insort(self._starts, a.ptr)
        self._allocs[a.ptr] = a
        self.allocated += a.nbytes

    def _unregister(self, a: EmuAllocation):
        self._starts.remove(a.ptr)
        del self._allocs[a.ptr]
        self.allocated -= a.nbytes

    def check_pointer(self, ptr: int, what: str, nbytes: int = 0):
        """ptr (and nbytes after it) must lie in a live allocation; 0 is a null argument."""
        if ptr == 0 and nbytes == 0:
            return
        i = bisect.bisect_right(self._starts, ptr) - 1
        a = self._allocs[self._starts[i]] if i >= 0 else None
        if a is None or ptr + nbytes > a.ptr + a.nbytes:
            raise EmulationError(f"{what}: address {ptr:#x} (+{nbytes} bytes) is not in device memory")

    def mem_get_info(self) -> tuple[int, int]:
        return self.total_memory - self.allocated, self.total_memory

    def pagelocked_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def register_host_memory(self, array, flags=0):
        """As CudaDevice's: host memory needs no locking here."""
        return _Registration(array)

    # copies
    def _copy_op(self, dst: int, src: int, nbytes: int, what: str, check_dst: bool, check_src: bool, host=None):
        """A copy to run later; `host` (the host array) is kept alive until then and read
        or written only then, as with page-locked memory on a GPU."""
        if check_dst:
            self.check_pointer(dst, what, nbytes)
        if check_src:
            self.check_pointer(src, what, nbytes)

        def op(keep=host):
            ctypes.memmove(dst, src, nbytes)
        return op

    def _enqueue(self, op, stream, kind: str):
        if stream is None:
            self.synchronize()
            op()
        else:
            stream._push(op, kind)

    def memcpy_htod(self, dst, src: np.ndarray):
        self.memcpy_htod_async(dst, src, None)

    def memcpy_htod_async(self, dst, src: np.ndarray, stream=None):
        src = _contiguous(src, "memcpy_htod")
        self._enqueue(self._copy_op(int(dst), src.ctypes.data, src.nbytes, "memcpy_htod", True, False, src), stream,
                      "htod")

    def memcpy_dtoh(self, dst: np.ndarray, src):
        self.memcpy_dtoh_async(dst, src, None)

    def memcpy_dtoh_async(self, dst: np.ndarray, src, stream=None):
        dst = _contiguous(dst, "memcpy_dtoh")
        self._enqueue(self._copy_op(dst.ctypes.data, int(src), dst.nbytes, "memcpy_dtoh", False, True, dst), stream,
                      "dtoh")

    def memcpy_dtod(self, dst, src, nbytes: int):
        self.memcpy_dtod_async(dst, src, nbytes, None)

    def memcpy_dtod_async(self, dst, src, nbytes: int, stream=None):
        self._enqueue(self._copy_op(int(dst), int(src), int(nbytes), "memcpy_dtod", True, True), stream, "dtod")

    def memset_d8(self, dst, value: int, n: int):
        self.memset_d8_async(dst, value, n, None)

    def memset_d8_async(self, dst, value: int, n: int, stream=None):
        self.check_pointer(int(dst), "memset_d8", int(n))
        self._enqueue(lambda: ctypes.memset(int(dst), value, int(n)), stream, "memset")

    # streams
    def stream(self, role: str) -> EmuStream:
        """A new stream; `role` is "copy" or "compute" and decides its eagerness."""
        eager = {"copy-first": role == "copy", "compute-first": role != "copy", "eager": True}[self.order]
        s = EmuStream(self, eager)
        self.streams.append(s)
        return s

    def event(self) -> EmuEvent:
        return EmuEvent(self)

    def _pump_eager(self):
        progressed = True
        while progressed:
            progressed = False
            for s in self.streams:
                while s.eager and s.runnable():
                    s.step()
                    progressed = True

    def _pump(self, until=lambda: False):
        """Run queued work, eager streams first, until `until()` holds or all is done."""
        while not until():
            self._pump_eager()
            if until():
                return
            lazy = next((s for s in self.streams if not s.eager and s.runnable()), None)
            if lazy is not None:
                lazy.step()
                continue
            if any(s.ops for s in self.streams):
                raise EmulationError("deadlock: streams wait for events that are never recorded")
            return

    def synchronize(self):
        self._pump()

    # kernels
    def module(self, signatures: dict[str, str], files=None) -> EmuModule:
        path, names = build_library(signatures, files)
        return EmuModule(self, ctypes.CDLL(str(path)), names)


def _contiguous(a: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        raise EmulationError(f"{what}: host memory must be a C-contiguous numpy array")
    return a


class _Registration:
    def __init__(self, array):
        self.array = array

    def unregister(self) -> None:
        self.array = None
