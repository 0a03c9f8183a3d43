"""Floods of the coordination store's port (issue 23 item 5, the store's half).

The attacker is a real process of its own (tests/flood_store.py) against a real guarded TCPStore:
20,000 connections that send 8 bytes (in waves: this machine's RLIMIT_NOFILE hard limit is 20,000,
so they cannot all be open at once) and 600 that send 1 byte and stall. On f6cb7f4/f96e652 the
guard forwarded any connection that had sent a byte, so the 600 stalled ones filled its 512 slots
and the store: real clients were refused. Now, with the run's secret, no request is read before the
connection answers the store's challenge; without one, before it sends a whole (keyless) answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.helpers import _train, diloco_tree, final_params
from tests.multiproc import free_port, run_sites
from tests.unit import test_attacks_flood_store as unit_tier  # what both tiers share is defined there, once

pytestmark = unit_tier.pytestmark

SECRET = "store-flood-tests-shared-secret-0123"

FLOODER = Path(__file__).parents[1] / "flood_store.py"  # tests/flood_store.py

FD_BOUND = 1024 + 256 + 64  # the store's max_pending + max_clients + its own few


def _flood(port: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(FLOODER), "127.0.0.1", str(port), *args], stdout=subprocess.PIPE,
                            text=True)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class _Client:
    """A real client doing set/get round trips in a thread; records the slowest one."""

    def __init__(self, connect, server) -> None:
        self.connect, self.server, self.slowest, self.rounds, self.error = connect, server, 0.0, 0, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            store = self.connect()
            while not self.stop.is_set():
                t0 = time.monotonic()
                store.set(f"k{self.rounds}", str(self.rounds))
                assert store.get(f"k{self.rounds}") == str(self.rounds).encode()
                self.slowest = max(self.slowest, time.monotonic() - t0)
                self.rounds += 1
                time.sleep(0.02)
        except Exception as e:  # reported by the test
            self.error = e

    def __enter__(self) -> _Client:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def _connect_time(connect, server, key: str) -> float:
    t0 = time.monotonic()
    store = connect()
    store.set(key, "v")
    assert server.get(key) == b"v"
    return time.monotonic() - t0


def test_flood_of_the_guarded_store_port_with_a_secret(monkeypatch):
    """Against the store with the run's secret: during and after the flood a real client keeps
    setting/getting, a fresh one connects within seconds, the guard process lives
    with a bounded fd count; a client with another secret is refused, in one line naming why."""
    from zeroband.store.client import _GUARDS, StoreUnreachable, connect_tcp_store, host_tcp_store

    port, secret = free_port(), SECRET.encode()
    server = host_tcp_store("127.0.0.1", port, timedelta(seconds=30), secret)
    guard = _GUARDS[-1]
    address = f"tcp://127.0.0.1:{port}"
    connect = lambda: connect_tcp_store("127.0.0.1", port, timedelta(seconds=10), address, secret)  # noqa: E731
    flood = _flood(port, "--conns", "20000", "--wave", "5000", "--stall", "600")
    peak_fds, fresh = 0, []
    with _Client(connect, server) as client:
        while flood.poll() is None:
            fresh.append(_connect_time(connect, server, f"during{len(fresh)}"))
            peak_fds = max(peak_fds, _fds(guard.pid))
            time.sleep(0.2)
        stats = json.loads(flood.stdout.read())
        fresh_after = _connect_time(connect, server, "after")
    assert client.error is None, client.error
    assert stats["opened"] >= 20000 and stats["stalled"] >= 600, stats
    assert client.rounds >= 5 and client.slowest < 3.0, (client.rounds, client.slowest)
    assert fresh and max(fresh) < 5.0 and fresh_after < 3.0, (fresh, fresh_after)
    assert guard.poll() is None and peak_fds < FD_BOUND, peak_fds
    print(f"flood {stats}; client: {client.rounds} round trips, slowest {client.slowest:.3f} s; fresh connects "
          f"{len(fresh)}, slowest {max(fresh):.3f} s, after {fresh_after:.3f} s; guard fds peak {peak_fds}")
    with pytest.raises(StoreUnreachable) as refused:
        connect_tcp_store("127.0.0.1", port, timedelta(seconds=5), address, b"another-secret-of-32-bytes-0123456")
    assert "wrong shared secret" in str(refused.value) and "\n" not in str(refused.value)
    monkeypatch.delenv("ZEROBAND_SECRET", raising=False)
    with pytest.raises(StoreUnreachable, match="demands the run's shared secret and this site has none"):
        connect_tcp_store("127.0.0.1", port, timedelta(seconds=2), address)


def test_stalled_one_byte_connections_do_not_lock_out_an_insecure_store(monkeypatch):
    """Without a secret (sites.insecure) 600 connections that send 1 byte and stall were forwarded
    and filled the guard's 512 slots: a real client was refused. Now a connection is served only
    once it has sent a whole (keyless) answer, so they stay pending and are dropped."""
    from zeroband.store.client import connect_tcp_store, host_tcp_store

    monkeypatch.delenv("ZEROBAND_SECRET", raising=False)
    port = free_port()
    server = host_tcp_store("127.0.0.1", port, timedelta(seconds=30))
    address = f"tcp://127.0.0.1:{port}"
    flood = _flood(port, "--conns", "0", "--stall", "600", "--forever")
    try:
        time.sleep(1.5)  # all 600 open and stalled
        took = _connect_time(lambda: connect_tcp_store("127.0.0.1", port, timedelta(seconds=5), address),
                             server, "insecure")
    finally:
        flood.terminate()
        stats = json.loads(flood.communicate(timeout=20)[0])
    assert stats["stalled"] >= 600, stats
    assert took < 3.0, took


def _site(tree: dict) -> dict:
    res = _train(tree)
    return {"steps": res["steps"], "trained": len(res["losses"])}


def test_two_site_run_finishes_under_a_store_flood(corpus, tmp_path):
    """A fixed 2-site run (site 0 hosts the guarded store) with the flood on the store port from
    before the store opens until the run ends: the right step count and identical replicas."""
    tree = diloco_tree(corpus, tmp_path, train={"steps": 4, "global_batch": 2, "micro_batch": 2},
                       checkpoint={"interval": 4, "keep_last": 1})
    tree["sites"].update(insecure=False, timeout_s=30)
    port = int(tree["sites"]["store"].rsplit(":", 1)[1])
    flood = _flood(port, "--wave", "2000", "--stall", "600", "--forever")
    try:
        out = run_sites(_site, 2, 1, (tree,), env={"ZEROBAND_SECRET": SECRET}, timeout=90)
    finally:
        flood.terminate()
        stats = json.loads(flood.communicate(timeout=20)[0])
    assert stats["opened"] >= 2000 and stats["stalled"] >= 600, stats
    print(f"flood during the run {stats}")
    for s in (0, 1):
        assert out[(s, 0)] == {"steps": 4, "trained": 4}, out
    a, b = final_params(tree, 0, 4, SECRET), final_params(tree, 1, 4, SECRET)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_later_open_without_the_secret_uses_the_one_this_process_opened_the_store_with(monkeypatch):
    """The elastic heartbeat opens its own client with no secret argument; a secret from the config
    or a file is in no environment, so the store remembers the one it was opened with."""
    from zeroband.store.client import open_store

    monkeypatch.delenv("ZEROBAND_SECRET", raising=False)
    address = f"tcp://127.0.0.1:{free_port()}"
    host = open_store(address, True, timedelta(seconds=10), SECRET.encode())
    client = open_store(address, False, timedelta(seconds=5))
    client.set("beat", "1")
    assert host.get("beat") == b"1"
