"""Open the coordination store that cross-site process groups are formed through, by address.

- `tcp://host:port`: the store process one site (or `zeroband launch`) hosts (`is_host`;
  store/guard.py), reached with `KeyStoreClient`. Cheap and dependency-free, but a single point of
  failure: when the host dies no group can be formed. With the run's secret nobody without it reads,
  writes or deletes a key there: its one port admits only connections that prove the secret.
- `etcd://h1:p1,h2:p2,h3:p3[/prefix]`: an EtcdStore on an etcd cluster (a member per site, 3+);
  it keeps working while a majority of members is up, so surviving sites can still regroup. With
  the run's secret it must be reached with etcd's own access control (`EtcdAccess`: TLS, a client
  certificate, a user whose role covers the prefix), so that there too nobody without those
  credentials deletes a key.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch.distributed as dist

from zeroband.config import SitesConfig
from zeroband.store.etcd import EtcdAccess, EtcdStore, StoreTimeout, StoreUnavailable, parse_endpoints
from zeroband.store.guard import (
    ERROR,
    FORGED,
    NO_SECRET,
    TAG_BYTES,
    TIMEOUT,
    TO_CLIENT,
    TO_STORE,
    Refused,
    Tampered,
    authenticated,
    decode,
    encode,
    read_raw_frame,
    recv_exactly,
    tag,
    verify,
)
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
    admits only connections that prove it (store/guard.py). `access`: etcd's
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


def _tcp_store(address: str, is_host: bool, timeout: timedelta, secret: RunSecret | bytes | None) -> dist.Store:
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
    """The key a tcp:// store's clients prove the secret with: its own scrypt-derived key (an on-path
    observer's challenge/answer pairs make each guess at the secret cost a scrypt), used for nothing else."""
    return secret.derive("zeroband/store-guard")


def _run_secret(secret: RunSecret | bytes | None) -> RunSecret | None:
    """The caller's secret (tests and tools may hand raw bytes), else $ZEROBAND_SECRET's."""
    return as_secret(secret) if secret is not None else resolve_secret(None)


