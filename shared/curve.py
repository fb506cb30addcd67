"""ZeroMQ's own CURVE security for the coordinator's sockets: key files, and the
settings of a server socket (the coordinator's) and of a client socket (a worker's,
a client's). No crypto of ours: libzmq encrypts and authenticates, its ZAP handler
(pyzmq's ThreadAuthenticator) decides which public keys may connect.

The keys directory that `fermoe keys DIR` writes (ZeroMQ's certificate files):

    DIR/server.key, server.key_secret      the coordinator's pair (its secret never leaves DIR)
    DIR/workers/NAME.key, NAME.key_secret  a pair that may join as a worker ("worker" by default)
    DIR/clients/NAME.key, NAME.key_secret  a pair that may submit work ("client" by default)

The coordinator accepts on its worker socket only the public keys in DIR/workers and on
its client socket only those in DIR/clients (each socket has its own ZAP domain), so a
client's key cannot join as a worker nor a worker's submit work. Each NAME.key_secret
also carries the server's public key (in its metadata), so the one file is all a worker
or client on another host needs: `--curve-key FILE`. The coordinator's own workers use
workers/worker.key_secret, its HTTP front end clients/client.key_secret.
"""
from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import zmq
from zmq.utils import z85

from .errors import FermoeError

log = logging.getLogger("fermoe.curve")
SERVER = "server"
WORKERS, CLIENTS = "workers", "clients"        # the subdirectories, and the sockets' ZAP domains
OWN_WORKER, OWN_CLIENT = "worker", "client"    # the pairs the coordinator's own children use
SERVER_KEY_FIELD = "server-key"                # in a pair's secret file: the server's public key
KEY_CHARS = 40                                 # a Z85 CURVE key (32 bytes)
RELOG_S = 60.0                                 # a refused peer retries every 100 ms: one line a minute


# ---- files ----------------------------------------------------------------------
def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)          # an existing directory too: the secret files go in it


def write_keys(directory: str | os.PathLike, workers=(OWN_WORKER,), clients=(OWN_CLIENT,),
               force: bool = False) -> list[Path]:
    """Write the server pair (unless DIR has one already: the pairs made with it carry its
    public key) and the named worker and client pairs; the files written. A named pair
    that exists is refused unless `force`, which makes it anew (the old one then stops
    working). A new server pair: a new DIR."""
    root = Path(directory)
    wanted = [(root / WORKERS, n) for n in workers] + [(root / CLIENTS, n) for n in clients]
    for name in [*workers, *clients]:
        if not name or "/" in name or name.startswith(".") or name == SERVER:
            raise FermoeError(f"key name {name!r}: expected a plain file name such as worker1")
    have_server = (root / f"{SERVER}.key_secret").exists()
    existing = [str(d / f"{n}.key_secret") for d, n in wanted if (d / f"{n}.key_secret").exists()]
    if existing and not force:
        raise FermoeError(f"{', '.join(existing)}: already there (--force makes them anew, and the old ones stop "
                          f"working)")
    _private_dir(root)
    written = []
    if not have_server:
        written += _create(root, SERVER)
    server_public, _ = load_pair(root / f"{SERVER}.key_secret")
    for folder, name in wanted:
        _private_dir(folder)
        written += _create(folder, name, {SERVER_KEY_FIELD: server_public.decode()})
    return written


def _create(folder: Path, name: str, metadata=None) -> list[Path]:
    import zmq.auth
    public, secret = map(Path, zmq.auth.create_certificates(folder, name, metadata))
    secret.chmod(0o600)         # pyzmq writes as the umask says; the 0700 directory kept others out meanwhile
    public.chmod(0o644)
    return [public, secret]


def _check_key(key: bytes | None, path, what: str) -> bytes:
    if key is None or len(key) != KEY_CHARS:
        raise FermoeError(f"{path}: no valid {what} (a {KEY_CHARS}-character Z85 CURVE key)")
    try:
        z85.decode(key)
    except (ValueError, KeyError, IndexError):
        raise FermoeError(f"{path}: its {what} is not Z85 text") from None
    return key


def load_public(path) -> bytes:
    """The public key of a certificate file (NAME.key or NAME.key_secret)."""
    import zmq.auth
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise FermoeError(f"{path}: cannot read a CURVE key: {e}") from None
    return _check_key(public, path, "public key")


