"""Read llama.cpp GGUF files (v3 little-endian; v2, same layout, is read too).

    offset 0    +----------------------------------------------------------+
                | "GGUF" | u32 version | u64 n_tensors | u64 n_kv          |
                +----------------------------------------------------------+
                | n_kv x   key:str | u32 vtype | value                      |
                |          value: scalar | str | u32 elem_type, u64 n, n x |
                +----------------------------------------------------------+
                | n_tensors x  name:str | u32 n_dims | u64 ne[n_dims]       |
                |              u32 ggml_type | u64 offset (from data_offset)|
                +---------------------------------------- zero pad --------+
    data_offset | tensor 0 bytes | pad | tensor 1 bytes | pad | ...         |
                +----------------------------------------------------------+

str = u64 byte length + UTF-8 bytes. ne[0] is the innermost dimension, so the
numpy-order shape is ne reversed. Padding is to `general.alignment` (u32), else 32.
Writing is modeltools/gguf_writer.py.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from shared.errors import GGUFError
from shared.ggml_types import GGMLType, tensor_nbytes

MAGIC = b"GGUF"
WRITE_VERSION = 3
READ_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4
MAX_NAME_BYTES = 63  # ggml's GGML_MAX_NAME is 64 including the terminating NUL
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; Python 3.11 lacks the name


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct codes of the fixed-size value types (numpy dtypes are the same codes, '<'-prefixed).
_FMT = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")

# ggml types we know by name but cannot run, so the error can say which one it is.
_OTHER_GGML_TYPES = {
    4: "Q4_2 (removed)", 5: "Q4_3 (removed)", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
    40: "NVFP4", 41: "Q1_0",
}

_REQUIRED = object()  # get()'s default: None is a legitimate default


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first
    qtype: GGMLType
    offset: int  # absolute byte offset in the file
    nbytes: int


# ----------------------------------------------------------------------------- encoding (the fingerprint hashes it)

def _encode_str(s) -> bytes:
    b = s if isinstance(s, (bytes, bytearray)) else s.encode("utf-8", "surrogateescape")
    return _U64.pack(len(b)) + bytes(b)


def _encode_tensor_entry(name: str, shape: tuple[int, ...], qtype: GGMLType) -> bytes:
    """name, n_dims, ne (innermost first), type: the table entry without its offset."""
    ne = tuple(reversed(shape))
    return _encode_str(name) + struct.pack(f"<I{len(ne)}QI", len(ne), *ne, int(qtype))


# ----------------------------------------------------------------------------- reading

class _Cursor:
    """Bounds-checked little-endian reads over the mapped file: every overrun is a GGUFError."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.size, self.pos = buf, path, len(buf), 0

    def fail(self, problem: str):
        raise GGUFError(self.path, problem)

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n > self.size - start:
            self.fail(f"file is truncated or corrupt: {what} at offset {start} needs {n} bytes, "
                      f"but the file has only {self.size} bytes")
        self.pos = start + n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            self.fail(f"{what} at offset {self.pos - 8} claims {n} bytes, running past the end "
                      f"of the file ({self.size} bytes)")
        start = self.take(n, what)
        # surrogateescape: a token that is not valid UTF-8 survives a read/write round trip
        return str(self.buf[start:start + n], "utf-8", "surrogateescape")

    def value(self, vtype: int, what: str):
        """Returns (value, type): for an array the type is its element type, as GGUFWriter.add takes it."""
        if vtype == GGUFValueType.STRING:
            return self.string(what), GGUFValueType.STRING
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        fmt = _FMT.get(vtype)
        if fmt is None:
            self.fail(f"{what} has unknown value type {vtype}")
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.buf, start)[0], GGUFValueType(vtype)

    def array(self, what: str) -> tuple[list, GGUFValueType]:
        etype = self.u32(f"element type of {what}")
        n = self.u64(f"length of {what}")
        if etype == GGUFValueType.ARRAY:
            self.fail(f"{what} is an array of arrays, which GGUF readers do not support")
        if etype != GGUFValueType.STRING and etype not in _FMT:
            self.fail(f"{what} has unknown element type {etype}")
        width = 8 if etype == GGUFValueType.STRING else struct.calcsize(_FMT[etype])
        if n * width > self.size - self.pos:  # checked before allocating anything of size n
            self.fail(f"{what} claims {n} elements at offset {self.pos - 8}, running past the end "
                      f"of the file ({self.size} bytes)")
        etype = GGUFValueType(etype)
        if etype == GGUFValueType.STRING:
            return self.string_array(n, what), etype
        dtype = "<u1" if etype == GGUFValueType.BOOL else "<" + _FMT[etype]
        arr = np.frombuffer(self.buf, dtype, n, self.take(n * width, what))
        return ((arr != 0) if etype == GGUFValueType.BOOL else arr).tolist(), etype

    def string_array(self, n: int, what: str) -> list[str]:
        # Inlined loop: a 248k-entry token list must parse in well under a second.
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out = [""] * n
        for i in range(n):
            start = pos + 8
            end = start + unpack(buf, pos)[0] if start <= size else start
            if end > size:
                self.fail(f"string {i} of {what} at offset {pos} runs past the end of the file "
                          f"({size} bytes)")
            out[i] = str(buf[start:end], "utf-8", "surrogateescape")
            pos = end
        self.pos = pos
        return out


