"""An outsider without the run's secret can neither read, write nor delete a `tcp://` store's keys,
through its public port or any other port the run's processes listen on (issue 35 item 4).

A real run of the store: the test process hosts it (its own process, store/guard.py), two forked
sites connect with the secret and form a real gloo group through it, and hold their connections.
Meanwhile every listening TCP socket of the whole process tree is found from /proc (net/tcp{,6}
inodes matched to /proc/<pid>/fd), and on each the outsider tries what a client without the secret
can: a keyless answer (what a store without a secret admits), store requests sent without any
answer, c10d's first message and ping (an inner c10d server would echo it), and a wrong secret.
None is served, and the keys are untouched; nothing listens but the store's one port and gloo's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

from tests.multiproc import fork_event, free_port, run_sites
from zeroband.store.client import _GUARDS, KeyStoreClient, StoreUnreachable, connect_tcp_store, host_tcp_store
from zeroband.store.guard import ADMITTED, CHALLENGE_BYTES, answer, encode
from zeroband.tools.launch import descendants

SECRET = b"outsider-test-shared-secret-0123456789"
C10D_PING = b"\x00\xce\xf7\x85\x3c" + bytes([13]) + b"nonc"  # c10d's validate, its magic, then PING + nonce


def _listening_ports(pids: set[int]) -> dict[int, set[int]]:
    """pid -> the TCP ports it listens on, from /proc alone."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":  # TCP_LISTEN
                inodes[cols[9]] = int(cols[1].rsplit(":", 1)[1], 16)
    out: dict[int, set[int]] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                out.setdefault(pid, set()).add(inodes[link[8:-1]])
    return out


def _talk(port: int, payload: bytes, answer_first: bool = False, wait_s: float = 1.0) -> bytes:
    """Connect to `port`, optionally answer its greeting with the empty key, send `payload`; all it said."""
    got = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
            if answer_first:
                greeting = s.recv(CHALLENGE_BYTES)
                s.sendall(answer(b"", greeting, port))
            s.sendall(payload)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
    except OSError:  # reset, refused, timed out: nothing served
        pass
    return got


def _site(port: int, done) -> dict:
    import torch
    import torch.distributed as dist

    from zeroband.store.client import open_store

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    store = open_store(f"tcp://127.0.0.1:{port}", False, timedelta(seconds=30), SECRET)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), site, 2, timedelta(seconds=30))
    x = torch.ones(2)
    pg.allreduce([x]).wait()
    store.set(f"site{site}", "here")
    done.wait(60)  # the test probes every port meanwhile
    return {"sum": x.tolist()}


def test_no_port_of_the_run_serves_the_store_without_the_secret():
    port = free_port()
    host = host_tcp_store("127.0.0.1", port, timedelta(seconds=30), SECRET)
    store_pid = _GUARDS[-1].pid
    done = fork_event()
    result: dict = {}
    sites = threading.Thread(target=lambda: result.update(run_sites(_site, 2, 1, (port, done), timeout=90)))
    sites.start()
    try:
        host.wait(["site0", "site1"], timedelta(seconds=60))
        host.set("secret-value", "only for the run")
        before = sorted(host.list_keys())
        tree = {os.getpid(), *descendants(os.getpid())}
        ports = _listening_ports(tree)
        assert ports.get(store_pid) == {port}, ports  # the store listens on its one port: no inner one
        assert not any("--forward" in Path(f"/proc/{p}/cmdline").read_text() for p in tree
                       if Path(f"/proc/{p}/cmdline").exists())
        every = set().union(*ports.values())
        assert len(every) >= 3, ports  # the store's port and both sites' gloo listeners were seen
        requests = (encode([b"list"]) + encode([b"get", b"0", b"secret-value"]) + encode([b"del", b"site0"])
                    + encode([b"set", b"outsider", b"was here"]))
        for p in sorted(every):
            keyless = _talk(p, requests, answer_first=True)
            assert ADMITTED not in keyless[CHALLENGE_BYTES:CHALLENGE_BYTES + 1], (p, keyless)
            assert b"only for the run" not in keyless and b"site0" not in keyless, (p, keyless)
            unanswered = _talk(p, requests)
            assert b"only for the run" not in unanswered and b"site0" not in unanswered, (p, unanswered)
            c10d = _talk(p, C10D_PING)
            assert b"nonc" not in c10d, (p, c10d)  # no c10d server answers its ping anywhere
            for secret in (None, b"a-wrong-secret-of-the-right-length-00"):
                try:
                    KeyStoreClient("127.0.0.1", p, timedelta(seconds=1), None if secret is None else b"k" * 32)
                    raise AssertionError(f"port {p} admitted a client with secret {secret!r}")
                except OSError:  # Refused, reset, timed out
                    pass
        try:
            connect_tcp_store("127.0.0.1", port, timedelta(seconds=2), "outsider", b"a-wrong-secret-of-32-bytes-0000")
            raise AssertionError("a wrong secret was admitted")
        except StoreUnreachable as e:
            assert "wrong shared secret" in str(e)
        assert sorted(host.list_keys()) == before and host.get("secret-value") == b"only for the run"
        assert not host.check(["outsider"])
    finally:
        done.set()
        sites.join(120)
    assert result[(0, 0)] == result[(1, 0)] == {"sum": [2.0, 2.0]}, result
