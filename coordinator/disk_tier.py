"""The snapshot cache's disk tier: entries that outlive the coordinator (issue 42).

A bounded store of snapshot entries (coordinator/snapshots.py's Entry: a 16-byte key,
its parent's key, its position; a block's KV bytes and, for a resume point, the
recurrent state's bytes), one file per entry, so that a long system prompt's chain
survives a restart. Storage only: which entries to write and when to read them is the
coordinator's.

Layout, under a root directory (default_dir()):
    root/lock                          flock'd by the one process using the root; its pid
    root/v1-<model_key>/<key hex>      one entry (32 lowercase hex characters)
    root/v1-<model_key>/<key hex>.<random>.tmp   an entry being written
model_key is a hex string naming the model's contents; another model's directory is
never read or touched, an older format version's is removed at open.

An entry's file, little-endian:
    offset 0     magic "FMSNAPDK"       8 bytes
           8     format version         u32     FORMAT_VERSION
          12     flags                  u32     bit 0: has a parent, bit 1: has a state
          16     model_key              64 bytes ASCII, NUL-padded
          80     key                    16 bytes  (the file's name, in hex)
          96     parent                 16 bytes  (zeros without one)
         112     position               u64
         120     kv_bytes               u64
         128     state_bytes            u64     (0 without a state)
         136     payload checksum       16 bytes  blake2b-128 of the KV bytes then the state bytes
         152     header checksum        16 bytes  blake2b-128 of bytes 0..152
         168     KV bytes, then state bytes         file length = 168 + kv_bytes + state_bytes
Opening reads each header only (a corrupt header, which its checksum covers, is found
then); get() reads the whole file and checks the payload's.

Crash safety:
  - An entry is written to a temporary name in its directory, fsync'd, then renamed
    over its name (atomic) and the directory fsync'd: a name holds a whole entry or
    nothing. A crash leaves at most a *.tmp file, removed at the next open.
  - Whatever a file holds is checked before it is used: a truncated, zero-length,
    foreign or corrupt file is removed with one log line, never raised.
  - A write error (ENOSPC, EDQUOT, EIO...) removes the temporary file and stops writing
    for good (one log line); reading goes on.
  - The LRU order is the files' mtimes (a write or a read stamps a strictly later
    one), so it survives a restart.
  - One process at a time per root (flock on root/lock, non-blocking: DiskTierLocked).
  - Directories are the user's only (0o700, files 0o600); the store's directory is
    opened without following a symbolic link and every file is reached through it.

Threads: put() from one writer thread, get()/info() from another. The in-memory index is
guarded by a lock held only for index changes and for the renames and unlinks that go
with them; writes and reads run outside it.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from shared.errors import FermoeError

log = logging.getLogger("fermoe.coordinator")

MAGIC = b"FMSNAPDK"
FORMAT_VERSION = 1
KEY_BYTES = 16
MODEL_KEY_BYTES = 64
_FIELDS = struct.Struct("<8sII64s16s16sQQQ16s")     # everything the header checksum covers
HEADER_BYTES = _FIELDS.size + 16                    # 168
HAS_PARENT, HAS_STATE = 1, 2
GiB = 1 << 30
_NO_PARENT = bytes(KEY_BYTES)
_ENTRY_NAME = re.compile(r"[0-9a-f]{32}")
_VERSION_DIR = re.compile(r"v(\d+)-[0-9a-f]+")


class DiskTierError(FermoeError):
    """The snapshot store's directory cannot be used (not ours, a symbolic link, in use)."""


class DiskTierLocked(DiskTierError):
    """Another process (or another DiskTier of this one) uses the root directory."""

    def __init__(self, root: Path, pid: int | None):
        who = f"process {pid}" if pid else "another process (its pid unknown)"
        super().__init__(f"snapshot store {root} is in use by {who}: it holds {root / 'lock'}")
        self.root, self.pid = root, pid


