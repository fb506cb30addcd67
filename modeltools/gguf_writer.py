"""Write llama.cpp GGUF files, streaming: metadata and the tensor table first, then
tensor data in declared order, so a 10+ GB file is written with little memory.
The layout (and the reader) is in shared/gguf_file.py."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from itertools import chain

import numpy as np

from shared.ggml_types import GGMLType, tensor_nbytes
from shared.gguf_file import (ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS, MAX_NAME_BYTES, WRITE_VERSION,
                              GGUFValueType, _FMT, _HEADER, _U32, _U64, _encode_str,
                              _encode_tensor_entry, _pad)


# ----------------------------------------------------------------------------- encoding

def _plain(value):
    """numpy scalars and arrays become Python ones, so numpy values are typed like Python's."""
    if isinstance(value, np.ndarray):
        if value.ndim > 1:
            raise ValueError(f"metadata arrays must be 1-D, got shape {value.shape}")
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, list):
        return [v.item() if isinstance(v, np.generic) else v for v in value]
    return value


def _kinds(values) -> set[str]:
    """The value kinds in values, judged per distinct type (fast for 248k-entry lists)."""
    kinds = set()
    for t in set(map(type, values)):
        kind = next((k for k, base in _KINDS if issubclass(t, base)), None)
        if kind is None:
            raise ValueError(f"cannot store a {t.__name__} in GGUF metadata")
        kinds.add(kind)
    return kinds


_KINDS = (("bool", bool), ("int", int), ("float", float), ("str", (str, bytes)))


def _infer_int(values, scalar: bool) -> GGUFValueType:
    """llama.cpp's choices (uint32 scalars, int32 lists and negatives), widened to 64 bits if needed."""
    lo, hi = min(values), max(values)
    if scalar and lo >= 0:
        return GGUFValueType.UINT32 if hi < 1 << 32 else GGUFValueType.UINT64
    if lo >= -(1 << 31) and hi < 1 << 31:
        return GGUFValueType.INT32
    if lo >= -(1 << 63) and hi < 1 << 63:
        return GGUFValueType.INT64
    return GGUFValueType.UINT64


def _infer_type(values: list, scalar: bool) -> GGUFValueType:
    kinds = _kinds(values)
    if kinds == {"bool"}:
        return GGUFValueType.BOOL
    if kinds == {"str"}:
        return GGUFValueType.STRING
    if kinds == {"int"}:
        return _infer_int(values, scalar)
    if kinds <= {"int", "float"}:
        return GGUFValueType.FLOAT32
    raise ValueError(f"cannot infer one GGUF type for values of kinds {sorted(kinds)}; pass vtype")


def _encode_items(values: list, vtype: GGUFValueType) -> bytes:
    """Concatenated encodings of values of one type (no type tag)."""
    if vtype == GGUFValueType.STRING:
        if _kinds(values) - {"str"}:
            raise ValueError("STRING values must be str or bytes")
        raw = [v.encode("utf-8", "surrogateescape") if isinstance(v, str) else v for v in values]
        # interleave u64 lengths and bytes without a Python-level loop body
        return b"".join(chain.from_iterable(zip(map(_U64.pack, map(len, raw)), raw)))
    if vtype not in _FMT:
        raise ValueError(f"cannot encode values as {vtype!r}")
    try:  # struct range-checks every item, and refuses floats for integer types
        return struct.pack(f"<{len(values)}{_FMT[vtype]}", *values)
    except (struct.error, OverflowError, TypeError) as e:
        raise ValueError(f"values do not fit {vtype.name}: {e}") from None


def _encode_value(value, vtype: GGUFValueType | None) -> bytes:
    """u32 type tag + value, as a metadata entry stores it after its key."""
    value = _plain(value)
    if isinstance(value, list):
        if vtype in (None, GGUFValueType.ARRAY):
            if not value:
                raise ValueError("cannot infer the element type of an empty list; pass vtype")
            vtype = _infer_type(value, scalar=False)
        return (struct.pack("<IIQ", GGUFValueType.ARRAY, vtype, len(value))
                + _encode_items(value, vtype))
    vtype = _infer_type([value], scalar=True) if vtype is None else vtype
    if vtype == GGUFValueType.ARRAY:
        raise ValueError(f"vtype ARRAY needs a list, got {type(value).__name__}")
    return _U32.pack(vtype) + _encode_items([value], vtype)


# ----------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class _Declared:
    name: str
    shape: tuple[int, ...]
    qtype: GGMLType
    nbytes: int
    rel_offset: int  # from the start of the data section


def _as_bytes(data) -> memoryview:
    """A flat byte view of data, without copying when it is already contiguous little-endian."""
    if isinstance(data, np.ndarray):
        if data.dtype.byteorder == ">":
            data = data.astype(data.dtype.newbyteorder("<"))
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    view = memoryview(data)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


