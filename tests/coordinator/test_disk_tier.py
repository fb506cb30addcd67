"""The snapshot cache's disk tier (coordinator/disk_tier.py): files, checksums, LRU, lock."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator import disk_tier
from coordinator.disk_tier import DiskTier, DiskTierError, DiskTierLocked, default_capacity, default_dir

ROOT = Path(__file__).resolve().parents[2]
MODEL = "0123456789abcdef"
HEADER = 168                                   # the file format's header, in bytes


def k(n: int) -> bytes:
    return bytes([n]) * 16


def store(tmp_path, capacity=10_000, model=MODEL) -> DiskTier:
    return DiskTier(tmp_path / "snap", model, capacity)


def entry_path(tmp_path, key: bytes, model=MODEL) -> Path:
    return tmp_path / "snap" / f"v1-{model}" / key.hex()


def removals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fermoe.coordinator" and "removed" in r.getMessage()]


# ---- round trips -------------------------------------------------------------
def test_an_entry_with_a_state_and_one_without_come_back_as_written(tmp_path):
    """Guards the header's fields and the payload split (KV, then state) being written
    and read back in the same places."""
    with store(tmp_path) as t:
        assert t.put(k(1), None, 256, b"kv-one", b"state-one!") is True
        assert t.put(k(2), k(1), 512, memoryview(bytearray(b"kv-two")), None) is True
        assert t.get(k(1)) == (None, 256, b"kv-one", b"state-one!")
        assert t.get(k(2)) == (k(1), 512, b"kv-two", None)
        assert t.info(k(1)) == (None, 256, True) and t.info(k(2)) == (k(1), 512, False)
        assert t.get(k(3)) is None and t.info(k(3)) is None
        assert k(1) in t and k(3) not in t and len(t) == 2
        assert t.bytes_used == (168 + 16) + (168 + 6)
        assert entry_path(tmp_path, k(1)).stat().st_size == 184


def test_a_stored_entry_is_kept_unless_the_new_one_adds_a_state(tmp_path):
    """Guards a rewrite losing a state (a link re-put over a resume point) and a state
    never reaching an entry first written as a link."""
    with store(tmp_path) as t:
        assert t.put(k(1), None, 256, b"kv", b"state") is True
        assert t.put(k(1), None, 256, b"kv", b"other") is False
        assert t.put(k(1), None, 256, b"kv", None) is False
        assert t.get(k(1)) == (None, 256, b"kv", b"state")
        assert t.put(k(2), None, 256, b"kv", None) is True
        assert t.put(k(2), None, 256, b"kv", None) is False
        assert t.put(k(2), None, 256, b"kv", b"late") is True
        assert t.get(k(2)) == (None, 256, b"kv", b"late")
        assert t.bytes_used == (168 + 7) + (168 + 6) and len(t) == 2


def test_a_new_store_finds_the_entries_and_their_read_order(tmp_path):
    """Guards the restart: the scan must rebuild the index from the headers and the LRU
    order from the mtimes a read stamps (b, never read again, goes first)."""
    with store(tmp_path, capacity=3 * 178) as t:
        for n in (1, 2, 3):
            t.put(k(n), None, n, b"x" * 10)
        t.get(k(1))
    with store(tmp_path, capacity=3 * 178) as t:
        assert len(t) == 3 and t.bytes_used == 534
        assert t.info(k(2)) == (None, 2, False)
        assert t.put(k(4), None, 4, b"y" * 10) is True
        assert sorted(n for n in range(1, 5) if k(n) in t) == [1, 3, 4]
        assert not entry_path(tmp_path, k(2)).exists()
        assert t.get(k(1)) == (None, 1, b"x" * 10, None)


# ---- capacity ----------------------------------------------------------------
def test_one_off_puts_stay_within_capacity_and_the_least_recently_read_goes_first(tmp_path):
    """Guards eviction by bytes (the capacity held after every put, files unlinked) and
    by recency of reads, not of writes."""
    with store(tmp_path, capacity=3 * 178 + 5) as t:
        for n in (1, 2, 3):
            t.put(k(n), None, 0, b"x" * 10)
        t.get(k(1))
        t.put(k(4), None, 0, b"x" * 10)
        assert [n for n in (1, 2, 3, 4) if k(n) in t] == [1, 3, 4]
        for n in range(10, 30):                       # a stream of one-off prompts
            assert t.put(k(n), None, 0, b"z" * 10) is True
            assert t.bytes_used == 534 and len(t) == 3
        files = sorted(os.listdir(tmp_path / "snap" / f"v1-{MODEL}"))
        assert files == [k(27).hex(), k(28).hex(), k(29).hex()]


def test_an_entry_larger_than_capacity_is_refused_and_evicts_nothing(tmp_path):
    """Guards evicting the whole store for an entry that can never fit."""
    with store(tmp_path, capacity=200) as t:
        assert t.put(k(1), None, 0, b"x" * 32) is True                 # 200 bytes: fits exactly
        assert t.put(k(2), None, 0, b"x" * 33) is False
        assert t.put(k(1), None, 0, b"x" * 16, b"s" * 17) is False     # an upgrade too big
        assert t.get(k(1)) == (None, 0, b"x" * 32, None) and len(t) == 1 and t.bytes_used == 200


def test_a_store_over_a_lowered_capacity_is_trimmed_at_open(tmp_path):
    """Guards bytes_used exceeding the capacity after a restart with a smaller one."""
    with store(tmp_path) as t:
        for n in (1, 2, 3):
            t.put(k(n), None, 0, b"x" * 10)
    with store(tmp_path, capacity=2 * 178) as t:
        assert [n for n in (1, 2, 3) if k(n) in t] == [2, 3] and t.bytes_used == 356
        assert not entry_path(tmp_path, k(1)).exists()


# ---- bad files -----------------------------------------------------------------
def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


BAD_FILES = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-1]),
    "header cut": lambda p: p.write_bytes(p.read_bytes()[:100]),
    "position flipped": lambda p: flip(p, 112),
    "key flipped": lambda p: flip(p, 80),
    "another key's file": lambda p: p.write_bytes(p.with_name(k(2).hex()).read_bytes()),
    "zero length": lambda p: p.write_bytes(b""),
    "random bytes": lambda p: p.write_bytes(bytes(range(256)) * 2),
    "another magic": lambda p: p.write_bytes(b"GGUF" + p.read_bytes()[4:]),
}


@pytest.mark.parametrize("damage", BAD_FILES)
def test_a_bad_file_is_removed_at_open_with_one_log_line(tmp_path, caplog, damage):
    """Guards a corrupt, cut or foreign file being indexed (or raised) instead of removed:
    only the damaged file goes, its neighbour stays."""
    with store(tmp_path) as t:
        t.put(k(1), None, 0, b"kv" * 20, b"st" * 30)
        t.put(k(2), None, 7, b"good")
    BAD_FILES[damage](entry_path(tmp_path, k(1)))
    with caplog.at_level(logging.INFO, logger="fermoe.coordinator"), store(tmp_path) as t:
        assert k(1) not in t and len(t) == 1 and t.bytes_used == 172
        assert t.get(k(2)) == (None, 7, b"good", None)
    assert not entry_path(tmp_path, k(1)).exists()
    lines = removals(caplog)
    assert len(lines) == 1 and k(1).hex() in lines[0]


def test_stale_temporary_and_foreign_names_are_removed_at_open(tmp_path, caplog):
    """Guards a crash's half-written *.tmp (or a stranger's file) lingering forever,
    uncounted in the capacity."""
    with store(tmp_path) as t:
        t.put(k(2), None, 7, b"good")
    d = tmp_path / "snap" / f"v1-{MODEL}"
    (d / f"{k(1).hex()}.deadbeef.tmp").write_bytes(b"half an entry")
    (d / "notes.txt").write_bytes(b"hello")
    with caplog.at_level(logging.INFO, logger="fermoe.coordinator"), store(tmp_path) as t:
        assert len(t) == 1
    assert sorted(os.listdir(d)) == [k(2).hex()]
    lines = removals(caplog)
    assert len(lines) == 2
    assert any(".deadbeef.tmp: a temporary file a crash left" in line for line in lines)
    assert any("notes.txt: not a snapshot entry's name" in line for line in lines)


@pytest.mark.parametrize("offset", [HEADER, HEADER + 39, HEADER + 40, HEADER + 99])
def test_a_flipped_payload_bit_is_found_by_get_which_removes_the_file(tmp_path, caplog, offset):
    """Guards returning corrupt KV or state bytes: the open reads headers only, so get
    must check the payload's checksum (first and last byte of the KV and of the state)."""
    with store(tmp_path) as t:
        t.put(k(1), None, 0, b"kv" * 20, b"st" * 30)
        t.put(k(2), None, 7, b"good")
    flip(entry_path(tmp_path, k(1)), offset)
    with caplog.at_level(logging.INFO, logger="fermoe.coordinator"), store(tmp_path) as t:
        assert k(1) in t and removals(caplog) == []
        assert t.get(k(1)) is None
        assert k(1) not in t and t.bytes_used == 172 and not entry_path(tmp_path, k(1)).exists()
        assert t.get(k(2)) == (None, 7, b"good", None)
    lines = removals(caplog)
    assert len(lines) == 1 and "payload checksum" in lines[0]