def default_dir() -> Path:
    """$XDG_CACHE_HOME/fermoe/snapshots, or ~/.cache/fermoe/snapshots (the XDG spec
    ignores a relative XDG_CACHE_HOME)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "fermoe" / "snapshots"


def default_capacity(root: str | Path) -> int:
    """Bytes the store may hold on root's filesystem (root need not exist yet)."""
    path = Path(root).absolute()
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    # A cache must not crowd out the user's own files: a quarter of the free space leaves
    # them the rest, and the store stops for good at the first ENOSPC, so filling the
    # disk would cost the cache itself too. 64 GiB holds thousands of resume points
    # (a state is tens of MB): beyond that the LRU keeps what nobody resumes from, and
    # each file costs a header read at every open.
    return min(st.f_bavail * st.f_frsize // 4, 64 * GiB)


@dataclass(frozen=True)
class _Meta:
    parent: bytes | None
    position: int
    kv_bytes: int
    state_bytes: int | None      # None: no state
    ino: int                     # the file the index means (a read checks it before removing)

    @property
    def size(self) -> int:
        return HEADER_BYTES + self.kv_bytes + (self.state_bytes or 0)


def _header(model_key: bytes, key: bytes, parent: bytes | None, position: int, kv, state) -> bytes:
    payload = hashlib.blake2b(kv, digest_size=16)
    if state is not None:
        payload.update(state)
    flags = (HAS_PARENT if parent is not None else 0) | (HAS_STATE if state is not None else 0)
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, flags, model_key, key, parent or _NO_PARENT, position,
                          kv.nbytes, state.nbytes if state is not None else 0, payload.digest())
    return fields + hashlib.blake2b(fields, digest_size=16).digest()


def _parse(header: bytes, model_key: bytes, key: bytes, file_bytes: int) -> tuple[_Meta, bytes] | str:
    """The entry a header describes and its payload checksum, or why the file is bad."""
    if len(header) < HEADER_BYTES:
        return f"truncated ({len(header)} bytes, less than a header)"
    fields = header[:_FIELDS.size]
    magic, version, flags, mk, k, parent, position, kv_bytes, state_bytes, payload_sum = _FIELDS.unpack(fields)
    if magic != MAGIC:
        return f"not a snapshot file (magic {magic!r})"
    if version != FORMAT_VERSION:
        return f"format version {version}, not {FORMAT_VERSION}"
    if hashlib.blake2b(fields, digest_size=16).digest() != header[_FIELDS.size:HEADER_BYTES]:
        return "header checksum mismatch"
    if mk != model_key:
        return f"another model's entry ({mk.rstrip(bytes(1)).decode(errors='replace')})"
    if k != key:
        return f"holds key {k.hex()}, not its name's"
    if flags & ~(HAS_PARENT | HAS_STATE) or (not flags & HAS_STATE and state_bytes):
        return f"bad flags {flags:#x}"
    expected = HEADER_BYTES + kv_bytes + state_bytes
    if file_bytes != expected:
        return f"{file_bytes} bytes, its header says {expected}"
    meta = _Meta(parent if flags & HAS_PARENT else None, position, kv_bytes,
                 state_bytes if flags & HAS_STATE else None, 0)
    return meta, payload_sum


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _bytes_view(data) -> memoryview:
    return memoryview(data).cast("B")


