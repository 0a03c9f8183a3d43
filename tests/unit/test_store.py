"""Coordination stores: TCPStore and EtcdStore behave alike, and etcd survives losing a member.

The etcd tests run a real 3-member cluster on loopback ports (tests/etcd_cluster.py) and are
skipped, with the install command, when the `etcd` binary or the etcd3gw client is missing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.etcd_cluster import INSTALL_HINT, EtcdCluster, etcd_binary, start_cluster
from tests.multiproc import free_port
from zeroband.store.client import open_store


def _need_etcd() -> None:
    if etcd_binary() is None:
        pytest.skip(INSTALL_HINT)
    pytest.importorskip("etcd3gw", reason="etcd client missing: pip install etcd3gw")


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    _need_etcd()
    c = start_cluster(3)
    yield c
    c.stop()


def _make_store_body(request):
    """A factory of clients of one fresh store (a new tcp server, or a new etcd prefix)."""
    timeout = timedelta(seconds=10)
    if request.param.startswith("tcp"):
        address = f"tcp://127.0.0.1:{free_port()}"
        secret = b"s" * 32 if request.param == "tcp+secret" else None  # with one, every frame is tagged
        host = open_store(address, True, timeout, secret)
        yield lambda t=timeout: open_store(address, False, t, secret)
        del host
    else:
        address = request.getfixturevalue("cluster").url(f"test-{uuid.uuid4().hex[:8]}")
        yield lambda t=timeout: open_store(address, False, t)


@pytest.fixture(params=["tcp", "tcp+secret"])
def make_store(request):
    yield from _make_store_body(request)


def test_set_get_check_delete(make_store):
    store = make_store()
    blob = bytes(range(256))
    store.set("a", "1")
    store.set("blob", blob)
    assert store.get("a") == b"1" and store.get("blob") == blob
    store.set("a", b"2")  # overwrite
    assert store.get("a") == b"2"
    assert store.check(["a", "blob"]) and not store.check(["a", "nope"])
    store.set("empty", b"")
    assert store.get("empty") == b""
    assert store.num_keys() >= 3
    assert {"a", "blob", "empty"} <= set(store.list_keys())
    before = store.num_keys()
    assert store.delete_key("a") is True and store.delete_key("a") is False
    assert store.num_keys() == before - 1
    store.multi_set(["m1", "m2"], [b"x", b"y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]


def test_read_many_reads_current_values_at_once_and_never_waits(make_store):
    store, other = make_store(timedelta(seconds=5)), make_store()
    other.multi_set(["r1", "r3", "empty"], [b"one", bytes(range(256)), b""])
    t0 = time.monotonic()
    assert store.read_many(["r1", "r2", "r3", "empty", "r1"]) == [b"one", None, bytes(range(256)), b"", b"one"]
    assert store.read_many(["nothing", "here"]) == [None, None]  # missing keys: at once, no wait
    assert time.monotonic() - t0 < 2
    assert store.read_many([]) == []
    keys = [f"many/{i}" for i in range(500)]
    other.multi_set(keys[::2], [str(i).encode() for i in range(0, 500, 2)])
    assert store.read_many(keys) == [str(i).encode() if i % 2 == 0 else None for i in range(500)]


def test_add_and_compare_set(make_store):
    store = make_store()
    assert store.add("c", 0) == 0
    assert store.add("c", 5) == 5
    assert store.add("c", -2) == 3
    assert store.get("c") == b"3"
    # compare_set, with TCPStore's answers (missing key + non-empty expected: returns expected)
    assert store.compare_set("cs", "x", "y") == b"x" and not store.check(["cs"])
    assert store.compare_set("cs", "", "y") == b"y" and store.get("cs") == b"y"
    assert store.compare_set("cs", "z", "w") == b"y"
    assert store.compare_set("cs", "y", "w") == b"w" and store.get("cs") == b"w"


def test_add_is_atomic_across_clients(make_store):
    """Four clients race 25 increments each: no lost update, every returned value distinct."""
    clients = [make_store() for _ in range(4)]
    seen: list[int] = []

    def bump(store: dist.Store) -> None:
        seen.extend(store.add("n", 1) for _ in range(25))

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(seen) == list(range(1, 101))
    assert clients[0].get("n") == b"100"


def test_wait_and_blocking_get(make_store):
    store, writer = make_store(), make_store()
    threading.Timer(0.3, lambda: writer.set("late", b"here")).start()
    t0 = time.monotonic()
    assert store.get("late") == b"here"  # blocks until the other client writes
    assert 0.2 < time.monotonic() - t0 < 5
    store.wait(["late"])
    store.wait(["late"], timedelta(seconds=1))


def test_missing_key_times_out_clearly(make_store):
    store = make_store(timedelta(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing-key"):
        store.get("missing-key")
    assert 0.4 < time.monotonic() - t0 < 3
    with pytest.raises(dist.DistStoreError, match="other-key"):
        store.wait(["other-key"], timedelta(seconds=0.3))


def _hosted_guard(secret: bytes | None) -> tuple[dist.Store, int, subprocess.Popen]:
    from zeroband.store import client

    port = free_port()
    host = client.host_tcp_store("127.0.0.1", port, timedelta(seconds=30), secret)
    return host, port, client._GUARDS[-1]


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until the process's state (the field after the command in /proc/PID/stat) reads stopped."""
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout_s} s"
        time.sleep(0.01)


