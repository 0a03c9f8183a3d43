"""Open the coordination store that cross-site process groups are formed through, by address.

- `tcp://host:port`: a c10d TCPStore whose server runs inside one process (`is_host`). Cheap and
  dependency-free, but a single point of failure: when the host site dies no group can be formed.
- `etcd://h1:p1,h2:p2,h3:p3[/prefix]`: an EtcdStore on an etcd cluster (a member per site, 3+);
  it keeps working while a majority of members is up, so surviving sites can still regroup. With
  the run's secret it must be reached with etcd's own access control (`EtcdAccess`: TLS, a client
  certificate, a user whose role covers the prefix): the membership then trusts that nobody without
  those credentials deletes a key, and keeps none of the tcp:// store's deletion defences.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from zeroband.config import SitesConfig
from zeroband.store.etcd import EtcdAccess, EtcdStore, StoreUnavailable, parse_endpoints
from zeroband.store.guard import RETRY_S, Refused, authenticated, challenges
from zeroband.trust.secret import SECRET_ENV, RunSecret, as_secret, resolve_secret

log = logging.getLogger(__name__)

DEFAULT_ETCD_PREFIX = "zeroband"
_GUARDS: list[subprocess.Popen] = []  # the guards of this process's live hosted stores, newest last


class StoreUnreachable(ConnectionError):
    """The store address does not answer as a store within the timeout."""


# What a store call raises once the store is gone: c10d's socket errors (a TCPStore whose server
# died) and EtcdStore's after its failover budget (a majority of members down). A key that does not
# appear in time (DistStoreError) is not here: that is a peer's silence, which the watchdog names.
STORE_GONE = (dist.DistNetworkError, StoreUnavailable)


def store_gone_message(address: str, error: BaseException) -> str:
    """One line: which store stopped answering, and what to do."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    fix = ("bring a majority of its etcd members back" if address.startswith("etcd://") else
           "restart it (zeroband launch's store process, or site 0 with sites.host_store = true)")
    return (f"the coordination store {address} stopped answering ({first}); no round can be formed without it. "
            f"Fix: {fix}, then relaunch the sites: they resume from their last checkpoints")


@contextmanager
def store_failures_named(address: str) -> Iterator[None]:
    """Turns a store that went away mid-run into one StoreUnreachable naming it (train.main prints
    that as one line) instead of a C++ traceback from deep inside a store call."""
    try:
        yield
    except STORE_GONE as e:
        raise StoreUnreachable(store_gone_message(address, e)) from None


def open_store(address: str, is_host: bool, timeout: timedelta, secret: RunSecret | bytes | None = None,
               access: EtcdAccess | None = None) -> dist.Store:
    """The store at `address`. `is_host` only matters for tcp:// (that process runs the server).
    `secret`: the run's shared secret (default: $ZEROBAND_SECRET); with one, a tcp:// store's port
    admits only connections that prove it (store/guard.py), and clients reach it through a
    local forwarder that does, so callers see a plain c10d TCPStore either way. `access`: etcd's
    credentials (remembered per address: a later open without them, the heartbeat's, uses them)."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise ValueError(f"store address {address!r} needs a scheme: tcp://host:port or etcd://h1:p1,h2:p2/prefix")
    if scheme == "tcp":
        return _tcp_store(address, is_host, timeout, secret)
    if scheme == "etcd":
        hosts, _, prefix = rest.partition("/")
        access = _ACCESS.setdefault(address, access) if access is not None else _ACCESS.get(address)
        if access is None and secret is not None:
            raise StoreUnreachable(f"store {address}: a run with a shared secret reaches etcd only with etcd's own access "
                                   "control (anyone else could delete its keys); set sites.etcd_ca_file, "
                                   "etcd_cert_file/etcd_key_file and etcd_user/etcd_password_file (README, multi-site "
                                   "runs on etcd), or sites.insecure = true on a trusted network")
        return EtcdStore(parse_endpoints(hosts), prefix.strip("/") or DEFAULT_ETCD_PREFIX, timeout, access=access)
    raise ValueError(f"store address {address!r}: unknown scheme {scheme!r} (use tcp:// or etcd://)")


def etcd_access(sites: SitesConfig) -> EtcdAccess | None:
    """The etcd credentials `sites` names (checked by the config), or None without any."""
    if sites.etcd_ca_file is None:
        return None
    return EtcdAccess(sites.etcd_ca_file, sites.etcd_cert_file, sites.etcd_key_file, sites.etcd_user,
                      sites.etcd_password)


def guards_keys(store: dist.Store) -> bool:
    """Whether the store itself keeps everyone without the run's credentials from writing or deleting
    its keys: etcd (with its access control; `open_store` refuses it without, unless the run is
    insecure and nothing is authenticated anyway). Then the membership keeps none of its deletion
    defences (write-backs, storm rules) and uses the store's leases and watches."""
    return isinstance(store, EtcdStore)