class DiskTier:
    """At most `capacity` bytes of snapshot entries of one model under root/v1-<model_key>/."""

    def __init__(self, root: str | Path, model_key: str, capacity: int):
        if not re.fullmatch(r"[0-9a-f]{1,%d}" % MODEL_KEY_BYTES, model_key):
            raise ValueError(f"model_key must be 1..{MODEL_KEY_BYTES} lowercase hex digits, got {model_key!r}")
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
        self.root = Path(root)
        self.model_key = model_key
        self.capacity = capacity
        self.directory = self.root / f"v{FORMAT_VERSION}-{model_key}"
        self._mk = model_key.encode().ljust(MODEL_KEY_BYTES, b"\0")
        self._lock = threading.Lock()          # the index, renames and unlinks, _stamp
        self._write_lock = threading.Lock()    # one put (or remove, clear, close) at a time
        self._index: OrderedDict[bytes, _Meta] = OrderedDict()    # least recently used first
        self._bytes = 0
        self._stamp = 0                        # the last mtime given (ns)
        self._writing = True
        self._closed = False
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._dir_fd = self._open_directory()
            self._remove_old_versions()
            self._scan()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # ---- opening ---------------------------------------------------------------
    def _take_lock(self) -> int:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise DiskTierLocked(self.root, int(text) if text.isdigit() else None) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _open_directory(self) -> int:
        try:
            os.mkdir(self.directory, 0o700)
        except FileExistsError:
            pass
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:       # ELOOP / ENOTDIR: a symbolic link or a file
            raise DiskTierError(f"snapshot store {self.directory} is not a directory (a symbolic link "
                                f"is not followed): {e.strerror}") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise DiskTierError(f"snapshot store {self.directory} belongs to uid {st.st_uid}, not to us")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd

    def _remove_old_versions(self) -> None:
        # Safe while we hold root/lock: no other fermoe process uses this root.
        for entry in os.scandir(self.root):
            m = _VERSION_DIR.fullmatch(entry.name)
            if m and int(m.group(1)) < FORMAT_VERSION and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
                log.info("snapshot store %s: removed %s (format version %s)", self.root, entry.name, m.group(1))

    def _discard(self, name: str, why: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        log.warning("snapshot store %s: removed %s: %s", self.directory, name, why)

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self._dir_fd):
            name = entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                log.warning("snapshot store %s: %s is a directory; left alone", self.directory, name)
                continue
            if name.endswith(".tmp"):
                self._discard(name, "a temporary file a crash left")
                continue
            if not stat.S_ISREG(st.st_mode) or not _ENTRY_NAME.fullmatch(name):
                self._discard(name, "not a snapshot entry's name")
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
                try:
                    header = os.pread(fd, HEADER_BYTES, 0)
                finally:
                    os.close(fd)
            except OSError as e:
                self._discard(name, f"unreadable ({e.strerror})")
                continue
            parsed = _parse(header, self._mk, bytes.fromhex(name), st.st_size)
            if isinstance(parsed, str):
                self._discard(name, parsed)
                continue
            meta = parsed[0]
            found.append((st.st_mtime_ns, name, _Meta(meta.parent, meta.position, meta.kv_bytes,
                                                      meta.state_bytes, st.st_ino)))
        for mtime, name, meta in sorted(found):
            self._index[bytes.fromhex(name)] = meta
            self._bytes += meta.size
            self._stamp = max(self._stamp, mtime)
        victims = self._pick_victims(0, None)
        for key in victims:
            self._unlink_quietly(key.hex())
        if victims:
            log.info("snapshot store %s: removed %d entries over its capacity of %d bytes",
                     self.directory, len(victims), self.capacity)

    # ---- the index -------------------------------------------------------------
    def _next_stamp(self) -> int:
        # strictly increasing, so that the mtime order is the LRU order; called under _lock
        self._stamp = max(time.time_ns(), self._stamp + 1)
        return self._stamp

    def _pick_victims(self, adding: int, keep: bytes | None) -> list[bytes]:
        """Drop least recently used entries (not `keep`) from the index until `adding`
        more bytes fit; the caller unlinks their files. Called under _lock or at open."""
        victims = []
        for key in list(self._index):
            if self._bytes + adding <= self.capacity:
                break
            if key != keep:
                self._bytes -= self._index.pop(key).size
                victims.append(key)
        return victims

    def info(self, key: bytes) -> tuple[bytes | None, int, bool] | None:
        """(parent, position, has_state) of a stored entry, from memory."""
        with self._lock:
            meta = self._index.get(key)
        return None if meta is None else (meta.parent, meta.position, meta.state_bytes is not None)

    def items(self) -> list[tuple[bytes, tuple[bytes | None, int, bool]]]:
        """(key, (parent, position, has_state)) of every stored entry, least recently used first."""
        with self._lock:
            return [(k, (m.parent, m.position, m.state_bytes is not None)) for k, m in self._index.items()]

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        """Bytes of the entries' files (headers included), at most capacity."""
        with self._lock:
            return self._bytes

    # ---- writing ---------------------------------------------------------------
    def put(self, key: bytes, parent: bytes | None, position: int, kv, state=None) -> bool:
        """Store an entry; True when this call wrote it. An entry already stored is kept
        unless this one adds a state; one larger than capacity, or any after a write
        error, is not written."""
        if len(key) != KEY_BYTES or (parent is not None and len(parent) != KEY_BYTES):
            raise ValueError(f"keys are {KEY_BYTES} bytes, got {len(key)} and "
                             f"{None if parent is None else len(parent)}")
        if position < 0:
            raise ValueError(f"position must be non-negative, got {position}")
        kv = _bytes_view(kv)
        state = None if state is None else _bytes_view(state)
        size = HEADER_BYTES + kv.nbytes + (state.nbytes if state is not None else 0)
        with self._write_lock:
            if not self._writing or self._closed or size > self.capacity:
                return False
            with self._lock:
                old = self._index.get(key)
                if old is not None and (old.state_bytes is not None or state is None):
                    return False
                victims = self._pick_victims(size - (old.size if old else 0), key)
            for victim in victims:
                self._unlink_quietly(victim.hex())
            tmp = f"{key.hex()}.{secrets.token_hex(4)}.tmp"
            try:
                header = _header(self._mk, key, parent, position, kv, state)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=self._dir_fd)
                try:
                    for part in (header, kv, state):
                        if part is not None:
                            _write_all(fd, memoryview(part))
                    os.fsync(fd)
                    with self._lock:
                        stamp = self._next_stamp()
                    os.utime(fd, ns=(stamp, stamp))
                    ino = os.fstat(fd).st_ino
                finally:
                    os.close(fd)
                meta = _Meta(parent, position, kv.nbytes, state.nbytes if state is not None else None, ino)
                with self._lock:
                    os.rename(tmp, key.hex(), src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
                    old = self._index.pop(key, None)
                    self._bytes += meta.size - (old.size if old else 0)
                    self._index[key] = meta
                os.fsync(self._dir_fd)
            except OSError as e:
                self._stop_writing(tmp, e)
                return False
            return True

    def _stop_writing(self, tmp: str, e: OSError) -> None:
        try:
            os.unlink(tmp, dir_fd=self._dir_fd)
        except OSError:
            pass
        self._writing = False
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        log.warning("snapshot store %s: %s (%s); no more entries are written, the stored ones are still read",
                    self.directory, "the disk is full" if full else "cannot write", e)

    def remove(self, key: bytes) -> None:
        with self._write_lock, self._lock:
            meta = self._index.pop(key, None)
            if meta is not None:
                self._bytes -= meta.size
                self._unlink_quietly(key.hex())

    def clear(self) -> None:
        """Remove every entry of this model."""
        with self._write_lock, self._lock:
            for key in self._index:
                self._unlink_quietly(key.hex())
            self._index.clear()
            self._bytes = 0

    def _unlink_quietly(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError:
            pass

    # ---- reading ---------------------------------------------------------------
    def get(self, key: bytes) -> tuple[bytes | None, int, bytes, bytes | None] | None:
        """(parent, position, kv, state or None) of a stored entry, its checksums verified;
        a hit becomes the most recently used. None when absent or bad (a bad file is removed)."""
        with self._lock:
            meta = self._index.get(key)
            if meta is None or self._closed:
                return None
            try:        # under the lock: close() cannot close _dir_fd meanwhile
                fd = os.open(key.hex(), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
            except OSError as e:
                self._index.pop(key)
                self._bytes -= meta.size
                log.warning("snapshot store %s: cannot open %s (%s); forgotten", self.directory, key.hex(), e)
                return None
        with open(fd, "rb") as f:
            try:
                st = os.fstat(fd)
                parsed = _parse(f.read(HEADER_BYTES), self._mk, key, st.st_size)
                if not isinstance(parsed, str):
                    found, payload_sum = parsed
                    kv = f.read(found.kv_bytes)
                    state = f.read(found.state_bytes) if found.state_bytes is not None else None
                    check = hashlib.blake2b(kv, digest_size=16)
                    if state is not None:
                        check.update(state)
                    if check.digest() != payload_sum:
                        parsed = "payload checksum mismatch"
            except OSError as e:
                log.warning("snapshot store %s: cannot read %s (%s)", self.directory, key.hex(), e)
                return None
            with self._lock:
                current = self._index.get(key)
                # not a file a put renamed over it or an eviction removed since, nor a closed store
                mine = current is not None and current.ino == st.st_ino and not self._closed
                if isinstance(parsed, str):
                    if mine:
                        self._index.pop(key)
                        self._bytes -= current.size
                        self._discard(key.hex(), parsed)
                    return None
                if mine:
                    self._index.move_to_end(key)
                    stamp = self._next_stamp()
            if mine:
                try:
                    os.utime(fd, ns=(stamp, stamp))
                except OSError:
                    pass        # the order in memory holds; only a restart's is off
        return found.parent, found.position, kv, state

    # ---- closing ---------------------------------------------------------------
    def close(self) -> None:
        """Release the root's lock; later puts return False and gets None."""
        with self._write_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._dir_fd)
            os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)       # releases the flock

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
