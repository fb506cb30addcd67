"""shared/curve.py: the key files `fermoe keys` writes, what a bad one says, the
endpoints counted as loopback, and CURVE as the coordinator's sockets use it (a
server socket with its ZAP handler, client sockets with and without the right keys)."""
from __future__ import annotations

import logging
import os
import stat
import time

import pytest
import zmq

from shared import curve
from shared.errors import FermoeError


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_write_keys_makes_private_files_that_load_back(tmp_path):
    root = tmp_path / "keys"
    written = curve.write_keys(root)
    assert {p.relative_to(root).as_posix() for p in written} == {
        "server.key", "server.key_secret", "workers/worker.key", "workers/worker.key_secret",
        "clients/client.key", "clients/client.key_secret"}
    assert mode(root) == mode(root / "workers") == mode(root / "clients") == 0o700
    assert all(mode(p) == (0o600 if p.suffix == ".key_secret" else 0o644) for p in written)
    server = curve.ServerKeys(root)
    worker = curve.ClientKeys(root / "workers" / "worker.key_secret")
    assert worker.server == server.public                  # the one file is all a worker needs
    assert server.workers.keys == {worker.public}
    assert server.clients.keys == {curve.load_public(root / "clients" / "client.key")}
    assert worker.public not in server.clients.keys        # the lists are apart


def test_write_keys_refuses_to_overwrite_unless_forced_and_keeps_the_server(tmp_path):
    curve.write_keys(tmp_path)
    old_server = curve.load_public(tmp_path / "server.key")
    old_worker = curve.load_public(tmp_path / "workers" / "worker.key")
    with pytest.raises(FermoeError, match="worker.key_secret.*already there.*--force"):
        curve.write_keys(tmp_path)
    curve.write_keys(tmp_path, workers=["host2"], clients=[])        # another pair: the server's kept
    assert curve.ClientKeys(tmp_path / "workers" / "host2.key_secret").server == old_server
    curve.write_keys(tmp_path, force=True)
    assert curve.load_public(tmp_path / "workers" / "worker.key") != old_worker
    assert curve.load_public(tmp_path / "server.key") == old_server
    with pytest.raises(FermoeError, match="plain file name"):
        curve.write_keys(tmp_path, workers=["../x"])


def test_bad_key_files_are_errors_naming_the_file(tmp_path):
    curve.write_keys(tmp_path)
    secret = tmp_path / "workers" / "worker.key_secret"
    secret.chmod(0o644)
    with pytest.raises(FermoeError, match=f"{secret}: a secret key that others may read.*chmod 600"):
        curve.ClientKeys(secret)
    secret.chmod(0o600)
    secret.write_text(secret.read_text().replace("secret-key = \"", "secret-key = \"~~"))
    with pytest.raises(FermoeError, match=f"{secret}: no valid secret key"):
        curve.ClientKeys(secret)
    missing = tmp_path / "nope.key_secret"
    with pytest.raises(FermoeError, match=f"{missing}: cannot read"):
        curve.ClientKeys(missing)
    server_only = tmp_path / "server.key_secret"      # a pair without the server's public key in it
    with pytest.raises(FermoeError, match="server public key"):
        curve.ClientKeys(server_only)
    with pytest.raises(FermoeError, match="not a directory"):
        curve.ServerKeys(tmp_path / "none")


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.3.0.1:*", True), ("tcp://[::1]:5557", True),
    ("tcp://localhost:5557", True), ("ipc:///tmp/x", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5557", False), ("tcp://*:5557", False), ("tcp://10.0.0.1:5557", False),
    ("tcp://[::]:5557", False), ("tcp://eth0:5557", False), ("tcp://example.com:1", False), ("nonsense", False)])
def test_loopback_endpoints(endpoint, loopback):
    assert curve.is_loopback(endpoint) is loopback


@pytest.fixture
def server(tmp_path):
    """A CURVE ROUTER of the worker domain on loopback, as the coordinator makes it, and
    its keys directory; a second directory's keys are the wrong ones."""
    curve.write_keys(tmp_path / "keys")
    curve.write_keys(tmp_path / "other")
    keys = curve.ServerKeys(tmp_path / "keys")
    ctx = zmq.Context()
    keys.start(ctx)
    sock = ctx.socket(zmq.ROUTER)
    keys.apply(sock, curve.WORKERS)
    sock.bind("tcp://127.0.0.1:*")
    watch = curve.HandshakeWatch(sock, "worker")
    yield sock, watch, tmp_path
    watch.close()
    keys.stop()
    ctx.destroy(linger=0)


def heard(sock, watch, key_file) -> bool:
    """Whether a DEALER with key_file's keys (None: none) gets a message through."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger = 0
    if key_file is not None:
        curve.ClientKeys(key_file).apply(dealer)
    dealer.connect(sock.last_endpoint.decode())
    dealer.send(b"hello")
    try:
        return bool(sock.poll(1500)) and sock.recv_multipart()[-1] == b"hello"
    finally:
        dealer.close()
        watch.drain()


def test_only_the_listed_keys_of_the_socket_domain_get_through(server, caplog):
    sock, watch, root = server
    with caplog.at_level(logging.WARNING, "fermoe.curve"):
        assert heard(sock, watch, root / "keys" / "workers" / "worker.key_secret")
        assert not heard(sock, watch, root / "keys" / "clients" / "client.key_secret")    # a client's key
        assert not heard(sock, watch, root / "other" / "workers" / "worker.key_secret")   # another server's
        assert not heard(sock, watch, None)
        time.sleep(0.2)
        watch.drain()
    assert "refused a worker with an unknown CURVE key" in caplog.text
    assert "refused a connection to the worker socket: a peer without CURVE keys" in caplog.text
    assert heard(sock, watch, root / "keys" / "workers" / "worker.key_secret")    # still serving


def test_a_refused_worker_says_it_heard_nothing(server, caplog, monkeypatch):
    """A worker whose handshake is refused hears nothing at all: after its wait it says so."""
    from shared import worker_link
    sock, watch, root = server
    monkeypatch.setattr(worker_link, "WELCOME_WAIT_S", 0.3)
    key = root / "other" / "workers" / "worker.key_secret"
    link = worker_link.WorkerLink(sock.last_endpoint.decode(), "w1", lambda dtype: None, curve_key=str(key))
    try:
        with caplog.at_level(logging.WARNING, "fermoe.worker_link"):
            link.hello(os.getpid(), 1, "fp")
            for _ in range(5):
                assert not link.serve({}, 100)
    finally:
        link.sock.close(linger=0)
    assert caplog.text.count("no answer from the coordinator") == 1
    assert str(key) in caplog.text
