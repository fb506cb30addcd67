"""The snapshot disk tier across restarts (--snapshot-dir, --snapshot-disk): a prompt
prefilled before a restart resumes from disk after it, with the tokens a cold run gives; a
model file changed in one tensor finds nothing; a second coordinator on the directory
serves without it; what was written before a kill -9 is used."""
from __future__ import annotations

import time

import httpx

from coordinator.client import Client
from shared.builtin import BUILTIN
from shared.gguf_file import GGUFFile
from tests.support.gguf_edit import rewrite_gguf
from tests.support.http_server import HttpDaemon

PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n" * 8
BODY = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8}


def start(model, directory) -> HttpDaemon:
    return HttpDaemon(model, "--snapshot-dir", str(directory), "--snapshot-disk", "64MiB")


def complete(daemon, body=BODY) -> dict:
    r = httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def disk(daemon) -> dict:
    with Client(daemon.addr) as client:
        return {k: v for k, v in client.status().snapshots.items() if k.startswith("disk_")}


def wait_written(daemon, n: int, timeout_s: float = 30.0) -> None:
    """At least n entries written, and the entries pinned for the writer let go again (a
    snapshot held for ever could never be evicted)."""
    deadline = time.monotonic() + timeout_s
    while disk(daemon)["disk_written"] < n or pinned(daemon):
        assert time.monotonic() < deadline, (disk(daemon), pinned(daemon))
        time.sleep(0.1)


def pinned(daemon) -> int:
    with Client(daemon.addr) as client:
        return client.status().snapshots["pinned"]


def test_a_restart_resumes_from_disk_with_the_tokens_of_a_cold_run(tmp_path):
    """Guards: nothing written behind the arena, nothing found after a restart (the keys or the
    model key not stable across processes), a resumed state that is not the prompt's (its
    tokens would differ from the cold run's), or the next turn not resuming at the earlier
    prompt's end."""
    cold = HttpDaemon(BUILTIN["tiny"], "--snapshot-disk", "0")
    try:
        expected = complete(cold)
        turn = complete(cold, {**BODY, "prompt": PROMPT + expected["choices"][0]["text"] + "\nx = 1\n"})
    finally:
        assert cold.stop() == 0
    d = start(BUILTIN["tiny"], tmp_path)
    try:
        first = complete(d)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_written(d, 1)
    finally:
        assert d.stop() == 0
    d = start(BUILTIN["tiny"], tmp_path)
    try:
        again = complete(d)
        n = again["usage"]["prompt_tokens"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n       # its end, from disk
        assert again["choices"][0]["text"] == first["choices"][0]["text"] == expected["choices"][0]["text"]
        stats = disk(d)
        assert stats["disk_loads"] == 1 and stats["disk_load_failures"] == 0 and stats["disk_loaded_bytes"] > 0
        nxt = complete(d, {**BODY, "prompt": PROMPT + again["choices"][0]["text"] + "\nx = 1\n"})
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= n
        assert nxt["choices"][0]["text"] == turn["choices"][0]["text"]
    finally:
        assert d.stop() == 0


def test_a_model_changed_in_one_tensor_finds_nothing(tmp_path):
    """Guards: entries keyed by the metadata alone (a file whose weights changed would resume
    from states its weights never made)."""
    d = start(BUILTIN["tiny"], tmp_path / "store")
    try:
        complete(d)
        wait_written(d, 1)
    finally:
        assert d.stop() == 0
    changed = tmp_path / "tiny-changed.gguf"
    with GGUFFile(BUILTIN["tiny"]) as f:
        info = f.tensors["output_norm.weight"]
        raw = bytearray(f.raw(info.name))
    raw[0] ^= 1                                     # one bit of one weight: the metadata is the same
    rewrite_gguf(BUILTIN["tiny"], changed, tensors={info.name: (info.shape, info.qtype, bytes(raw))})
    with GGUFFile(BUILTIN["tiny"]) as a, GGUFFile(changed) as b:
        assert a.fingerprint == b.fingerprint
    d = start(changed, tmp_path / "store")
    try:
        assert complete(d)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert disk(d)["disk_loads"] == 0
    finally:
        assert d.stop() == 0


def test_a_second_coordinator_serves_without_the_directory_and_a_kill_keeps_what_was_written(tmp_path):
    """Guards: two coordinators writing one directory, the second failing to start, or a
    kill -9 losing (or corrupting) the entries written before it."""
    d = start(BUILTIN["tiny"], tmp_path)
    try:
        complete(d)
        wait_written(d, 1)
        other = start(BUILTIN["tiny"], tmp_path)
        try:
            assert complete(other)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert disk(other)["disk_capacity"] == 0 or disk(other)["disk_written"] == 0
            assert any("in use by process" in line for line in other.log), "".join(other.log[-10:])
        finally:
            assert other.stop() == 0
    finally:
        d.proc.kill()
        d.proc.wait(timeout=30)
    d = start(BUILTIN["tiny"], tmp_path)
    try:
        assert complete(d)["usage"]["prompt_tokens_details"]["cached_tokens"] == complete(d)["usage"]["prompt_tokens"]
    finally:
        assert d.stop() == 0
