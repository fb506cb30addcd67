"""Fixed-size slots in one POSIX shared-memory segment: the snapshot store's memory.

The coordinator creates one arena for its snapshot budget; workers attach to it by
name and read or write whole slots. It has two regions of slots of their own sizes:
the snapshot store keeps one block's KV in a slot of the first (`slot`) and a
recurrent state in a slot of the second (`state_slot`, shared/state.py); a segment of
one kind of slot (the shared experts) leaves the second empty. One segment, so that a
GPU worker page-locks one mapping. Messages carry only slot numbers; the segment name
and geometry are told once.

Layout of /dev/shm/<name> (what shm_open("/<name>") opens from C), little-endian:

    offset 0            header, 64 bytes
                          0  magic "FMARENA2"   8 bytes
                          8  layout version     u32
                         12  reserved           u32
                         16  slot_bytes         u64   usable bytes of a slot
                         24  n_slots            u64
                         32  state_slot_bytes   u64   usable bytes of a state slot (0: none)
                         40  n_state_slots      u64
                         48  creator pid        u64
                         56  reserved           8 bytes
    offset 64           slot 0       [slot_bytes, then padding to stride]
    ...
    offset 64+i*stride  slot i       (stride: slot_bytes rounded up to 64)
    offset S = 64 + n_slots*stride
    offset S+j*sstride  state slot j (sstride: state_slot_bytes rounded up to 64)
    total = S + n_state_slots * sstride          (every slot starts 64-byte aligned)

Who creates, who unlinks (vLLM shm_broadcast's rule): the creating process alone
unlinks the name, on `unlink()`, on leaving its `with` block, or when it exits
cleanly (interpreter exit or garbage collection) without having done so; a forked
child of the creator never does. Attaching processes only map and unmap. We map
/dev/shm ourselves instead of using multiprocessing.shared_memory because in
Python 3.11 its resource tracker also tracks attached segments and unlinks them
(with a warning) when an attaching process exits. A creator killed by SIGKILL
leaves its segment behind; `remove_stale` reclaims such segments by the pid in
their name.
"""
from __future__ import annotations

import mmap
import operator
import os
import re
import secrets
import struct
import weakref

from .errors import FermoeError

SHM_DIR = "/dev/shm"
# Linux 5.14+ (Python 3.11 lacks the name): map pages writable without writing them
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PREFAULT_CHUNK = 2 << 20
MAGIC = b"FMARENA2"
LAYOUT_VERSION = 2
HEADER_BYTES = 64
ALIGN = 64
_HEADER = struct.Struct("<8sIIQQQQQ")


class ArenaError(FermoeError, ValueError):
    """A shared-memory arena cannot be made, found, matched or used as asked."""


def _stride(slot_bytes: int) -> int:
    return (slot_bytes + ALIGN - 1) // ALIGN * ALIGN


def _total(slot_bytes: int, n_slots: int, state_slot_bytes: int = 0, n_state_slots: int = 0) -> int:
    return HEADER_BYTES + n_slots * _stride(slot_bytes) + n_state_slots * _stride(state_slot_bytes)


