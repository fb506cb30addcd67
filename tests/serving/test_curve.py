"""The coordinator with CURVE keys required (--curve-keys): on loopback, and for real
between two network namespaces joined by a veth pair (a worker and a client on the
other side, as on another host). The right keys are served; no keys, another
directory's keys, or a client's key on the worker socket get nothing, and the daemon
serves on. Without keys, a bind off loopback is refused unless --insecure. (Loopback
without keys is what every other serving test runs.)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from coordinator.client import Client
from coordinator.options import parse_options
from shared.curve import write_keys
from shared.errors import FermoeError
from tests.support.serving_harness import Daemon, free_port, unpinned, wait_until

ROOT = Path(__file__).resolve().parents[2]
REFUSED_S = 2.0          # a refused client or worker hears nothing: this long is long enough to tell


@pytest.fixture
def keys(tmp_path):
    """keys/: the coordinator's directory (with a worker pair "host2" beside the default
    ones); other/: a directory of another coordinator (the wrong keys)."""
    write_keys(tmp_path / "keys")
    write_keys(tmp_path / "keys", workers=["host2"], clients=[])
    write_keys(tmp_path / "other")
    return tmp_path


def worker_cmd(endpoint, model, wid, key=None) -> list[str]:
    return [sys.executable, "-m", "cpu_worker.worker", "--connect", endpoint, "--model", str(model), "--threads",
            "1", "--worker-id", wid, "--no-shared-memory", *(["--curve-key", str(key)] if key else [])]


def answered(addr, key=None) -> bool:
    """Whether a client with `key` (None: none) gets a status reply."""
    with Client(addr, curve_key=key) as c:
        try:
            c.status(timeout_s=REFUSED_S)
            return True
        except FermoeError as e:
            assert "no answer" in str(e)
            return False


def test_keys_on_loopback_admit_only_the_listed_clients_and_workers(tiny_q4_path, keys):
    k, other = keys / "keys", keys / "other"
    client_key = k / "clients" / "client.key_secret"
    http = f"127.0.0.1:{free_port()}"
    # its own workers and its HTTP front end connect with the keys it hands them
    daemon = Daemon(tiny_q4_path, "--curve-keys", k, "--http", http, curve_key=client_key)
    extra = []
    try:
        assert any("CURVE security on: 1 client keys, 2 worker keys" in line for line in daemon.log)
        models = wait_until(lambda: http_get(f"http://{http}/v1/models"), 60, "the HTTP front end answering")
        assert models["data"][0]["id"]                                  # it had the coordinator's status
        text, done = run_with_key(daemon.addr, client_key, "Hello", max_tokens=4, temperature=0.0)
        assert done.finish_reason == "length" and done.completion_tokens == 4
        assert not answered(daemon.addr)                                            # no key
        assert not answered(daemon.addr, other / "clients" / "client.key_secret")   # another coordinator's
        assert not answered(daemon.addr, k / "workers" / "worker.key_secret")       # a worker's, as a client
        assert answered(daemon.addr, client_key)                                    # serving on
        endpoint = daemon.worker_endpoint
        extra = [subprocess.Popen(worker_cmd(endpoint, tiny_q4_path, wid, key), preexec_fn=unpinned,
                                  stderr=subprocess.DEVNULL)
                 for wid, key in [("by-hand", k / "workers" / "host2.key_secret"), ("no-key", None),
                                  ("wrong-key", other / "workers" / "worker.key_secret"),
                                  ("client-key", client_key)]]
        with Client(daemon.addr, curve_key=client_key) as c:
            wait_until(lambda: any(w.worker_id == "by-hand" and w.alive for w in c.status().workers), 60,
                       "the worker with a listed key never joined")
            time.sleep(REFUSED_S)      # the others started with it, and a Hello takes milliseconds
            assert sorted(w.worker_id for w in c.status().workers) == ["by-hand", "cpu0.0"]
        log = "".join(daemon.log)
        assert "refused a client with an unknown CURVE key" in log
        assert "refused a worker with an unknown CURVE key" in log
        assert "refused a connection to the worker socket" in log
        assert all(p.poll() is None for p in extra)            # refused, not crashed: they keep trying
    finally:
        for p in extra:
            p.kill()
            p.wait()
        assert daemon.stop() == 0


def http_get(url):
    """The JSON of a GET, None while the front end is not up or not answered upstream."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError):
        return None


