"""The kernels of native/cuda as Python calls: each entry point's signature (as
pycuda's `prepare` spells it: P pointer, i int, I unsigned, f float, q int64), read
from its declaration in the .cu file (gpu_worker/cuda_source.py), and a launcher that
checks what it is given, launches on a stream, and with FERMOE_GPU_DEBUG=1
synchronises after every launch so a fault names its kernel."""
from __future__ import annotations

import os

from shared.errors import FermoeError
from shared.ggml_types import GGMLType

from .cuda_source import kernel_signatures

# The weight types the kernels read (the one table): their names end the GEMM entry
# points' names; embed_rows takes the ggml type number.
KERNEL_TYPES = {GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.Q4_0: "q4_0", GGMLType.Q8_0: "q8_0"}

# gemm.cu's tile rows (BM) of the dense GEMMs (all 128 columns wide), and of the
# grouped-expert GEMMs with their columns (BN), gate|up and down: the heights
# FM_GEMM_ENTRIES instantiates (check_tiles holds these to the entry points the sources
# declare)
DENSE_BM, DENSE_BN = (32, 64, 128), 128
MOE_GATEUP_TILES = {64: 128, 128: 128}
MOE_DOWN_TILES = {64: 256, 128: 128}
MOE_BM = tuple(MOE_DOWN_TILES)


def signatures() -> dict[str, str]:
    """Every entry point of native/cuda and its launch signature, from its declaration."""
    return kernel_signatures()


def check_tiles(entries) -> None:
    """The GEMM heights the launchers pick are the ones the sources instantiate, no more."""
    heights = {}
    for name in entries:
        kind, _, rest = name.partition("_m")
        if kind in ("gemm", "moe_gateup", "moe_down") and rest[:1].isdigit():
            heights.setdefault(kind, set()).add(int(rest.split("_")[0]))
    want = {"gemm": set(DENSE_BM), "moe_gateup": set(MOE_BM), "moe_down": set(MOE_BM)}
    if heights != want:
        raise FermoeError(f"gemm.cu instantiates tile heights {heights}; gpu_worker/kernels.py expects {want}")


class LaunchError(FermoeError):
    """A kernel launch was given the wrong shapes, or failed on the device."""


class Kernel:
    """One entry point: `k(grid, block, stream, *args)`."""

    def __init__(self, function, name: str, signature: str, device, debug: bool, owner: "Kernels"):
        self.fn = function.prepare(signature)
        self.name, self.signature, self.device, self.debug, self.owner = name, signature, device, debug, owner

    def __call__(self, grid, block, stream, *args):
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        if len(args) != len(self.signature):
            raise LaunchError(f"{self.name}: {len(args)} arguments, its signature {self.signature!r} has "
                              f"{len(self.signature)}")
        if min(grid) < 1 or min(block) < 1 or block[0] * block[1] * block[2] > 1024:
            raise LaunchError(f"{self.name}: grid {grid} and block {block} (1 to 1024 threads a block)")
        values = [int(a) if k == "P" else a for k, a in zip(self.signature, args)]
        if self.owner is not None and self.owner.timer is not None:
            self.owner.timer.mark(self.name)
        try:
            self.fn.prepared_async_call(grid, block, stream, *values)
            if self.debug:
                self.device.synchronize()
        except FermoeError:
            raise
        except Exception as e:      # pycuda's LaunchError, LogicError...: name the kernel
            raise LaunchError(f"{self.name} grid {grid} block {block}: {e}") from e


class Kernels:
    """Every entry point of the module, as attributes: `kernels.rmsnorm(...)`."""

    def __init__(self, device):
        entries = signatures()
        check_tiles(entries)
        module = device.module(entries)
        debug = bool(os.environ.get("FERMOE_GPU_DEBUG"))
        self.timer = None           # a PhaseTimer: every launch marks its kernel's name (bench prefill --kernels)
        for name, signature in entries.items():
            setattr(self, name, Kernel(module.get_function(name), name, signature, device, debug, self))

    def gemm(self, wtype: str, kind: str = "gemm", bm: int | None = None):
        """The GEMM entry of `kind` (gemm, gemm_narrow, moe_gateup, moe_down) for a weight
        type, with tiles of `bm` rows (all but gemm_narrow)."""
        return getattr(self, f"{kind}_{wtype}" if bm is None else f"{kind}_m{bm}_{wtype}")