def _tcp_store(address: str, is_host: bool, timeout: timedelta, secret: RunSecret | bytes | None) -> dist.TCPStore:
    url = urlparse(address)
    if url.hostname is None or url.port is None:
        raise ValueError(f"store address {address!r} must look like tcp://host:port")
    # A later open of the same store without a secret (the elastic heartbeat's own connection) uses
    # the one this process opened it with: a secret from the config or a file is in no environment.
    if secret is not None:
        _SECRETS[(url.hostname, url.port)] = as_secret(secret)
    known = _SECRETS.get((url.hostname, url.port))
    if is_host:
        return host_tcp_store(url.hostname, url.port, timeout, known)
    return connect_tcp_store(url.hostname, url.port, timeout, address, known)


_SECRETS: dict[tuple[str, int], RunSecret] = {}
_ACCESS: dict[str, EtcdAccess] = {}  # etcd address -> the credentials this process first opened it with


def guard_key(secret: RunSecret) -> bytes:
    """The key guard and forwarders prove the secret with: its own scrypt-derived key (an on-path
    observer's challenge/answer pairs make each guess at the secret cost a scrypt), used for nothing else."""
    return secret.derive("zeroband/store-guard")


def _run_secret(secret: RunSecret | bytes | None) -> RunSecret | None:
    """The caller's secret (tests and tools may hand raw bytes), else $ZEROBAND_SECRET's."""
    return as_secret(secret) if secret is not None else resolve_secret(None)


def host_tcp_store(host: str, port: int, timeout: timedelta, secret: RunSecret | bytes | None = None) -> dist.TCPStore:
    """A TCPStore server on an ephemeral loopback port, reached through a StoreGuard on host:port
    (store/guard.py: with a secret only authenticated connections reach the server; without,
    idle and stalled ones cannot lock it up). Returns the server's client. The guard ends with that
    object, or with this process (PR_SET_PDEATHSIG: call this from a thread that lives as long)."""
    secret = _run_secret(secret)
    # BoundTCPStore: c10d's own server would listen on every interface, bypassing the guard.
    server = BoundTCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False, use_libuv=True)
    args = ["--host", host, "--port", str(port), "--backend-port", str(server.port)]
    guard, lines = _helper([*args, *(["--auth"] if secret else [])], guard_key(secret) if secret else None,
                           "guard listening")
    if guard is None:
        raise StoreUnreachable(f"cannot host the store on {host}:{port}: {lines[-1] if lines else 'guard exited'}")
    _GUARDS.append(guard)
    # the guard fronts this server only: when the server goes (garbage, or a test that hosted it
    # ends), so does the guard, rather than living on as long as a long-lived host process
    weakref.finalize(server, _stop_guard, guard)
    return server


def _stop_guard(guard: subprocess.Popen) -> None:
    if guard.poll() is None:
        guard.kill()
        guard.wait()
    if guard in _GUARDS:
        _GUARDS.remove(guard)