def run_with_key(addr, key, prompt, **params):
    with Client(addr, timeout_s=120, curve_key=key) as c:
        msgs = list(c.generate(prompt, **params))
    return "".join(m.text for m in msgs[:-1]), msgs[-1]


def test_a_bind_off_loopback_without_keys_is_refused_at_start(tiny_q4_path, keys):
    for flags in (["--bind", "tcp://0.0.0.0:5557"], ["--worker-bind", "tcp://*:5558"],
                  ["--worker-bind", "tcp://10.213.7.1:5558"]):
        with pytest.raises(FermoeError, match=f"{flags[0]} .*not a loopback address.*--curve-keys DIR.*--insecure"):
            parse_options(["--model", str(tiny_q4_path), *flags])
        opts = parse_options(["--model", str(tiny_q4_path), *flags, "--insecure"])      # what it allows
        assert opts.insecure and opts.server_keys is None
    opts = parse_options(["--model", str(tiny_q4_path), "--bind", "tcp://0.0.0.0:5557", "--curve-keys",
                          str(keys / "keys")])
    assert opts.server_keys is not None
    with pytest.raises(FermoeError, match="--insecure with --curve-keys"):
        parse_options(["--model", str(tiny_q4_path), "--curve-keys", str(keys / "keys"), "--insecure"])
    # as a user meets it: one line, status 1, nothing bound
    r = subprocess.run([sys.executable, "-m", "coordinator.daemon", "--model", str(tiny_q4_path), "--worker-bind",
                        "tcp://0.0.0.0:*"], capture_output=True, text=True, timeout=120, preexec_fn=unpinned)
    assert r.returncode == 1 and "coordinator: error: --worker-bind tcp://0.0.0.0:*: not a loopback" in r.stderr
    (keys / "keys" / "server.key_secret").write_text("garbage\n")
    r = subprocess.run([sys.executable, "-m", "coordinator.daemon", "--model", str(tiny_q4_path), "--curve-keys",
                        str(keys / "keys")], capture_output=True, text=True, timeout=120, preexec_fn=unpinned)
    assert r.returncode == 1 and f"coordinator: error: {keys / 'keys' / 'server.key_secret'}" in r.stderr


# ---- for real, between two network namespaces ------------------------------------------
COORD_IP, PEER_IP = "10.213.7.1", "10.213.7.2"      # a private /30 that lives only in our two namespaces


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns():
    """Two network namespaces of this test's own (names with our pid), a veth pair made
    straight into them (the host's own network is never touched), COORD_IP on one end,
    PEER_IP on the other; deleted whatever happens. A skip names why they cannot be made."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` binary (apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    pid = os.getpid()
    coord, peer = f"fermoe-coord-{pid}", f"fermoe-peer-{pid}"
    made = []
    try:
        for ns in (coord, peer):
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"ip netns add: {r.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", f"fmc{pid}", "netns", coord, "type", "veth", "peer", "name", f"fmp{pid}",
                  "netns", peer)]
        for ns, dev, ip in ((coord, f"fmc{pid}", COORD_IP), (peer, f"fmp{pid}", PEER_IP)):
            steps += [("-n", ns, "addr", "add", f"{ip}/30", "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"ip {' '.join(step)}: {r.stderr.strip()}")
        yield coord, peer
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def in_ns(ns, *cmd, **kwargs) -> subprocess.Popen:
    """`cmd` run inside namespace `ns`, on this checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(["ip", "netns", "exec", ns, *map(str, cmd)], cwd=ROOT, env=env, preexec_fn=unpinned,
                            **kwargs)


@contextmanager
def coordinator_in(ns, model, *extra):
    """A coordinator inside `ns` bound to COORD_IP; yields (client endpoint, worker
    endpoint, its log lines so far) once its own worker is ready."""
    addr, workers = f"tcp://{COORD_IP}:{free_port()}", f"tcp://{COORD_IP}:{free_port()}"
    proc = in_ns(ns, sys.executable, "-m", "coordinator.daemon", "--model", model, "--bind", addr, "--worker-bind",
                 workers, "--snapshot-mem", "32MiB", "--threads-per-worker", "1", *extra, stderr=subprocess.PIPE,
                 text=True)
    log: list[str] = []
    import threading
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    try:
        wait_until(lambda: proc.poll() is not None or any("ready:" in line for line in log), 120,
                   "the coordinator in its namespace became ready")
        assert proc.poll() is None, "".join(log)
        yield addr, workers, log
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, "".join(log)


