"""A c10d Store backed by an etcd cluster, so the coordination store survives the loss of any one site.

A TCPStore lives inside one site's process: when that site dies, no new process group can be formed.
An etcd cluster with a member per site (3 or more) keeps serving while a majority of members is up.
This store talks to whichever member answers, failing over between endpoints on connection errors
and while raft elects a new leader.

It is a Python subclass of `torch.distributed.Store` (like torch's elastic EtcdStore), so it works
under `dist.PrefixStore` and `dist.ProcessGroupGloo`, whose rendezvous uses set/get/wait.

Layout in etcd, under the root prefix R (from `etcd://.../R`):
  R/kv/<key>            the store's keys, values as raw bytes
  R/add-receipts/<id>   the last `add` of one store instance: makes a retried add exactly-once

Beyond c10d's API, what membership needs of etcd itself: leases (`grant`, `keepalive`, `revoke`,
`set(..., lease=)`: a key that vanishes when its owner stops renewing it), write-once by
transaction (`compare_set` with an empty expected value: `create_revision == 0`), and
`wait_change`: a watch of a key range from the revision the caller last read, so waits wake on a
change instead of polling. Access (`EtcdAccess`): TLS with a client certificate and a user whose
role covers R/ only (zeroband/tools/etcd_access.py sets a cluster up that way).
"""

from __future__ import annotations

import base64
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=5)
_TXN_OPS = 100  # below etcd's default --max-txn-ops of 128


class StoreTimeout(dist.DistStoreError):
    """A key did not appear within the timeout (the same error type TCPStore raises)."""


class StoreUnavailable(dist.DistStoreError):
    """No etcd endpoint answered within the retry budget (a majority of members is down)."""


class StoreRefused(dist.DistStoreError):
    """etcd refused this client: wrong user or password, or a role without access to the prefix."""


