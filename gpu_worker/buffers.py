"""Device arrays: a pointer with a shape and a dtype, so launchers can check what
they are given. Views share their parent's memory (row ranges, reshapes)."""
from __future__ import annotations

import numpy as np


class DeviceArray:
    def __init__(self, device, shape, dtype=np.float32, ptr: int | None = None, owner=None):
        self.device = device
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        if ptr is None:
            owner = device.mem_alloc(max(self.nbytes, 1))
            ptr = int(owner)
        self.ptr, self._owner = int(ptr), owner

    @classmethod
    def empty(cls, device, shape, dtype=np.float32) -> "DeviceArray":
        return cls(device, shape, dtype)

    @classmethod
    def of(cls, device, host: np.ndarray, stream=None) -> "DeviceArray":
        """A new device copy of a host array."""
        host = np.ascontiguousarray(host)
        out = cls(device, host.shape, host.dtype)
        out.upload(host, stream)
        return out

    def __int__(self):
        return self.ptr

    __index__ = __int__

    def upload(self, host: np.ndarray, stream=None) -> None:
        host = np.ascontiguousarray(host, dtype=self.dtype)
        assert host.nbytes == self.nbytes, f"uploading {host.shape} into {self.shape}"
        if self.nbytes:
            if stream is None:
                self.device.memcpy_htod(self.ptr, host)
            else:
                self.device.memcpy_htod_async(self.ptr, host, stream)

    def download(self) -> np.ndarray:
        """A host copy, after all queued work (a synchronising copy)."""
        out = np.empty(self.shape, self.dtype)
        if self.nbytes:
            self.device.memcpy_dtoh(out, self.ptr)
        return out

    def zero(self, stream=None) -> None:
        if self.nbytes:
            if stream is None:
                self.device.memset_d8(self.ptr, 0, self.nbytes)
            else:
                self.device.memset_d8_async(self.ptr, 0, self.nbytes, stream)

    def rows(self, start: int, stop: int) -> "DeviceArray":
        """Rows [start, stop) of the outermost dimension, as a view."""
        assert 0 <= start <= stop <= self.shape[0], (start, stop, self.shape)
        row = self.nbytes // self.shape[0] if self.shape[0] else 0
        return DeviceArray(self.device, (stop - start,) + self.shape[1:], self.dtype, self.ptr + start * row, self)

    def at(self, nbytes: int, shape, dtype=None) -> "DeviceArray":
        """The memory `nbytes` into this array, as `shape` (a column offset, say)."""
        out = DeviceArray(self.device, shape, dtype or self.dtype, self.ptr + nbytes, self)
        assert nbytes + out.nbytes <= self.nbytes or not out.nbytes, f"{nbytes} + {shape} past {self.shape}"
        return out

    def block(self, row0: int, rows: int, col: int, width: int) -> "DeviceArray":
        """Columns [col, col + width) of rows [row0, row0 + rows) of a 2-D array: a view
        starting there whose rows keep this array's stride (a kernel takes it as ld =
        shape[1] of this array)."""
        n_rows, n_cols = self.shape
        assert 0 <= row0 and row0 + rows <= n_rows and 0 <= col and col + width <= n_cols, \
            (row0, rows, col, width, self.shape)
        return DeviceArray(self.device, (rows, width), self.dtype,
                           self.ptr + (row0 * n_cols + col) * self.dtype.itemsize, self)

    def view(self, shape, dtype=None) -> "DeviceArray":
        """The same memory (or its start) as another shape."""
        out = DeviceArray(self.device, shape, dtype or self.dtype, self.ptr, self)
        assert out.nbytes <= self.nbytes, f"view {shape} larger than {self.shape}"
        return out

    def free(self) -> None:
        if self._owner is not None and hasattr(self._owner, "free") and not isinstance(self._owner, DeviceArray):
            self._owner.free()
        self._owner = None