def load_pair(path) -> tuple[bytes, bytes]:
    """(public, secret) of a NAME.key_secret file, which only its owner may read."""
    import zmq.auth
    try:
        mode = os.stat(path).st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise FermoeError(f"{path}: cannot read a CURVE key: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):       # as ssh does with a private key
        raise FermoeError(f"{path}: a secret key that others may read (mode {stat.S_IMODE(mode):o}): "
                          f"chmod 600 {path}")
    return _check_key(public, path, "public key"), _check_key(secret, path, "secret key")


def _metadata(path, field: str) -> bytes | None:
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise FermoeError(f"{path}: cannot read a CURVE key: {e.strerror or e}") from None
    for line in lines:
        name, eq, value = line.strip().partition(b"=")
        if eq and name.strip() == field.encode():
            return value.strip(b' \t\'"')
    return None


class ClientKeys:
    """A worker's or a client's credentials: its pair and the server's public key, all
    from its one NAME.key_secret file."""

    def __init__(self, path):
        self.path = str(path)
        self.public, self.secret = load_pair(path)
        self.server = _check_key(_metadata(path, SERVER_KEY_FIELD), path,
                                 f"server public key ({SERVER_KEY_FIELD} in its metadata; `fermoe keys` writes it)")

    def apply(self, sock: zmq.Socket) -> None:
        """Set before connect: the handshake's keys are read then."""
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def client_keys(path) -> ClientKeys | None:
    return ClientKeys(path) if path else None


# ---- the coordinator's side --------------------------------------------------------
class KeyList:
    """The public keys of one folder, as a ZAP credentials provider: the peers it refuses
    are logged, each once a minute (a refused peer reconnects every 100 ms)."""

    def __init__(self, folder: Path, what: str):
        self.what = what
        files = sorted(folder.glob("*.key")) if folder.is_dir() else []
        self.keys = {load_public(f) for f in files}
        self._logged: dict[bytes, float] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        now = time.monotonic()
        if now - self._logged.get(key, -RELOG_S) >= RELOG_S:
            self._logged[key] = now
            log.warning("refused a %s with an unknown CURVE key %s (not in the keys directory's %s/)",
                        self.what, key.decode(), self.what + "s")
        return False


class ServerKeys:
    """The coordinator's --curve-keys DIR: its secret, the worker and client keys it
    accepts, the files its own workers and front end connect with."""

    def __init__(self, directory):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise FermoeError(f"--curve-keys {directory}: not a directory (make one with `fermoe keys {directory}`)")
        self.public, self.secret = load_pair(self.dir / f"{SERVER}.key_secret")
        self.workers = KeyList(self.dir / WORKERS, "worker")
        self.clients = KeyList(self.dir / CLIENTS, "client")
        if not self.workers.keys and not self.clients.keys:
            raise FermoeError(f"--curve-keys {directory}: no public keys in {WORKERS}/ or {CLIENTS}/: nobody could "
                              f"connect")
        self.own_worker = self.dir / WORKERS / f"{OWN_WORKER}.key_secret"
        self.own_client = self.dir / CLIENTS / f"{OWN_CLIENT}.key_secret"
        self.authenticator = None

    def start(self, ctx: zmq.Context) -> None:
        """The ZAP handler for `ctx` (one per context), before any socket binds: libzmq
        lets every key in while no handler answers."""
        from zmq.auth.thread import ThreadAuthenticator
        self.authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("fermoe.curve.zap"))
        self.authenticator.start()
        self.authenticator.configure_curve_callback(WORKERS, self.workers)
        self.authenticator.configure_curve_callback(CLIENTS, self.clients)

    def apply(self, sock: zmq.Socket, domain: str) -> None:
        """A server socket of `domain` (WORKERS or CLIENTS); set before bind."""
        assert self.authenticator is not None, "start() the ZAP handler first"
        sock.zap_domain = domain.encode()
        sock.curve_server = True
        sock.curve_secretkey = self.secret

    def stop(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


# Handshakes ZAP never sees (a peer without keys, or with another server's public key)
# fail inside libzmq; a socket monitor tells of them.
HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a peer without CURVE keys, or one made for another coordinator's keys",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "a handshake did not complete (the peer left during it, or a network fault)",
}


class HandshakeWatch:
    """A monitor of a server socket that logs its failed handshakes, once a minute."""

    def __init__(self, sock: zmq.Socket, what: str):
        self.what, self.sock = what, sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._logged = -RELOG_S

    def drain(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            if now - self._logged >= RELOG_S:
                self._logged = now
                log.warning("refused a connection to the %s socket: %s", self.what,
                            HANDSHAKE_FAILURES.get(event["event"], "its handshake failed"))

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)


# ---- where a bind may go without keys ------------------------------------------------
def is_loopback(endpoint: str) -> bool:
    """Whether only this host can reach a ZeroMQ endpoint: ipc://, inproc://, or tcp:// on
    127.0.0.0/8, ::1 or localhost. A wildcard, an interface name or a hostname is not."""
    import ipaddress
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")          # tcp://HOST:PORT, tcp://[V6]:PORT
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