def _check_geometry(slot_bytes: int, n_slots: int, state_slot_bytes: int = 0, n_state_slots: int = 0) -> None:
    if not isinstance(slot_bytes, int) or slot_bytes < 1:
        raise ArenaError(f"slot_bytes must be a positive integer, got {slot_bytes!r}")
    if not isinstance(n_slots, int) or n_slots < 1:
        raise ArenaError(f"n_slots must be a positive integer, got {n_slots!r}")
    for name, value in (("state_slot_bytes", state_slot_bytes), ("n_state_slots", n_state_slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ArenaError(f"{name} must be a non-negative integer, got {value!r}")
    if (state_slot_bytes == 0) != (n_state_slots == 0):
        raise ArenaError(f"state slots need both a size and a count, got state_slot_bytes={state_slot_bytes}, "
                         f"n_state_slots={n_state_slots}")


def _path(name: str) -> str:
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or bare in (".", ".."):
        raise ArenaError(f"bad shared-memory name {name!r}")
    return os.path.join(SHM_DIR, bare)


def _unlink_if_creator(path: str, creator_pid: int) -> None:
    # Runs at garbage collection or interpreter exit; a fork child inherits it.
    if os.getpid() == creator_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class SnapshotArena:
    """`n_slots` slots of `slot_bytes` bytes each, then `n_state_slots` slots of
    `state_slot_bytes` bytes each (none by default), in one shared-memory segment."""

    def __init__(self, name: str, slot_bytes: int, n_slots: int, mm: mmap.mmap,
                 creator: bool, state_slot_bytes: int = 0, n_state_slots: int = 0):
        # Use create() or attach(); this only wires up an existing mapping.
        self.name = name
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.stride = _stride(slot_bytes)
        self.state_slot_bytes = state_slot_bytes
        self.n_state_slots = n_state_slots
        self.state_stride = _stride(state_slot_bytes)
        self.nbytes = _total(slot_bytes, n_slots, state_slot_bytes, n_state_slots)
        self.creator = creator
        self._pid = os.getpid()
        self._path = _path(name)
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._views: list[weakref.ref] = []          # writable memoryviews are unhashable
        self._unlinked = False
        self._finalizer = (weakref.finalize(self, _unlink_if_creator, self._path, self._pid)
                           if creator else None)

    # ---- making and finding --------------------------------------------------
    @classmethod
    def create(cls, slot_bytes: int, n_slots: int, prefix: str = "fermoe",
               reserve: bool = False, state_slot_bytes: int = 0, n_state_slots: int = 0) -> "SnapshotArena":
        """A new segment named `<prefix>-<pid>-<random>`, zero-filled.

        Pages are allocated as slots are first written, so an unused budget costs no
        RAM; a /dev/shm with less free space than the whole arena is refused here
        (a write into a page tmpfs cannot back is a SIGBUS, not an exception).
        reserve=True allocates every page now (posix_fallocate: time in proportion to the size)."""
        _check_geometry(slot_bytes, n_slots, state_slot_bytes, n_state_slots)
        if not re.fullmatch(r"[A-Za-z0-9_.]+", prefix):
            raise ArenaError(f"arena prefix {prefix!r}: use letters, digits, '_' or '.'")
        total = _total(slot_bytes, n_slots, state_slot_bytes, n_state_slots)
        for _ in range(16):
            name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                break
            except FileExistsError:
                continue
        else:
            raise ArenaError(f"could not find a free shared-memory name for {prefix!r}")
        try:
            mm = _size_and_map(fd, name, total, reserve)
        except BaseException:
            os.close(fd)
            os.unlink(_path(name))
            raise
        os.close(fd)
        _HEADER.pack_into(mm, 0, MAGIC, LAYOUT_VERSION, 0, slot_bytes, n_slots,
                          state_slot_bytes, n_state_slots, os.getpid())
        return cls(name, slot_bytes, n_slots, mm, creator=True, state_slot_bytes=state_slot_bytes,
                   n_state_slots=n_state_slots)

    @classmethod
    def attach(cls, name: str, slot_bytes: int, n_slots: int, state_slot_bytes: int = 0,
               n_state_slots: int = 0) -> "SnapshotArena":
        """Map an existing arena; its size and header must match the geometry given."""
        _check_geometry(slot_bytes, n_slots, state_slot_bytes, n_state_slots)
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ArenaError(f"shared-memory arena {name!r}: no such segment ({path})") from None
        try:
            size = os.fstat(fd).st_size
            total = _total(slot_bytes, n_slots, state_slot_bytes, n_state_slots)
            if size != total:
                raise ArenaError(f"shared-memory arena {name!r} is {size} bytes; "
                                 f"{n_slots} slots of {slot_bytes} bytes and {n_state_slots} state slots "
                                 f"of {state_slot_bytes} bytes need {total}")
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        magic, version, _, sb, ns, ssb, nss, _ = _HEADER.unpack_from(mm, 0)
        if (magic, version, sb, ns, ssb, nss) != (MAGIC, LAYOUT_VERSION, slot_bytes, n_slots,
                                                  state_slot_bytes, n_state_slots):
            mm.close()
            raise ArenaError(f"shared-memory arena {name!r}: header says magic={magic!r} "
                             f"version={version} slot_bytes={sb} n_slots={ns} state_slot_bytes={ssb} "
                             f"n_state_slots={nss}, expected {MAGIC!r} v{LAYOUT_VERSION} "
                             f"slot_bytes={slot_bytes} n_slots={n_slots} "
                             f"state_slot_bytes={state_slot_bytes} n_state_slots={n_state_slots}")
        return cls(name, slot_bytes, n_slots, mm, creator=False, state_slot_bytes=state_slot_bytes,
                   n_state_slots=n_state_slots)

    @staticmethod
    def remove_stale(prefix: str = "fermoe") -> list[str]:
        """Unlink arenas `<prefix>-<pid>-*` whose creating pid is gone (a SIGKILLed
        coordinator's). Returns the names removed. Pids are of this pid namespace."""
        pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]{{8}}")
        removed = []
        for entry in os.listdir(SHM_DIR):
            m = pattern.fullmatch(entry)
            if m and not _pid_alive(int(m.group(1))):
                try:
                    os.unlink(os.path.join(SHM_DIR, entry))
                    removed.append(entry)
                except FileNotFoundError:
                    pass
        return removed

    # ---- using ---------------------------------------------------------------
    def offset(self, i: int) -> int:
        """Byte offset of slot i in the segment (for a C or CUDA reader mapping it whole)."""
        return HEADER_BYTES + self._check_slot(i, self.n_slots) * self.stride

    def state_offset(self, j: int) -> int:
        """Byte offset of state slot j in the segment."""
        return HEADER_BYTES + self.n_slots * self.stride + self._check_slot(j, self.n_state_slots, "state ") \
            * self.state_stride

    def slot(self, i: int) -> memoryview:
        """A writable view of slot i's `slot_bytes` bytes (format 'B')."""
        return self._view(self.offset(i), self.slot_bytes)

    def state_slot(self, j: int) -> memoryview:
        """A writable view of state slot j's `state_slot_bytes` bytes (format 'B')."""
        return self._view(self.state_offset(j), self.state_slot_bytes)

    def _view(self, off: int, nbytes: int) -> memoryview:
        if self._mv is None:
            raise ArenaError(f"shared-memory arena {self.name!r} is closed")
        view = self._mv[off:off + nbytes]
        if len(self._views) >= 64:
            self._views = [r for r in self._views if r() is not None]
        self._views.append(weakref.ref(view))
        return view

    def prefault(self, chunk: int = PREFAULT_CHUNK):
        """Map this process's pages of the state slots, `chunk` bytes a step: a generator to
        advance between other work (a worker, while idle). A process's first write into a
        page of the segment costs it a page fault, ~10 us a 4 KB page where the host is
        virtualised: ~0.2 s for a recurrent state's slot, at the end of every request whose
        final snapshot takes a fresh one. Nothing is written; the state slots' pages become
        resident (the KV slots, small and written a block at a time, stay as they are).
        Where the kernel lacks MADV_POPULATE_WRITE it stops at once."""
        if self._mm is None or not self.n_state_slots:
            return
        page = mmap.PAGESIZE
        begin = (HEADER_BYTES + self.n_slots * self.stride) // page * page    # the page of state slot 0
        for off in range(begin, len(self._mm), chunk):
            if self._mm is None:
                return
            try:
                self._mm.madvise(MADV_POPULATE_WRITE, off, min(chunk, len(self._mm) - off))
            except OSError:
                return
            yield True

    def memory(self) -> memoryview:
        """A writable view of the whole segment (a GPU worker page-locks it, so that
        snapshots are copied from the device straight into their slots)."""
        if self._mv is None:
            raise ArenaError(f"shared-memory arena {self.name!r} is closed")
        view = self._mv[:]
        self._views.append(weakref.ref(view))
        return view

    def _check_slot(self, i, n: int, kind: str = "") -> int:
        try:
            index = operator.index(i)
        except TypeError:
            index = None
        if index is None or isinstance(i, bool) or not 0 <= index < n:
            has = f"{kind}slots 0..{n - 1}" if n else f"no {kind}slots"
            raise ArenaError(f"{kind}slot {i!r} is out of range: arena {self.name!r} has {has}")
        return index

    @property
    def closed(self) -> bool:
        return self._mv is None

    def close(self) -> None:
        """Unmap. Views from slot() are released and must not be used after. Arrays
        still built on a slot (np.frombuffer) keep the mapping alive until they go,
        so nothing ever points at unmapped memory."""
        if self._mv is None:
            return
        for ref in self._views:
            view = ref()
            if view is not None:
                try:
                    view.release()
                except BufferError:
                    pass
        self._views = []
        self._mv.release()
        self._mv = None
        try:
            self._mm.close()
        except BufferError:
            pass            # exported buffers remain; the mmap unmaps when they die
        self._mm = None

    def unlink(self) -> None:
        """Remove the segment's name (creator only). Mappings stay valid until closed."""
        if not self.creator or os.getpid() != self._pid:
            raise ArenaError(f"shared-memory arena {self.name!r}: only the creating process "
                             f"(pid {self._pid}, creator={self.creator}) may unlink it")
        if self._finalizer is not None:
            self._finalizer.detach()
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SnapshotArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.creator and os.getpid() == self._pid:
            self.unlink()

    def __repr__(self) -> str:
        role = "creator" if self.creator else "attached"
        state = "closed" if self.closed else "open"
        states = (f", state_slot_bytes={self.state_slot_bytes}, n_state_slots={self.n_state_slots}"
                  if self.n_state_slots else "")
        return (f"SnapshotArena({self.name!r}, slot_bytes={self.slot_bytes}, "
                f"n_slots={self.n_slots}{states}, {role}, {state})")


def _size_and_map(fd: int, name: str, total: int, reserve: bool) -> mmap.mmap:
    free = os.statvfs(SHM_DIR)
    avail = free.f_bavail * free.f_frsize
    problem = f"{total} bytes do not fit in {SHM_DIR} ({avail} bytes free)"
    if total > avail:
        raise ArenaError(f"shared-memory arena {name!r}: {problem}; lower the snapshot "
                         f"budget or enlarge {SHM_DIR}")
    if reserve:
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            raise ArenaError(f"shared-memory arena {name!r}: {problem}: {e.strerror}") from None
    else:
        os.ftruncate(fd, total)
    return mmap.mmap(fd, total)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