def test_a_bad_read_never_removes_the_good_file_a_put_renamed_over_it(tmp_path, caplog, monkeypatch):
    """Guards the race of a read (outside the index's lock) finding the old file bad while
    the writer thread upgrades the entry: the new file must survive the old one's removal."""
    t = store(tmp_path)
    t.put(k(1), None, 0, b"kv")
    real_parse = disk_tier._parse

    def parse_during_an_upgrade(header, model_key, key, file_bytes):
        assert t.put(k(1), None, 0, b"kv", b"state") is True     # the writer thread, meanwhile
        return "payload checksum mismatch"

    monkeypatch.setattr(disk_tier, "_parse", parse_during_an_upgrade)
    with caplog.at_level(logging.INFO, logger="fermoe.coordinator"):
        assert t.get(k(1)) is None
    monkeypatch.setattr(disk_tier, "_parse", real_parse)
    assert removals(caplog) == []
    assert t.info(k(1)) == (None, 0, True) and t.get(k(1)) == (None, 0, b"kv", b"state")
    t.close()


# ---- models, versions, directories -------------------------------------------------------
def test_another_model_sees_nothing_and_leaves_the_first_models_files(tmp_path):
    """Guards resuming one model from another's states (their KV shapes may even match)."""
    with store(tmp_path) as t:
        t.put(k(1), None, 0, b"kv", b"state")
    with store(tmp_path, model="fedcba9876543210") as t:
        assert k(1) not in t and t.get(k(1)) is None and len(t) == 0
        t.put(k(2), None, 0, b"other")
        t.clear()
    assert entry_path(tmp_path, k(1)).exists()
    with store(tmp_path) as t:
        assert t.get(k(1)) == (None, 0, b"kv", b"state")


