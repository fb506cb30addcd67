"""Which GPUs this machine can prefill on, found without opening any of them."""
from __future__ import annotations

import os


def gpu_devices() -> tuple[list[int], str]:
    """(the usable CUDA device indices, why there are none if so). FERMOE_GPU=emulate
    counts as one device: the host emulation of the kernels."""
    mode = os.environ.get("FERMOE_GPU", "")
    if mode == "emulate":
        return [0], ""
    if mode:
        return [], f"FERMOE_GPU={mode!r} is not emulate"
    try:
        import pycuda.driver as drv
    except ImportError:
        return [], "pycuda is not installed (pip install -e '.[gpu]')"
    try:
        drv.init()
        count = drv.Device.count()
    except drv.Error as e:
        return [], f"no CUDA driver or device ({e})"
    return list(range(count)), "" if count else "no CUDA device"