def _ggml_type(type_id: int, name: str, path: str) -> GGMLType:
    try:
        return GGMLType(type_id)
    except ValueError:
        known = _OTHER_GGML_TYPES.get(type_id)
        what = f"ggml type {type_id} ({known}), which fermoe does not support" if known \
            else f"unknown ggml type id {type_id}"
        raise GGUFError(path, f"tensor {name!r} has {what}") from None


def _check_dims(ne: list[int], name: str, path: str) -> tuple[int, ...]:
    for d in ne:
        if d == 0 or d >= 1 << 63:  # ggml reads ne as int64: the top bit means negative
            raise GGUFError(path, f"tensor {name!r} has an invalid dimension {d} in shape "
                                  f"{tuple(reversed(ne))} (zero or negative)")
    return tuple(reversed(ne))


class GGUFFile:
    """Memory-mapped read-only view of a GGUF file. Weights are never copied."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._mm = self._map()
        try:
            self._parse(_Cursor(self._mm, self.path))
        except BaseException:
            self.close()
            raise

    def _map(self) -> mmap.mmap:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    raise GGUFError(self.path, "file is empty, not a GGUF file")
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(self.path, f"cannot open: {e.strerror or e}") from e

    def _parse(self, cur: _Cursor) -> None:
        self._parse_preamble(cur)
        kv_start = cur.pos
        self.metadata, self.metadata_types = {}, {}
        for i in range(self._n_kv):
            self._parse_kv(cur, i)
        kv_end = cur.pos
        table = [self._parse_tensor_info(cur, i) for i in range(self._n_tensors)]
        self.alignment = self._read_alignment()
        self.data_offset = _pad(cur.pos, self.alignment)
        self.tensors = self._place_tensors(table, cur.size)
        self._fingerprint = self._hash(self._mm[kv_start:kv_end])

    def _parse_preamble(self, cur: _Cursor) -> None:
        if cur.size < 4 or self._mm[:4] != MAGIC:
            cur.fail(f"not a GGUF file: starts with {bytes(self._mm[:4])!r}, expected {MAGIC!r}")
        cur.take(4, "magic")
        version = cur.u32("version")
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version & 0xFFFF == 0 and swapped in READ_VERSIONS:
            cur.fail("big-endian GGUF files are not supported")
        if version not in READ_VERSIONS:
            cur.fail(f"unsupported GGUF version {version} (supported: {READ_VERSIONS})")
        self.version = version
        self._n_tensors = cur.u64("tensor count")
        self._n_kv = cur.u64("metadata count")
        # Smallest possible entries: key str + type + 1 byte; name str + n_dims + 1 dim + type + offset.
        if self._n_kv * 13 + self._n_tensors * 32 > cur.size - cur.pos:
            cur.fail(f"implausible header: {self._n_tensors} tensors and {self._n_kv} metadata "
                     f"entries cannot fit in a file of {cur.size} bytes (corrupt counts)")

    def _parse_kv(self, cur: _Cursor, i: int) -> None:
        key = cur.string(f"key of metadata entry {i}")
        if key in self.metadata:
            cur.fail(f"duplicate metadata key {key!r}")
        vtype = cur.u32(f"value type of metadata key {key!r}")
        self.metadata[key], self.metadata_types[key] = cur.value(vtype, f"metadata key {key!r}")

    def _parse_tensor_info(self, cur: _Cursor, i: int) -> tuple:
        name = cur.string(f"name of tensor {i}")
        if len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            cur.fail(f"tensor name {name[:80]!r}... is longer than ggml's {MAX_NAME_BYTES} bytes")
        n_dims = cur.u32(f"dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            cur.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        ne = [cur.u64(f"shape of tensor {name!r}") for _ in range(n_dims)]
        type_id = cur.u32(f"type of tensor {name!r}")
        rel = cur.u64(f"offset of tensor {name!r}")
        shape = _check_dims(ne, name, self.path)
        qtype = _ggml_type(type_id, name, self.path)
        try:
            nbytes = tensor_nbytes(qtype, shape)
        except ValueError as e:
            cur.fail(f"tensor {name!r} of shape {shape}: {e}")
        return name, shape, qtype, rel, nbytes

    def _read_alignment(self) -> int:
        if ALIGNMENT_KEY not in self.metadata:
            return DEFAULT_ALIGNMENT
        value, vtype = self.metadata[ALIGNMENT_KEY], self.metadata_types[ALIGNMENT_KEY]
        if vtype != GGUFValueType.UINT32 or not isinstance(value, int):
            raise GGUFError(self.path, f"{ALIGNMENT_KEY} must be a uint32, found {vtype.name}")
        if value == 0 or value & (value - 1):
            raise GGUFError(self.path, f"{ALIGNMENT_KEY} = {value} is not a power of two")
        return value

    def _place_tensors(self, table: list[tuple], size: int) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, rel, nbytes in table:
            if name in tensors:
                raise GGUFError(self.path, f"duplicate tensor name {name!r}")
            if rel % self.alignment:
                raise GGUFError(self.path, f"tensor {name!r} is misaligned: its data offset {rel} "
                                           f"is not a multiple of the alignment {self.alignment}")
            tensors[name] = TensorInfo(name, shape, qtype, self.data_offset + rel, nbytes)
        self._check_overlaps(tensors.values())
        self._check_truncation(tensors.values(), size)
        return tensors

    def _check_overlaps(self, infos) -> None:
        ordered = sorted(infos, key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset + a.nbytes > b.offset:
                raise GGUFError(self.path, f"tensors {a.name!r} (bytes {a.offset}..{a.offset + a.nbytes})"
                                           f" and {b.name!r} (from byte {b.offset}) overlap")

    def _check_truncation(self, infos, size: int) -> None:
        past = [t for t in infos if t.offset + t.nbytes > size]
        if past:
            expected = max(t.offset + t.nbytes for t in past)
            raise GGUFError(self.path, f"file is truncated: tensor {past[0].name!r} ends at byte "
                                       f"{past[0].offset + past[0].nbytes}; expected at least "
                                       f"{expected} bytes, but the file has {size}")

    def _hash(self, kv_bytes: bytes) -> str:
        # Raw metadata bytes keep key types in the hash; offsets are left out (alignment-dependent).
        h = hashlib.blake2b(digest_size=8)
        h.update(_U64.pack(len(self.metadata)) + _U64.pack(len(self.tensors)) + kv_bytes)
        for t in self.tensors.values():
            h.update(_encode_tensor_entry(t.name, t.shape, t.qtype))
        return h.hexdigest()

    @property
    def fingerprint(self) -> str:
        """16 hex chars identifying the metadata and tensor table (names, shapes, types), not the data."""
        return self._fingerprint

    def raw(self, name: str) -> np.ndarray:
        """uint8 1-D zero-copy view of a tensor's bytes (read-only; keeps the mapping alive)."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, f"tensor {name!r} not found")
        if self._mm is None:
            raise GGUFError(self.path, f"file is closed; cannot read tensor {name!r}")
        return np.frombuffer(self._mm, np.uint8, info.nbytes, info.offset)

    def data(self, limit: int | None = None) -> np.ndarray:
        """uint8 zero-copy view of the tensor data (its first `limit` bytes), as mapped."""
        if self._mm is None:
            raise GGUFError(self.path, "file is closed")
        n = len(self._mm) - self.data_offset
        return np.frombuffer(self._mm, np.uint8, n if limit is None else min(n, limit), self.data_offset)

    def get(self, key: str, default=_REQUIRED):
        """Metadata value; a missing key without a default is a GGUFError naming the key."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _REQUIRED:
            raise GGUFError(self.path, f"missing metadata key {key!r}")
        return default

    def populate(self, skip: tuple[str, ...] = ()) -> bool:
        """Map every page of the file now (reading it from disk if it is not cached),
        as llama.cpp does when it maps a model: otherwise each 4 KB page costs a page
        fault the first time a token touches it, and a decode step touches experts
        for the first time for many tokens. The tensors named in `skip` are left
        alone (a worker reading them from elsewhere). False where the kernel cannot
        (MADV_POPULATE_READ is Linux 5.14+): pages are then only read ahead."""
        ranges = self._ranges_without(skip)
        try:
            for start, length in ranges:
                self._mm.madvise(MADV_POPULATE_READ, start, length)
            return True
        except (OSError, ValueError):
            try:
                for start, length in ranges:
                    self._mm.madvise(mmap.MADV_WILLNEED, start, length)
            except (OSError, ValueError, AttributeError):
                pass
            return False

    def forget(self, names: tuple[str, ...]) -> None:
        """Drop the pages of these tensors from this mapping and from the page cache
        (their bytes were copied elsewhere; the file is unchanged, a later read maps
        them again). The pages they share with other tensors are kept."""
        page = mmap.PAGESIZE
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for name in names:
                t = self.tensors[name]
                start, end = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
                if end > start:
                    self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)
                    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def _ranges_without(self, names: tuple[str, ...]) -> list[tuple[int, int]]:
        """(start, length) page-aligned ranges of the mapping outside the named tensors."""
        page, size = mmap.PAGESIZE, len(self._mm)
        ranges, at = [], 0
        for t in sorted((self.tensors[n] for n in names), key=lambda t: t.offset):
            end = -(-t.offset // page) * page              # a page it shares with the tensor before is read
            if end > at:
                ranges.append((at, end - at))
            at = max(at, (t.offset + t.nbytes) // page * page)
        if at < size:
            ranges.append((at, size - at))
        return ranges

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # arrays from raw() still use it; it is unmapped when the last one goes

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