def test_a_file_moved_into_another_models_directory_is_removed(tmp_path, caplog):
    """Guards the header's model key being ignored (a copied file, a renamed directory)."""
    with store(tmp_path) as t:
        t.put(k(1), None, 0, b"kv")
    other = tmp_path / "snap" / "v1-fedcba9876543210"
    other.mkdir(mode=0o700)
    entry_path(tmp_path, k(1)).rename(other / k(1).hex())
    with caplog.at_level(logging.INFO, logger="fermoe.coordinator"), store(tmp_path, model="fedcba9876543210") as t:
        assert len(t) == 0
    lines = removals(caplog)
    assert len(lines) == 1 and "another model" in lines[0] and MODEL in lines[0]


def test_an_old_format_versions_directory_goes_and_other_names_stay(tmp_path):
    """Guards old-format entries filling the disk forever after an upgrade."""
    root = tmp_path / "snap"
    (root / "v0-0123").mkdir(parents=True)
    (root / "v0-0123" / "x").write_bytes(b"old")
    (root / "v2-0123").mkdir()
    (root / "mine").mkdir()
    with store(tmp_path):
        pass
    assert sorted(os.listdir(root)) == ["lock", "mine", f"v1-{MODEL}", "v2-0123"]


def test_directories_are_the_users_only(tmp_path):
    """Guards other users reading prompts' states: the store's directory is 0o700 even
    under a looser root, and its files 0o600."""
    root = tmp_path / "snap"
    with store(tmp_path) as t:
        t.put(k(1), None, 0, b"kv")
    assert root.stat().st_mode & 0o777 == 0o700
    assert (root / f"v1-{MODEL}").stat().st_mode & 0o777 == 0o700
    assert entry_path(tmp_path, k(1)).stat().st_mode & 0o777 == 0o600
    assert (root / "lock").stat().st_mode & 0o777 == 0o600
    os.chmod(root, 0o755)
    os.chmod(root / f"v1-{MODEL}", 0o755)
    with store(tmp_path):
        pass
    assert root.stat().st_mode & 0o777 == 0o755
    assert (root / f"v1-{MODEL}").stat().st_mode & 0o777 == 0o700


def test_a_symlinked_store_directory_is_refused_and_not_followed(tmp_path):
    """Guards writing (or removing files) wherever a planted symbolic link points."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_bytes(b"keep me")
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / f"v1-{MODEL}").symlink_to(target)
    with pytest.raises(DiskTierError, match=f"v1-{MODEL} is not a directory"):
        store(tmp_path)
    assert os.listdir(target) == ["precious"]
    with store(tmp_path, model="fedcba9876543210"):     # the lock was released
        pass


# ---- the lock ----------------------------------------------------------------------
OPEN_IN_CHILD = textwrap.dedent("""
    import sys
    from coordinator.disk_tier import DiskTier, DiskTierLocked
    try:
        DiskTier(sys.argv[1], "0123456789abcdef", 1000).close()
        print("opened")
    except DiskTierLocked as e:
        print(f"locked {e.pid} | {e}")