@dataclass(frozen=True)
class EtcdAccess:
    """How a site proves itself to the etcd cluster: TLS against `ca_file` (the members' CA) with its
    client certificate, and etcd's authentication as `user` (the gateway ignores certificate names)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def _prefix_end(prefix: bytes) -> bytes:
    """The etcd range_end covering every key that starts with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _Endpoints:
    """HTTP clients for every etcd member; posts to one and fails over to the next on errors."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], request_timeout: float, retry_s: float,
                 access: EtcdAccess | None = None) -> None:
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        self.endpoints, self.access = list(endpoints), access
        self.request_timeout = request_timeout
        self.retry_s = retry_s
        self._current = 0
        self._lock = threading.Lock()
        self.revision = 0  # the newest store revision any reply carried
        self.floor: int | None = None  # the revision of the first reply since the last wait_change
        self._connect()

    def _connect(self) -> None:
        from etcd3gw.client import Etcd3Client  # optional dependency: only etcd:// stores need it

        a = self.access
        tls = {} if a is None else {"protocol": "https", "ca_cert": a.ca_file, "cert_cert": a.cert_file,
                                    "cert_key": a.key_file}
        # Fixed api_path: 3.4+ serves /v3/, and auto-discovery would cost a request per member.
        self._clients = [Etcd3Client(host, port, api_path="/v3/", timeout=self.request_timeout, **tls)  # type: ignore[arg-type]
                         for host, port in self.endpoints]
        for client in self._clients:  # the CA is ours: $REQUESTS_CA_BUNDLE (or a proxy) must not replace it
            client.session.trust_env = False
        self._pid, self._token = os.getpid(), ""

    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        if os.getpid() != self._pid:  # a forked child must not share the parent's pooled sockets
            self._connect()
        deadline = time.monotonic() + self.retry_s
        failures = 0
        while True:
            with self._lock:
                index = self._current
            try:
                if self.access is not None and self.access.user and not self._token:
                    self._authenticate(index)
                reply = self._clients[index].post(self._clients[index].get_url(path), json=payload)
                self._seen(reply)
                return reply
            except _retryable() as e:
                failures += 1
                self._advance(index)
                if time.monotonic() > deadline:
                    raise StoreUnavailable(
                        f"no etcd member of {self._names()} answered {path} for {self.retry_s:.0f} s: {_detail(e)}"
                    ) from e
                if failures % len(self._clients) == 0:  # every member failed: wait out a leader election
                    time.sleep(min(0.05 * failures, 0.5))
            except _refusals() as e:
                if transient(0, _detail(e)) and time.monotonic() <= deadline:  # raft between leaders
                    self._advance(index)
                    time.sleep(0.05)
                    continue
                if not self._token or "invalid auth token" not in _detail(e) or time.monotonic() > deadline:
                    raise StoreRefused(f"etcd {self._names()} refused {path}: {_detail(e)} (check sites.etcd_user, "
                                       "its password and its role's access to the run's prefix)") from None
                # a restarted member forgot its tokens, or has not applied a new one yet: a new
                # token, and the next member (a lagging one catches up meanwhile)
                self._token = ""
                self._advance(index)
                time.sleep(0.05)

    def _authenticate(self, index: int) -> None:
        """A token for the run's user, sent with every later request (to every member). Its own
        timeout: the password check is a bcrypt, seconds on a loaded member."""
        assert self.access is not None
        for client in self._clients:  # an old token in the request would fail it ("invalid auth token")
            client.session.headers.pop("Authorization", None)
        client = self._clients[index]
        body = {"name": self.access.user, "password": self.access.password or ""}
        reply = client.session.post(client.get_url("/auth/authenticate"), json=body, timeout=10 * self.request_timeout)
        if reply.status_code != 200 and transient(reply.status_code, _detail(reply.text)):
            from etcd3gw import exceptions  # retried on the next member, as any request's 503 is (`post`)

            raise exceptions.ConnectionFailedError(reply.text)
        if reply.status_code != 200:
            raise StoreRefused(f"etcd {self._names()} refused user {self.access.user!r}: {_detail(reply.text)} "
                               "(check sites.etcd_user and sites.etcd_password_file)")
        self._token = reply.json()["token"]
        for client in self._clients:
            client.session.headers["Authorization"] = self._token

    def _seen(self, reply: dict[str, Any]) -> None:
        revision = int(reply.get("header", {}).get("revision", 0))
        self.revision = max(self.revision, revision)
        if self.floor is None and revision:
            self.floor = revision

    def watch(self, key: bytes, end: bytes, timeout_s: float) -> None:
        """Return at the first change to [key, end) after the revision of the first reply since the
        last call (so nothing read since then can have changed unseen), or after `timeout_s`. One
        streamed request to the current member; any failure returns at once (the caller's next read
        fails over)."""
        start, self.floor = (self.floor if self.floor is not None else self.revision) + 1, None
        client = self._clients[self._current]
        body = {"create_request": {"key": _b64(key), "range_end": _b64(end), "start_revision": str(start)}}
        try:
            with client.session.post(client.get_url("/watch"), json=body, stream=True,
                                     timeout=(self.request_timeout, max(timeout_s, 0.01))) as reply:
                buffer = b""
                for chunk in reply.iter_content(chunk_size=None):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    if any(_woken(line) for line in lines):
                        return
        except Exception:  # a read timeout (nothing changed), or the member is gone
            time.sleep(min(timeout_s, 0.02))

    def _advance(self, failed: int) -> None:
        with self._lock:
            if self._current == failed:  # another thread may already have moved on
                self._current = (failed + 1) % len(self._clients)

    def _names(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


def _woken(line: bytes) -> bool:
    """Whether one message of a watch stream reports a change (or a compaction: re-read anyway)."""
    if not line.strip():
        return False
    result = json.loads(line).get("result", {})
    return bool(result.get("events") or result.get("compact_revision") or result.get("canceled"))


def _refusals() -> tuple[type[BaseException], ...]:
    """What etcd answers a request it refuses (caught after `_retryable`'s): a token it does not
    know (a restarted member's simple tokens are gone), a bad password, a role without access."""
    from etcd3gw import exceptions

    return (exceptions.Etcd3Exception,)


def _detail(error: BaseException | str) -> str:
    """etcd's own words for an error (its JSON "error" field), else the error's text."""
    text = error if isinstance(error, str) else getattr(error, "detail_text", "") or str(error)
    try:
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return str(text).strip()


# etcd's words for a request it could not serve now (raft between leaders, or overloaded), not a refusal
TRANSIENT = ("leader changed", "no leader", "timed out", "too many requests", "server stopped")


def transient(status: int, detail: str) -> bool:
    """Whether an answer is etcd failing for now rather than refusing: the statuses etcd3gw maps to
    retryable errors (500, 503, 408, 504), or raft's transient errors by their words. The password
    check runs through raft too: during a leader change it fails with "etcdserver: leader changed",
    which a site read as its credentials refused and stopped (the secure chaos test, under load)."""
    return status in (500, 503, 408, 504) or any(word in detail.lower() for word in TRANSIENT)


def _retryable() -> tuple[type[BaseException], ...]:
    """Errors worth trying another member for: refused/reset/timeouts, 503 (no leader) and 500."""
    import requests
    from etcd3gw import exceptions

    return (
        exceptions.ConnectionFailedError,
        exceptions.ConnectionTimeoutError,
        exceptions.InternalServerError,
        requests.exceptions.RequestException,
    )


class EtcdStore(dist.Store):
    """c10d Store on an etcd cluster: `get`/`wait` block until keys exist, bounded by the timeout."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        prefix: str = "zeroband",
        timeout: timedelta = DEFAULT_TIMEOUT,
        request_timeout: float = 1.0,
        retry_s: float = 30.0,
        access: EtcdAccess | None = None,
    ) -> None:
        # request_timeout bounds one HTTP request. While raft has no leader a live follower holds
        # requests, so after the leader dies the first write takes about this long (docs/results/store.md);
        # much lower would retry spuriously over slow WAN links. retry_s: how long to keep failing
        # over before declaring the cluster down (a majority lost).
        super().__init__()  # required by the pybind trampoline
        self.set_timeout(timeout)
        self.prefix = prefix.strip("/")
        self._kv = f"{self.prefix}/kv/".encode()
        self._net = _Endpoints(endpoints, request_timeout, retry_s, access)
        self._add_lock = threading.Lock()
        self._receipt_owner = -1  # pid the receipt id belongs to; re-drawn after fork
        self._receipt_id = ""
        self._add_seq = 0

    def __repr__(self) -> str:
        return f"EtcdStore({self._net._names()}, prefix={self.prefix!r})"

    # ---- c10d Store API -------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes, lease: str | None = None) -> None:
        """`lease`: the key vanishes when that lease expires or is revoked (`grant`)."""
        self._net.post("/kv/put", {"key": _b64(self._k(key)), "value": _b64(value), **({"lease": lease} if lease else {})})

    def get(self, key: str) -> bytes:
        return self._wait_values([key], self.timeout)[0]  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_values(keys, self.timeout if timeout is None else timeout)  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self.read_many(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_values(keys, self.timeout)  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        puts = [{"request_put": {"key": _b64(self._k(k)), "value": _b64(v)}} for k, v in zip(keys, values)]
        for start in range(0, len(puts), _TXN_OPS):  # atomic per txn: up to _TXN_OPS keys appear at once
            self._net.post("/kv/txn", {"success": puts[start:start + _TXN_OPS]})

    def add(self, key: str, amount: int) -> int:
        """Atomic increment: compare-and-swap on the key's mod_revision, retried on contention."""
        with self._add_lock:
            receipt = self._next_receipt()
            while True:
                done, value = self._try_add(self._k(key), amount, receipt)
                if done:
                    return value
                time.sleep(0.001 * (1 + os.getpid() % 5))  # contention: de-synchronise the racers

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore semantics: set if the value equals `expected` (or the key is missing and
        `expected` is empty); return the value now stored, or `expected` if the key is missing."""
        k = _b64(self._k(key))
        if _as_bytes(expected):
            cond = {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        else:
            cond = {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        txn = {"compare": [cond], "success": [{"request_put": {"key": k, "value": _b64(desired)}}],
               "failure": [{"request_range": {"key": k}}]}
        reply = self._net.post("/kv/txn", txn)
        if reply.get("succeeded"):
            return _as_bytes(desired)
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else _as_bytes(expected)

    def delete_key(self, key: str) -> bool:
        reply = self._net.post("/kv/deleterange", {"key": _b64(self._k(key))})
        return int(reply.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        reply = self._net.post("/kv/range", {"key": _b64(self._kv), "range_end": _b64(_prefix_end(self._kv)),
                                             "count_only": True})
        return int(reply.get("count", 0))

    def list_keys(self) -> list[str]:
        reply = self._net.post("/kv/range", {"key": _b64(self._kv), "range_end": _b64(_prefix_end(self._kv)),
                                             "keys_only": True})
        return [_unb64(kv["key"])[len(self._kv):].decode() for kv in reply.get("kvs", [])]

    # ---- etcd's own primitives ------------------------------------------------------------------

    def grant(self, ttl_s: float) -> str:
        """A new lease of `ttl_s` (rounded up to whole seconds); its id."""
        return str(self._net.post("/lease/grant", {"TTL": max(1, math.ceil(ttl_s))})["ID"])

    def keepalive(self, lease: str) -> bool:
        """Renew `lease`; False once it has expired (its keys are gone)."""
        return int(self._net.post("/lease/keepalive", {"ID": lease}).get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: str) -> None:
        self._net.post("/kv/lease/revoke", {"ID": lease})

    def wait_change(self, prefix: str, timeout_s: float) -> None:
        """Block until a key under `prefix` changes (created, overwritten, deleted, expired), at most
        `timeout_s`: see `_Endpoints.watch` for why nothing read before is missed."""
        start = self._k(prefix)
        self._net.watch(start, _prefix_end(start) if prefix else _prefix_end(self._kv), timeout_s)

    # ---- helpers --------------------------------------------------------------------------------

    def _k(self, key: str) -> bytes:
        return self._kv + key.encode()

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """Current values (None where missing), read in transactions: one round trip per
        _TXN_OPS keys (etcd refuses transactions of more than 128 operations by default)."""
        out: list[bytes | None] = []
        for start in range(0, len(keys), _TXN_OPS):
            ranges = [{"request_range": {"key": _b64(self._k(k))}} for k in keys[start:start + _TXN_OPS]]
            for resp in self._net.post("/kv/txn", {"success": ranges}).get("responses", []):
                kvs = resp["response_range"].get("kvs", [])
                out.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return out

    def _wait_values(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        """Read; until every key exists, wait for a change under their common prefix (a watch from
        the read's revision: a short request each, so it fails over like any other) and read again."""
        deadline = time.monotonic() + timeout.total_seconds()
        common = os.path.commonprefix(keys)
        while True:
            values = self.read_many(keys)
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            if time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values) if v is None]
                raise StoreTimeout(
                    f"EtcdStore: key(s) {missing} not set within {timeout.total_seconds():g} s "
                    f"(etcd prefix {self.prefix!r} on {self._net._names()})"
                )
            self.wait_change(common, min(1.0, max(0.0, deadline - time.monotonic())))

    def _next_receipt(self) -> tuple[bytes, str]:
        if self._receipt_owner != os.getpid():  # forked: the parent's id and sequence are not ours
            self._receipt_owner, self._receipt_id, self._add_seq = os.getpid(), uuid.uuid4().hex, 0
        self._add_seq += 1
        return f"{self.prefix}/add-receipts/{self._receipt_id}".encode(), str(self._add_seq)

    def _try_add(self, key: bytes, amount: int, receipt: tuple[bytes, str]) -> tuple[bool, int]:
        """One CAS attempt. The receipt is written in the same txn: if a reply is lost to a dying
        member and the retry finds the key moved on, the receipt says whether it was our write."""
        receipt_key, seq = receipt
        current = self._net.post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        value = int(_unb64(current[0].get("value", ""))) if current else 0
        mod = current[0]["mod_revision"] if current else "0"
        new = value + amount
        txn = {
            "compare": [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(str(new))}},
                        {"request_put": {"key": _b64(receipt_key), "value": _b64(f"{seq}:{new}")}}],
            "failure": [{"request_range": {"key": _b64(receipt_key)}}],
        }
        reply = self._net.post("/kv/txn", txn)
        if reply.get("succeeded"):
            return True, new
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        last_seq, _, last_value = _unb64(kvs[0]["value"]).decode().partition(":") if kvs else ("", "", "")
        if last_seq == seq:  # an earlier attempt of this very add committed; its reply was lost
            return True, int(last_value)
        return False, 0


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """`h1:p1,h2:p2` -> [(h1, p1), (h2, p2)]."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {item!r} must look like host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError(f"no etcd endpoints in {spec!r}")
    return out
