"""Reads Hugging Face safetensors checkpoints (single file or sharded with an index),
memory-mapped, one tensor at a time, without torch (bf16 is widened here)."""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from shared.errors import ModelError

_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class _Shard:
    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._map) < 8:
            raise ModelError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack_from("<Q", self._map, 0)
        if n > len(self._map) - 8:
            raise ModelError(f"{path}: safetensors header length {n} runs past the end of the file")
        try:
            header = json.loads(bytes(self._map[8:8 + n]))
        except ValueError as e:
            raise ModelError(f"{path}: safetensors header is not JSON ({e})") from None
        header.pop("__metadata__", None)
        self.entries = header
        self.data_start = 8 + n

    def load(self, name: str) -> np.ndarray:
        e = self.entries[name]
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise ModelError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}")
        begin, end = e["data_offsets"]
        if self.data_start + end > len(self._map):
            raise ModelError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
        a = np.frombuffer(self._map, dtype, (end - begin) // np.dtype(dtype).itemsize, self.data_start + begin)
        a = a.reshape(e["shape"])
        if e["dtype"] == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


class Checkpoint:
    """All tensors of a checkpoint directory by name: `names`, `shape(name)`, `load(name)`."""

    def __init__(self, directory):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{directory}: no .safetensors files found")
        self._shards = [_Shard(directory / f) for f in files]
        self._where = {}
        for shard in self._shards:
            for name in shard.entries:
                self._where[name] = shard

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple:
        return tuple(self._where[name].entries[name]["shape"])

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 (a fresh array; the mapping stays untouched)."""
        if name not in self._where:
            raise ModelError(f"checkpoint has no tensor {name}")
        return self._where[name].load(name)