class GGUFWriter:
    """Streams a GGUF file: metadata and tensor table first, then tensor data in declared order.

    add() and add_tensor() only record (metadata is encoded at once, so a bad value fails at
    its call). The header goes out at the first write_tensor (or close), then each tensor's
    bytes are written and padded as they come: memory stays small for any file size.
    """

    def __init__(self, path, alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.path, self.alignment = os.fspath(path), alignment
        self._kv: dict[str, bytes] = {}
        self._declared: list[_Declared] = []
        self._names: set[str] = set()
        self._data_size = 0  # padded bytes declared so far
        self._next = 0  # index of the next tensor to write
        self._header_done = False
        self._file = open(self.path, "wb")
        if alignment != DEFAULT_ALIGNMENT:  # readers only look for it when it differs
            self._kv[ALIGNMENT_KEY] = _encode_value(alignment, GGUFValueType.UINT32)

    def _check_open_header(self, what: str, name) -> None:
        if not isinstance(name, str):
            raise ValueError(f"{what} names must be str, got {type(name).__name__}")
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._header_done:
            raise ValueError(f"{self.path}: {what} {name!r} must come before the first write_tensor")

    def add(self, key: str, value, vtype: GGUFValueType | None = None) -> None:
        """Adds a metadata entry. For lists, vtype (if given) is the element type."""
        self._check_open_header("metadata", key)
        if key == ALIGNMENT_KEY:
            if value != self.alignment or vtype not in (None, GGUFValueType.UINT32):
                raise ValueError(f"set {ALIGNMENT_KEY} through GGUFWriter(alignment=...)")
            self._kv[key] = _encode_value(value, GGUFValueType.UINT32)
            return
        if key in self._kv:
            raise ValueError(f"duplicate metadata key {key!r}")
        try:
            self._kv[key] = _encode_value(value, None if vtype is None else GGUFValueType(vtype))
        except ValueError as e:
            raise ValueError(f"metadata key {key!r}: {e}") from None

    def add_tensor(self, name: str, shape: tuple, qtype: GGMLType) -> None:
        """Declares a tensor (numpy-order shape); its bytes come later through write_tensor."""
        self._check_open_header("tensor", name)
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise ValueError(f"tensor name {name!r} is longer than ggml's {MAX_NAME_BYTES} bytes")
        shape = tuple(int(d) for d in shape)
        if not 1 <= len(shape) <= MAX_DIMS or min(shape) < 1:
            raise ValueError(f"tensor {name!r}: shape {shape} needs 1 to {MAX_DIMS} positive dims")
        qtype = GGMLType(qtype)
        nbytes = tensor_nbytes(qtype, shape)
        self._declared.append(_Declared(name, shape, qtype, nbytes, self._data_size))
        self._names.add(name)
        self._data_size += _pad(nbytes, self.alignment)

    def _write_header(self) -> None:
        parts = [_HEADER.pack(MAGIC, WRITE_VERSION, len(self._declared), len(self._kv))]
        for key, encoded in self._kv.items():
            parts += [_encode_str(key), encoded]
        for t in self._declared:
            parts += [_encode_tensor_entry(t.name, t.shape, t.qtype), _U64.pack(t.rel_offset)]
        header = b"".join(parts)
        self._file.write(header + bytes(_pad(len(header), self.alignment) - len(header)))
        self._header_done, self._kv = True, {}  # the encoded metadata is not needed any more

    def write_tensor(self, name: str, data) -> None:
        """Writes the next declared tensor's bytes (exactly its nbytes), then the padding."""
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._next >= len(self._declared):
            raise ValueError(f"tensor {name!r}: every declared tensor is already written")
        t = self._declared[self._next]
        if name != t.name:
            raise ValueError(f"tensor {name!r} written out of order: expected {t.name!r} next")
        view = _as_bytes(data)
        if view.nbytes != t.nbytes:
            raise ValueError(f"tensor {name!r}: got {view.nbytes} bytes, expected {t.nbytes} "
                             f"for {t.qtype.name} {t.shape}")
        if not self._header_done:
            self._write_header()
        self._file.write(view)
        self._file.write(bytes(_pad(t.nbytes, self.alignment) - t.nbytes))
        self._next += 1

    def close(self) -> None:
        """Finishes the file; a declared tensor that was never written is a ValueError."""
        if self._file is None:
            return
        try:
            if not self._header_done:
                self._write_header()
            missing = [t.name for t in self._declared[self._next:]]
            if missing:
                raise ValueError(f"{self.path}: {len(missing)} declared tensors were never "
                                 f"written, first {missing[0]!r}")
        finally:
            self._file.close()
            self._file = None

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif self._file is not None:  # don't mask the original error with close()'s checks
            self._file.close()
            self._file = None