def test_who_may_use_the_store_is_told_by_its_greeting():
    """A store with a secret refuses a client without one, in one line; a client with a secret uses a
    store started without one (and warns); a listener that never greets is no store."""
    from zeroband.store.client import StoreUnreachable, connect_tcp_store

    keyed, keyed_port, keyed_guard = _hosted_guard(b"s" * 32)
    plain, plain_port, plain_guard = _hosted_guard(None)
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(StoreUnreachable, match="demands the run's shared secret and this site has none"):
            connect_tcp_store("127.0.0.1", keyed_port, timedelta(seconds=5), "keyed")
        with pytest.raises(StoreUnreachable, match="wrong shared secret"):
            connect_tcp_store("127.0.0.1", keyed_port, timedelta(seconds=5), "keyed", b"t" * 32)
        site = connect_tcp_store("127.0.0.1", plain_port, timedelta(seconds=5), "plain", b"s" * 32)
        site.set("k", "v")
        assert plain.get("k") == b"v"
        with pytest.raises(StoreUnreachable, match="did not answer as a zeroband store within 0.5 s"):
            connect_tcp_store("127.0.0.1", silent.getsockname()[1], timedelta(seconds=0.5), "silent")
    finally:
        silent.close()
        for guard in (keyed_guard, plain_guard):
            guard.kill()
            guard.wait()


def test_a_site_with_the_secret_waits_out_a_store_slow_to_challenge():
    """A store frozen for 4 s (CI, under load) while a site connects: the site waits for its
    challenge, within its timeout, and is served once it thaws."""
    host, port, guard = _hosted_guard(b"s" * 32)
    try:
        os.kill(guard.pid, signal.SIGSTOP)
        _wait_stopped(guard.pid)
        threading.Timer(4.0, os.kill, (guard.pid, signal.SIGCONT)).start()
        site = open_store(f"tcp://127.0.0.1:{port}", False, timedelta(seconds=15), b"s" * 32)
        site.set("from the site", "v")
        assert host.get("from the site") == b"v"
    finally:
        os.kill(guard.pid, signal.SIGCONT)
        guard.kill()
        guard.wait()


def test_a_hosted_stores_guard_ends_with_the_store():
    """A long-lived process (a test runner, a tool) that hosts and drops stores keeps no guards."""
    import gc

    host, port, guard = _hosted_guard(b"s" * 32)
    assert guard.poll() is None
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # the guard listens while the store lives
    del host
    gc.collect()
    assert guard.wait(timeout=10) is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_watch_wakes_on_events_and_compactions_never_on_its_creation():
    """EtcdStore.wait_change returns at the first message of the watch stream that reports a change
    (events) or that the start revision is gone (compacted: re-read anyway); not at "created"."""
    from zeroband.store.etcd import _woken

    assert not _woken(b'{"result":{"header":{"revision":"7"},"created":true}}')
    assert not _woken(b"  ")
    assert _woken(b'{"result":{"events":[{"type":"DELETE","kv":{"key":"YQ=="}}]}}')
    assert _woken(b'{"result":{"compact_revision":"5","canceled":true}}')


def test_an_etcd_answer_between_leaders_is_retried_not_a_refusal():
    """The password check runs through raft: during a leader change etcd answers it "etcdserver:
    leader changed", which a site of the secure chaos test read as its credentials refused and
    stopped. Transient answers are retried on the next member; a wrong password stays a refusal."""
    from zeroband.store.etcd import transient

    assert transient(503, "etcdserver: leader changed") and transient(400, "etcdserver: leader changed")
    assert transient(500, "anything") and transient(503, "etcdserver: no leader")
    assert transient(400, "etcdserver: request timed out, possibly due to previous leader failure")
    assert not transient(400, "etcdserver: authentication failed, invalid user ID or password")
    assert not transient(403, "etcdserver: permission denied")