# Run in the peer namespace: what the coordinator's clients there get.
PEER_CLIENT = textwrap.dedent("""
    import json, sys, time
    from coordinator.client import Client
    from shared import protocol as P
    from shared.errors import FermoeError
    addr, key, wrong, expect, refused_s = sys.argv[1], sys.argv[2] or None, sys.argv[3], sys.argv[4], float(sys.argv[5])

    def answered(k):
        with Client(addr, curve_key=k) as c:
            try:
                c.status(timeout_s=refused_s)
                return True
            except FermoeError:
                return False

    out = {"no_key": answered(None), "wrong_key": answered(wrong)}
    print("answered:", out, file=sys.stderr, flush=True)
    with Client(addr, timeout_s=120, curve_key=key) as c:
        deadline = time.monotonic() + 60
        while not any(w.worker_id == expect and w.alive for w in c.status().workers):
            assert time.monotonic() < deadline, "the remote worker never joined"
            time.sleep(0.2)
        time.sleep(refused_s)
        out["workers"] = sorted(w.worker_id for w in c.status().workers)
        print("workers:", out["workers"], file=sys.stderr, flush=True)
        rid = c.submit("Hello", max_tokens=16, temperature=0.0, ignore_eos=True)
        msgs = c.stream(rid)
        next(msgs)
        out["running"] = [w.worker_id for w in c.status().workers if w.running]
        out["done"] = [m for m in msgs][-1].finish_reason
    print(json.dumps(out))
""")


def peer_client(peer, addr, key, wrong, expect) -> dict:
    proc = in_ns(peer, sys.executable, "-c", PEER_CLIENT, addr, key or "", wrong, expect, REFUSED_S,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the client in the peer namespace did not finish within 180 s: {out} {err}") from None
    assert proc.returncode == 0, err
    return json.loads(out)


def test_workers_and_clients_in_another_namespace_need_the_listed_keys(tiny_q4_path, keys, netns):
    coord, peer = netns
    k, other = keys / "keys", keys / "other"
    workers = []
    with coordinator_in(coord, tiny_q4_path, "--curve-keys", k) as (addr, endpoint, log):
        try:
            workers = [in_ns(peer, *worker_cmd(endpoint, tiny_q4_path, wid, key), stderr=subprocess.DEVNULL)
                       for wid, key in [("a-remote", k / "workers" / "host2.key_secret"), ("no-key", None),
                                        ("wrong-key", other / "workers" / "worker.key_secret"),
                                        ("client-key", k / "clients" / "client.key_secret")]]
            seen = peer_client(peer, addr, k / "clients" / "client.key_secret",
                               other / "clients" / "client.key_secret", "a-remote")
        finally:
            for p in workers:
                p.kill()
                p.wait()
    assert seen["workers"] == ["a-remote", "cpu0.0"]          # the keyless and the wrong-keyed never joined
    assert "refused a worker with an unknown CURVE key" in "".join(log)    # the client's key, as a worker
    assert seen["running"] == ["a-remote"] and seen["done"] == "length"    # it served, across the veth
    assert not seen["no_key"] and not seen["wrong_key"]
    text = "".join(log)
    assert "refused a connection to the worker socket" in text and "refused a connection to the client socket" in text


def test_insecure_lets_anyone_in_and_says_so(tiny_q4_path, keys, netns):
    coord, peer = netns
    with coordinator_in(coord, tiny_q4_path, "--insecure") as (addr, endpoint, log):
        seen = peer_client(peer, addr, None, keys / "other" / "clients" / "client.key_secret", "cpu0.0")
    assert seen["no_key"] and seen["done"] == "length"
    assert not seen["wrong_key"]        # CURVE keys against a server without them: no handshake either
    assert any("--insecure: no CURVE keys" in line and "anyone who reaches these ports" in line for line in log)