""")


def open_in_child(root: Path) -> str:
    done = subprocess.run([sys.executable, "-c", OPEN_IN_CHILD, str(root)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_second_process_is_refused_with_the_holders_pid_until_the_first_closes(tmp_path):
    """Guards two coordinators writing (and evicting) one store at once."""
    root = tmp_path / "snap"
    t = store(tmp_path)
    assert open_in_child(root) == (f"locked {os.getpid()} | snapshot store {root} is in use by process "
                                   f"{os.getpid()}: it holds {root}/lock")
    t.close()
    assert open_in_child(root) == "opened"
    with store(tmp_path):
        pass


def test_a_second_store_in_the_same_process_is_refused_too(tmp_path):
    """Guards the flock being per process instead of per open: two DiskTiers of one
    process would evict each other's files under their indexes."""
    with store(tmp_path):
        with pytest.raises(DiskTierLocked) as caught:
            store(tmp_path, model="fedcba9876543210")
        assert caught.value.pid == os.getpid()


# ---- a full disk ---------------------------------------------------------------------
def test_a_full_disk_stops_writing_for_good_but_reading_goes_on(tmp_path, caplog, monkeypatch):
    """Guards retrying every put against a full disk (and logging each), a half-written
    temporary file left behind, and reads stopping with the writes."""
    t = store(tmp_path)
    t.put(k(1), None, 0, b"kv", b"state")
    real_write = os.write
    calls = []

    def full_write(fd, data):
        calls.append(fd)
        if len(calls) == 1:
            return real_write(fd, data[:10])          # part of the header, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_write)
    with caplog.at_level(logging.INFO, logger="fermoe.coordinator"):
        assert t.put(k(2), None, 0, b"kv2") is False
        monkeypatch.setattr(os, "write", real_write)
        assert t.put(k(3), None, 0, b"kv3") is False
        assert t.put(k(1), None, 0, b"kv", b"state") is False
    assert len(calls) == 2
    messages = [r.getMessage() for r in caplog.records if r.name == "fermoe.coordinator"]
    assert len(messages) == 1 and "the disk is full" in messages[0]
    assert sorted(os.listdir(tmp_path / "snap" / f"v1-{MODEL}")) == [k(1).hex()]
    assert t.get(k(1)) == (None, 0, b"kv", b"state") and len(t) == 1
    t.close()


# ---- removing, closing ---------------------------------------------------------------
def test_remove_and_clear_delete_the_files_and_the_bytes(tmp_path):
    """Guards the index and the disk disagreeing after a removal (a file left uncounted)."""
    with store(tmp_path) as t:
        for n in (1, 2, 3):
            t.put(k(n), None, 0, b"x" * 10)
        t.remove(k(2))
        t.remove(k(9))
        assert len(t) == 2 and t.bytes_used == 356 and not entry_path(tmp_path, k(2)).exists()
        t.clear()
        assert len(t) == 0 and t.bytes_used == 0
        assert os.listdir(tmp_path / "snap" / f"v1-{MODEL}") == []
        assert t.put(k(4), None, 0, b"x") is True
    with store(tmp_path) as t:
        assert len(t) == 1


def test_a_closed_store_neither_writes_nor_reads(tmp_path, caplog):
    """Guards a late write-behind put or a read after close reaching the closed (maybe
    reused) directory fd."""
    t = store(tmp_path)
    t.put(k(1), None, 0, b"x")
    t.close()
    t.close()
    with caplog.at_level(logging.INFO, logger="fermoe.coordinator"):
        assert t.put(k(2), None, 0, b"x") is False and t.get(k(1)) is None
    assert caplog.records == []


# ---- defaults ------------------------------------------------------------------------
def test_default_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    """Guards writing into the working directory when XDG_CACHE_HOME is relative (the
    XDG spec says to ignore it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/me")
    assert default_dir() == Path("/var/cache/me/fermoe/snapshots")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert default_dir() == tmp_path / ".cache/fermoe/snapshots"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_dir() == tmp_path / ".cache/fermoe/snapshots"


@pytest.mark.parametrize("free_blocks, expected", [(1000, 1024_000), (10 << 30, 64 << 30)])
def test_default_capacity_is_a_quarter_of_the_free_space_at_most_64_gib(monkeypatch, tmp_path, free_blocks, expected):
    """Guards a cache that fills the user's disk (or counts the blocks root cannot use)."""
    seen = []

    class Fs:
        f_bavail, f_frsize, f_bfree = free_blocks, 4096, free_blocks * 2

    monkeypatch.setattr(disk_tier.os, "statvfs", lambda p: seen.append(p) or Fs)
    assert default_capacity(tmp_path / "not" / "yet") == expected
    assert seen == [tmp_path]