def _helper(args: list[str], key: bytes | None, ready: str) -> tuple[subprocess.Popen | None, list[str]]:
    """Start guard.py (the key on stdin: never argv); the process once it prints `ready`, else None
    and what it printed (port taken, bad address)."""
    # run as a file, not `-m`: the package would import torch (seconds) where stdlib suffices
    cmd = [sys.executable, str(Path(__file__).with_name("guard.py")), *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdin is not None and proc.stdout is not None  # PIPEs
    if key is not None:
        proc.stdin.write(key.hex() + "\n")
    proc.stdin.close()
    lines = []
    for line in proc.stdout:  # until it listens, or dies (port taken, bad address)
        lines.append(line.strip())
        if line.startswith(ready):
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()  # its later lines: never block it
            return proc, lines
    proc.wait()
    return None, lines


def _drain(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        log.debug("%s", line.rstrip())


def connect_tcp_store(host: str, port: int, timeout: timedelta, address: str,
                      secret: RunSecret | bytes | None = None) -> dist.TCPStore:
    """A client, within `timeout` or StoreUnreachable. The deadline is ours: c10d's own connect waits
    forever on a listener that accepts and never answers (and past its timeout on a flooded store).
    With a secret the client connects to this process's forwarder to host:port (`_forwarder`)."""
    secret = _run_secret(secret)
    local = _forwarder(host, port, secret, timeout, address) if secret is not None else None
    if local is not None:
        host, port = "127.0.0.1", local
    box: dict[str, Any] = {}
    if secret is None:  # does a guard challenge us? asked now: it may be gone by the time c10d gives up
        threading.Thread(target=_ask_for_a_challenge, args=((host, port), box), daemon=True).start()

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, is_master=False, timeout=timeout, use_libuv=True)
        except Exception as e:  # reported below with the address
            box["error"] = e

    thread = threading.Thread(target=connect, name="zeroband-store-connect", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + 1.0)
    fix = "check sites.store (zeroband launch's store, or site 0 with sites.host_store = true)"
    if box.get("asks") and ("error" in box or thread.is_alive()):
        raise StoreUnreachable(f"store {address}: the store demands the run's shared secret and this site has none. "
                               f"Fix: export {SECRET_ENV} (the same on every site and the store)")
    if thread.is_alive():
        raise StoreUnreachable(f"store {address}: a listener accepted the connection but did not answer as a "
                               f"c10d store within {timeout.total_seconds():g} s (sites.timeout_s); {fix}")
    if "error" in box:
        first = str(box["error"]).strip().splitlines()[0] if str(box["error"]).strip() else type(box["error"]).__name__
        raise StoreUnreachable(f"store {address}: no store answered within {timeout.total_seconds():g} s "
                               f"({first}); {fix}") from None
    return box["store"]


def _ask_for_a_challenge(remote: tuple[str, int], box: dict[str, Any]) -> None:
    """box["asks"]: whether the store at `remote` challenges (demands the secret); retried while it
    is not up yet, until the connection attempt in `box` has ended."""
    while "store" not in box and "error" not in box:
        asks = challenges(remote)
        if asks is not None:
            box["asks"] = asks
            return
        time.sleep(0.2)


# (pid, host, port, key) -> (forwarder process, its loopback port); pid: a forked child starts its own
_FORWARDERS: dict[tuple[int, str, int, bytes], tuple[subprocess.Popen, int]] = {}
_FORWARDERS_LOCK = threading.Lock()


def _forwarder(host: str, port: int, secret: RunSecret, timeout: timedelta, address: str) -> int | None:
    """The loopback port of this process's forwarder to the guard at host:port, started on first
    use; None for a store that demands no secret (started without one: its clients connect plainly).
    First one handshake from here, so a refusal is one line naming its cause rather than the c10d
    client's retries on a closed connection."""
    if address in _UNGUARDED:  # checked once per process: a later open (the heartbeat's) need not wait again
        return None
    key = guard_key(secret)
    if not check_guard(host, port, key, timeout.total_seconds(), address):
        _UNGUARDED.add(address)
        log.warning("store %s asks for no secret (started without %s): its port is only flood-bounded, "
                    "not authenticated; store values stay signed", address, SECRET_ENV)
        return None
    with _FORWARDERS_LOCK:
        ident = (os.getpid(), host, port, key)
        known = _FORWARDERS.get(ident)
        if known is not None and known[0].poll() is None:
            return known[1]
        proc, lines = _helper(["--forward", "--host", host, "--port", str(port)], key, "forwarder listening")
        if proc is None:
            raise StoreUnreachable(f"store {address}: cannot start its local forwarder: {lines[-1] if lines else 'exited'}")
        _FORWARDERS[ident] = (proc, int(lines[-1].rsplit(":", 1)[1]))
        return _FORWARDERS[ident][1]


_UNGUARDED: set[str] = set()  # stores already reported as asking for no secret


def check_guard(host: str, port: int, key: bytes, timeout_s: float, address: str) -> bool:
    """Whether the store at host:port demands the secret, from what it answers (guard.challenges),
    never from its silence: False for a store started without one; True once one authenticated
    connection got through (retried while a flood drops it); else StoreUnreachable naming why the
    guard refused, or that nothing answered as a store within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    asks = challenges((host, port), timeout_s)
    while asks is None and time.monotonic() + RETRY_S < deadline:  # not up yet, or a dropped connection
        time.sleep(RETRY_S)
        asks = challenges((host, port), deadline - time.monotonic())
    if asks is None:
        raise StoreUnreachable(f"store {address}: nothing answered as a c10d store within {timeout_s:g} s; check "
                               "sites.store (zeroband launch's store, or site 0 with sites.host_store = true)")
    if not asks:
        return False
    try:  # at least a second: the probe may have used most of the time on a loaded machine
        authenticated((host, port), key, max(1.0, deadline - time.monotonic())).close()
        return True
    except Refused as e:
        if not e.final:
            raise StoreUnreachable(f"store {address}: {e} (for {timeout_s:g} s)") from None
        raise StoreUnreachable(f"store {address}: {e}. Fix: the same {SECRET_ENV} on every site and on the "
                               "store, or sites.insecure = true on all of them") from None
    except OSError as e:
        raise StoreUnreachable(f"store {address}: the guard stopped answering ({e}); check sites.store "
                               "(zeroband launch's store, or site 0 with sites.host_store = true)") from None


def listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A TCP socket listening on `host` only (port 0: any free port)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class BoundTCPStore(dist.TCPStore):
    """A TCPStore whose server listens only on `host_name`.

    c10d's own server ignores `host_name` and listens on every interface, so anyone who can reach
    the machine could write the store. We bind the socket ourselves and hand it over
    (`master_listen_fd`); clients are unchanged. Same signature as dist.TCPStore, so it can stand
    in for it inside torchrun too (zeroband/torchrun.py).
    """

    def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = True,
                 multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True) -> None:
        if is_master and master_listen_fd is None:
            try:
                sock = listen_socket(host_name, port)
            except OSError as e:  # RuntimeError is what callers (torchrun's rendezvous) expect
                raise RuntimeError(f"cannot listen on {host_name}:{port}: {e}") from e
            port = sock.getsockname()[1]
            master_listen_fd = sock.detach()  # the store's server owns the descriptor from now on
        super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                         master_listen_fd, use_libuv)