def host_tcp_store(host: str, port: int, timeout: timedelta, secret: RunSecret | bytes | None = None) -> KeyStoreClient:
    """Start the store process (store/guard.py) on host:port and return a client of it. With a
    secret only connections that prove it reach a key; without, the port is only flood-bounded.
    The store ends with the returned object, or with this process (PR_SET_PDEATHSIG: call this from
    a thread that lives as long)."""
    secret = _run_secret(secret)
    key = guard_key(secret) if secret else None
    # run as a file, not `-m`: the package would import torch (seconds) where stdlib suffices
    cmd = [sys.executable, str(Path(__file__).with_name("guard.py")), "--host", host, "--port", str(port),
           *(["--auth"] if key else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdin is not None and proc.stdout is not None  # PIPEs
    proc.stdin.write(key.hex() + "\n" if key else "")  # the key on stdin: never argv
    proc.stdin.close()
    lines = []
    for line in proc.stdout:  # until it listens, or dies (port taken, bad address)
        lines.append(line.strip())
        if line.startswith("store listening"):
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()  # its later lines: never block it
            break
    else:
        proc.wait()
        raise StoreUnreachable(f"cannot host the store on {host}:{port}: {lines[-1] if lines else 'it exited'}")
    _GUARDS.append(proc)
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    try:
        client = KeyStoreClient(connect_host, port, timeout, key)
    except BaseException:
        _stop_guard(proc)
        raise
    # the process serves this client's store only: when the client goes (garbage, or a test that
    # hosted it ends), so does the store, rather than living on as long as a long-lived host process
    weakref.finalize(client, _stop_guard, proc)
    return client


def _stop_guard(guard: subprocess.Popen) -> None:
    if guard.poll() is None:
        guard.kill()
        guard.wait()
    if guard in _GUARDS:
        _GUARDS.remove(guard)


def _drain(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        log.debug("%s", line.rstrip())


def connect_tcp_store(host: str, port: int, timeout: timedelta, address: str,
                      secret: RunSecret | bytes | None = None) -> KeyStoreClient:
    """A client, within `timeout` or StoreUnreachable naming why (no store, wrong or missing secret)."""
    secret = _run_secret(secret)
    fix = "check sites.store (zeroband launch's store, or site 0 with sites.host_store = true)"
    try:
        return KeyStoreClient(host, port, timeout, guard_key(secret) if secret else None, address)
    except Refused as e:
        if str(e) == NO_SECRET:
            raise StoreUnreachable(f"store {address}: {e}. Fix: export {SECRET_ENV} (the same on every site and "
                                   "the store)") from None
        if "secret" in str(e):
            raise StoreUnreachable(f"store {address}: {e}. Fix: the same {SECRET_ENV} on every site and on the "
                                   "store, or sites.insecure = true on all of them") from None
        if "challenge" in str(e) and e.final:
            raise StoreUnreachable(f"store {address}: a listener accepted the connection but did not answer as a "
                                   f"zeroband store within {timeout.total_seconds():g} s (sites.timeout_s); {fix}") from None
        raise StoreUnreachable(f"store {address}: {e} (for {timeout.total_seconds():g} s); {fix}") from None
    except OSError as e:
        raise StoreUnreachable(f"store {address}: no store answered within {timeout.total_seconds():g} s "
                               f"({e}); {fix}") from None


_UNGUARDED: set[str] = set()  # stores already reported as asking for no secret


class KeyStoreClient(dist.Store):
    """A c10d Store (a Python subclass, like EtcdStore: it works under PrefixStore and gloo's
    rendezvous) on the tcp:// store process (store/guard.py): one authenticated connection, one
    request at a time. `get`, `wait` and `multi_get` wait in the store, which answers once the keys
    exist or the timeout has passed. A lost connection (the store died) is DistNetworkError, as
    c10d's; the next call connects again. A forked child opens its own connection.

    With a secret every request and reply is tagged (store/guard.py): a reply that fails its tag,
    or the store's FORGED answer to a request that failed its own, is a DistNetworkError naming an
    altered or injected connection, and the next call reconnects with a fresh handshake. A failed
    call is never resent, here or on reconnecting: whether the store applied it is unknown (as with
    c10d's TCPStore when a connection drops), so a non-idempotent `add` is applied at most once per
    call, never twice. Its one user, the membership's generation counter, needs fresh increasing
    numbers only: a caller that retries after such an error skips a number, which is harmless."""

    def __init__(self, host: str, port: int, timeout: timedelta, key: bytes | None, address: str = "") -> None:
        super().__init__()  # required by the pybind trampoline
        self.set_timeout(timeout)
        self.host, self.port, self._key = host, port, key
        self.address = address or f"tcp://{host}:{port}"
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pid = -1
        self._session: bytes | None = None  # the connection's session key, with a secret
        self._sent = self._received = 0  # frames tagged each way on this connection
        with self._lock:
            self._connect(timeout.total_seconds())

    def __repr__(self) -> str:
        return f"KeyStoreClient({self.address})"

    def _connect(self, timeout_s: float) -> socket.socket:
        sock, session = authenticated((self.host, self.port), self._key, timeout_s)
        if session is None and self._key is not None and self.address not in _UNGUARDED:
            _UNGUARDED.add(self.address)
            log.warning("store %s asks for no secret (started without %s): its port is only flood-bounded, "
                        "not authenticated; store values stay signed", self.address, SECRET_ENV)
        self._sock, self._pid = sock, os.getpid()
        self._session, self._sent, self._received = session, 0, 0
        return sock

    def _call(self, fields: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        timeout_s = self.timeout.total_seconds()  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property
        with self._lock:
            try:
                sock = self._sock if self._sock is not None and self._pid == os.getpid() else self._connect(timeout_s)
                sock.settimeout(timeout_s + wait_s + 1.0)
                self._send(sock, encode(fields))
                reply = self._receive(sock)
            except OSError as e:  # the store is gone, or stopped answering, or a frame was forged: c10d's error for it
                self._drop()
                raise dist.DistNetworkError(f"store {self.address}: {e or type(e).__name__}") from None
        if reply[0] == ERROR:
            raise dist.DistStoreError(f"store {self.address}: {reply[1].decode(errors='replace')}")
        return reply

    def _send(self, sock: socket.socket, frame: bytes) -> None:
        if self._session is not None:
            frame += tag(self._session, TO_STORE, self._sent, frame)
            self._sent += 1
        sock.sendall(frame)

    def _receive(self, sock: socket.socket) -> list[bytes]:
        frame = read_raw_frame(sock)
        if self._session is not None:
            if not verify(self._session, TO_CLIENT, self._received, frame, recv_exactly(sock, TAG_BYTES)):
                raise Tampered("a reply on the store connection failed authentication: it was altered, injected, "
                               "replayed or reordered on the way (an on-path attacker?); reconnecting on the next call")
            self._received += 1
        fields = decode(frame[4:])
        if fields[0] == FORGED:
            raise Tampered("the store refused a request of ours that failed authentication: it was altered, injected "
                           "or replayed on the way (an on-path attacker?); nothing after it was applied; "
                           "reconnecting on the next call")
        return fields

    def _drop(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close()
        self._sock = None

    def _wait(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        wait_s = timeout.total_seconds()
        reply = self._call([b"get", str(int(wait_s * 1000)).encode(), *(k.encode() for k in keys)], wait_s)
        if reply[0] == TIMEOUT:
            missing = [k.decode(errors="replace") for k in reply[1:]]
            raise StoreTimeout(f"store {self.address}: key(s) {missing} not set within {wait_s:g} s")
        return reply[1:]

    # ---- c10d Store API -------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call([b"set", key.encode(), _as_bytes(value)])

    def get(self, key: str) -> bytes:
        return self._wait([key], self.timeout)[0]  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(keys, self.timeout if timeout is None else timeout)  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait(keys, self.timeout)  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call([b"mset", *(f for k, v in zip(keys, values) for f in (k.encode(), _as_bytes(v)))])

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """The keys' current values, None where missing, in one round trip; never waits (as
        EtcdStore.read_many, so callers can use either)."""
        if not keys:
            return []
        return [v[1:] if v else None for v in self._call([b"read", *(k.encode() for k in keys)])[1:]]

    def check(self, keys: list[str]) -> bool:
        return self._call([b"check", *(k.encode() for k in keys)])[1] == b"1"

    def add(self, key: str, amount: int) -> int:
        return int(self._call([b"add", key.encode(), str(int(amount)).encode()])[1])

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """c10d semantics: set if the value equals `expected` (or the key is missing and `expected`
        is empty); return the value now stored, or `expected` if the key is missing."""
        return self._call([b"cas", key.encode(), _as_bytes(expected), _as_bytes(desired)])[1]

    def delete_key(self, key: str) -> bool:
        return self._call([b"del", key.encode()])[1] == b"1"

    def num_keys(self) -> int:
        return int(self._call([b"num"])[1])

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call([b"list"])[1:]]


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


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
