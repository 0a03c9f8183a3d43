"""The membership protocol's view of the store: every value carries an HMAC-SHA256 bound to its key.

Heartbeats, arrivals, member lists, votes, verdicts, leave notices and the committed-round counter
(zeroband/membership/heartbeat.py, rounds.py, zeroband/membership/elastic.py) are written as
    hex(HMAC-SHA256(K, label | key | value)) "." value
with K derived from the shared secret (trust/mac.py). A value that does not verify, written by
someone without the secret or copied from another key, reads as absent and is logged once per key
(event `store_value_refused`); a write-once slot that holds one is taken back by the first honest
writer (`compare_set`). Only the generation counter stays a bare `add`: it merely hands out fresh
numbers, and the number a generation uses travels inside the signed member list.

Without a secret (`key=None`, sites.insecure) values are stored as they are.

Incarnation: an elastic run's keys are signed under `incarnation_key(K, id)`, a key of this launch
of the run only (`ZEROBAND_INCARNATION`, minted afresh by every `zeroband launch`; the same for a
site restarted within it), so the MAC binds (incarnation, key, value): a value recorded from an
earlier launch (its `complete`, ledger positions, member lists) never verifies in a new one.
Everything that signs through the run's SignedStore is bound alike, whatever keys it writes.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from zeroband.trust.auth import TrustError, frame
from zeroband.watchdog import POLL_S, PeerTimeout, Ticker, _sites

log = logging.getLogger(__name__)

LABEL = b"zeroband-store-v1"
MAC_HEX = 64


INCARNATION_ENV = "ZEROBAND_INCARNATION"
_INCARNATION = re.compile(r"[A-Za-z0-9_-]{8,64}")


def run_incarnation() -> str:
    """This launch's id ($ZEROBAND_INCARNATION; "" when unset: values are bound to their key only).
    It is part of store keys, so it is refused unless it is 8-64 URL-safe characters."""
    value = os.environ.get(INCARNATION_ENV, "")
    if value and not _INCARNATION.fullmatch(value):
        from zeroband.config import ConfigError  # config sits above trust/: imported only to raise its error

        raise ConfigError(f"{INCARNATION_ENV}: use 8-64 characters from A-Z a-z 0-9 _ - (e.g. `python -c 'import "
                          "secrets; print(secrets.token_hex(16))'`), fresh at each launch, the same on every site")
    return value


def fresh_incarnation_env() -> dict[str, str]:
    """A new launch's environment entry: every site it starts (and restarts) gets the same fresh id."""
    return {INCARNATION_ENV: secrets.token_hex(16)}


def incarnation_key(key: bytes | None, incarnation: str) -> bytes | None:
    """The store-signing key of one incarnation: a value signed under it verifies in no other."""
    if key is None or not incarnation:
        return key
    return hmac.new(key, frame(LABEL, b"incarnation", incarnation.encode()), hashlib.sha256).digest()


class ForgedValue(TrustError):
    """A store value that should be there failed authentication."""


ABSENT, NEVER = b"\x00zeroband-absent", b"\x00zeroband-never"  # a read-only compare_set's expected / desired


def wait_and_read(store: dist.Store, key: str) -> bytes:
    """`store.get(key)`, never b"" for a key deleted meanwhile. c10d's get waits for the key, then reads
    it: a TCPStore key deleted between the two (a deletion storm, its writer putting it back) reads as
    b"", which no sealed value is, and was refused as forged (ForgedValue: the storm test's sites
    stopped on a data-ledger key). Such a read means "not yet": value and presence are read again
    together, and a key still absent is waited for again (each wait within the store's timeout)."""
    raw = store.get(key)
    while raw == b"":
        now = store.compare_set(key, ABSENT, NEVER)  # type: ignore[arg-type]  # a read that never writes (SignedStore.lookup); the stub says str, c10d takes bytes
        if now != ABSENT:
            return now  # there: written back since, or an empty value really written (insecure runs)
        raw = store.get(key)
    return raw


class SignedStore:
    """Wraps a c10d store (TCPStore, EtcdStore, PrefixStore) for the protocol's own keys."""

    def __init__(self, store: dist.Store, key: bytes | None = None) -> None:
        self.store, self.key = store, key
        self.refused: dict[str, str] = {}  # key -> "unsigned", "signed" (we have no secret) or "bad-mac"
        self.keeper = Keeper(self)

    def _mac(self, secret: bytes, key: str, value: bytes) -> bytes:
        return hmac.new(secret, frame(LABEL, key.encode(), value), hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        raw = value.encode() if isinstance(value, str) else value
        return raw if self.key is None else self._mac(self.key, key, raw) + b"." + raw

    def open(self, key: str, raw: bytes) -> bytes | None:
        """The value, or None (logged once per key) if it does not verify. Without a secret, a signed
        value is refused too: its writer holds a secret this site lacks."""
        mac, dot, value = raw[:MAC_HEX], raw[MAC_HEX : MAC_HEX + 1], raw[MAC_HEX + 1 :]
        sealed = dot == b"." and all(c in b"0123456789abcdef" for c in mac) and len(mac) == MAC_HEX
        if self.key is None:
            if not sealed:
                return raw
            reason = "signed"
        elif sealed and hmac.compare_digest(mac, self._mac(self.key, key, value)):
            return value
        else:
            reason = "bad-mac" if sealed else "unsigned"
        if key not in self.refused:
            self.refused[key] = reason
            log.warning("store value refused: key=%s (no valid HMAC: forged, copied from another key, or written "
                        "by a site without the secret)", key, extra={"event": "store_value_refused", "key": key})
        return None

    # ---- the operations the protocol uses -------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, self.seal(key, value))  # type: ignore[arg-type]  # torch's Store stub says str; c10d stores take bytes

    def read(self, key: str) -> bytes | None:
        """The verified value, or None if the key is absent or its value is refused."""
        return self.lookup(key)[0]

    def lookup(self, key: str) -> tuple[bytes | None, bool]:
        """(the verified value or None, whether the key holds any value), from one compare_set that
        never writes (no sealed value equals ABSENT): one non-blocking round trip. A check then a get
        would block in the get when the key is deleted in between, and a read then a check would take
        a value deleted and written back in between for a refused one."""
        raw = self.store.compare_set(key, ABSENT, NEVER)  # type: ignore[arg-type]  # the stub says str; c10d takes bytes
        return (None, False) if raw == ABSENT else (self.open(key, raw), True)

    def lookup_many(self, keys: list[str]) -> list[tuple[bytes | None, bool]]:
        """`lookup` of every key: one round trip where the store reads many keys at once without
        blocking (`read_many`: etcd, zeroband's own store), else one per key. A protocol round over
        k sites then costs one request, not k (at 200 ms RTT, 8 sites: 0.2 s, not 1.6 s)."""
        many = getattr(self.store, "read_many", None)
        if many is None:
            return [self.lookup(k) for k in keys]
        return [(None, False) if raw is None else (self.open(k, raw), True) for k, raw in zip(keys, many(keys))]

    def wait_change(self, keys: list[str], poll_s: float) -> None:
        """Until the next read is worth making: a change under the keys' common prefix, at most
        POLL_S, where the store has watches (etcd: no polling, and a peer's write wakes us at once);
        else `poll_s` of sleep."""
        watch = getattr(self.store, "wait_change", None)
        if watch is None:
            time.sleep(poll_s)
        else:
            watch(os.path.commonprefix(keys), POLL_S)

    def check(self, keys: list[str]) -> bool:
        return all(self.read(k) is not None for k in keys)

    def get(self, key: str) -> bytes:
        value = self.open(key, wait_and_read(self.store, key))
        if value is None:
            raise ForgedValue(f"store key {key!r} holds a value without a valid HMAC")
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Write-once (`expected` ""): the first *authentic* value wins; a refused one is replaced."""
        sealed = self.seal(key, desired)
        raw = self.store.compare_set(key, expected, sealed)  # type: ignore[arg-type]  # torch's Store stub says str; c10d stores take bytes
        for _ in range(16):  # a forger racing us forever is a denial of service, reported below
            value = self.open(key, raw)
            if value is not None:
                return value
            raw = self.store.compare_set(key, raw, sealed)  # type: ignore[arg-type]  # torch's Store stub says str; c10d stores take bytes
        raise ForgedValue(f"store key {key!r}: forged values keep replacing the protocol's")

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)


class SealedStore(dist.Store):
    """A c10d store whose values are signed (SignedStore's format), for stores that C++ reads: the
    gloo rendezvous of a global group. A peer without the secret cannot publish an address there;
    a forged one fails `get` with ForgedValue before any connection is made."""

    def __init__(self, inner: dist.Store, key: bytes | None) -> None:
        super().__init__()  # required by the pybind trampoline
        self.signed = SignedStore(inner, key)
        self.set_timeout(inner.timeout)  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def set(self, key: str, value: str | bytes) -> None:
        self.signed.set(key, value)

    def get(self, key: str) -> bytes:
        return self._opened(key, wait_and_read(self.signed.store, key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """One store round trip for all of them (a group's addresses: one per member); a value
        deleted meanwhile (read as b"") is read again alone (`wait_and_read`)."""
        raws = self.signed.store.multi_get(keys)
        return [self._opened(k, raw or wait_and_read(self.signed.store, k)) for k, raw in zip(keys, raws)]

    def _opened(self, key: str, raw: bytes) -> bytes:
        value = self.signed.open(key, raw)
        if value is None:
            raise ForgedValue(f"global-group rendezvous key {key!r} was written without the shared secret: a site "
                              "holds another secret (or an outsider took its slot); check ZEROBAND_SECRET on every site")
        return value

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.signed.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.signed.store.wait(keys, self.timeout if timeout is None else timeout)  # type: ignore[attr-defined]  # torch's Store stub lacks the timeout property

    def check(self, keys: list[str]) -> bool:
        return self.signed.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.signed.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.signed.delete_key(key)

    def num_keys(self) -> int:
        return self.signed.store.num_keys()


KEEP_PERIOD_S = 0.25  # between the keeper's reads: one request, never more than a few per second on a WAN store


class Keeper:
    """This site's own values of waits it has left, put back wherever they read missing or refused,
    each until its deadline, on one daemon thread. A site leaves an `exchange` once it has read every
    other site's value, but a slower site may not have read its value yet: an outsider's overwrite in
    between then stayed (its owner no longer re-wrote it), and after ADMIT_REFUSE_S the slower site
    refused an honest one (the fixed-run admission attack test, in CI under load). Keeping a value for
    the wait's own timeout suffices: a site further behind than that fails its next wait anyway."""

    def __init__(self, store: SignedStore) -> None:
        self.store = store
        self.values: dict[str, tuple[bytes, float]] = {}  # key -> (our value, when to stop keeping it)
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        _KEEPERS.add(self)

    def keep(self, key: str, raw: bytes, for_s: float) -> None:
        with self.lock:
            self.values[key] = (raw, time.monotonic() + for_s)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="zeroband-store-keeper", daemon=True)
                self.thread.start()

    def stop(self) -> None:
        """End the thread now (`stop_keepers`); a later `keep` starts another."""
        self.stopping.set()
        thread = self.thread
        if thread is not None:
            thread.join()
        with self.lock:
            self.values, self.thread = {}, None
        self.stopping.clear()

    def _due(self) -> dict[str, bytes]:
        """The values still kept; the thread ends (under the lock, so `keep` starts another) when none is."""
        with self.lock:
            now = time.monotonic()
            self.values = {k: v for k, v in self.values.items() if v[1] > now}
            if not self.values:
                self.thread = None
            return {k: raw for k, (raw, _) in self.values.items()}

    def _run(self) -> None:
        while due := self._due():
            try:
                for k, (value, _) in zip(due, self.store.lookup_many(list(due))):
                    if value != due[k]:
                        self.store.set(k, due[k])
            except Exception:  # noqa: BLE001 - the store is gone (the run ended or moved on): nothing left to keep
                with self.lock:
                    self.values, self.thread = {}, None
                return
            if self.stopping.wait(KEEP_PERIOD_S):
                return


_KEEPERS: weakref.WeakSet[Keeper] = weakref.WeakSet()


def stop_keepers() -> None:
    """End every keeper's thread: the run is over (mesh.shutdown), and a thread left to the
    interpreter's finalization inside a store call aborts the process (issue 23)."""
    for keeper in list(_KEEPERS):
        keeper.stop()


atexit.register(stop_keepers)  # every other way out (an error, a signal): before finalization ends threads


class StoreInterference(TrustError):
    """Someone without the secret keeps forging or deleting this protocol's store values."""


REWRITE_LIMIT = 200  # own values re-written in one exchange before the interference is an error


def track_refusals(read: Mapping[int, tuple[bytes | None, bool]], bad_since: dict[int, float], now: float) -> None:
    """Since when each site's value (`read`: SignedStore.lookup per site) has failed authentication:
    present yet failing in one and the same read. A deleted value is only "not yet", never a refusal,
    and a value that verifies, or a deleted one, starts it over. Never a second look (a check after
    the read): a value deleted before the read and written back by its owner before the check read as
    a refused one, and an honest site was blamed for a deletion storm."""
    for s, (value, present) in read.items():
        if value is None and present:
            bad_since.setdefault(s, now)
        else:
            bad_since.pop(s, None)


def remember(seen: dict[int, bytes], read: Mapping[int, bytes | None]) -> dict[int, bytes | None]:
    """Each site's last value that verified in this wait (`seen`, updated), for the sites in `read`.
    A site that has left its own wait no longer re-writes its value, so an outsider's later overwrite
    or deletion would stay: read afresh, that site would turn "missing" again and be refused after
    ADMIT_REFUSE_S though it had arrived. A newer verified value (a restarted site) replaces the old."""
    seen.update({s: v for s, v in read.items() if v is not None})
    return {s: seen.get(s) for s in read}


def exchange(store: SignedStore, keys: Mapping[int, str], me: int, value: str | bytes, what: str,
             timeout_s: float, refuse_after_s: float | None = None) -> dict[int, bytes | None]:
    """Every site's signed value under `keys` (this site's is `value`, as written, never as read
    back), bounded by `timeout_s`.

    A value that is missing or does not verify reads as "not yet", never as a decision. This site
    re-writes its own value at every poll where it reads back missing or refused (an outsider
    deleted or overwrote it), up to REWRITE_LIMIT times, so a forged write only delays its readers.
    With `refuse_after_s`, a site whose value has failed authentication that long (a site with
    another secret, or an outsider that keeps overwriting it) is returned as None, for the caller
    to refuse; a timeout names the keys that held refused values rather than blaming their sites."""
    raw = value.encode() if isinstance(value, str) else value
    rewrites, start, tick = 0, time.monotonic(), Ticker(what)
    bad_since: dict[int, float] = {}
    seen: dict[int, bytes] = {}
    store.set(keys[me], raw)
    names = list(keys.values())
    while True:
        read = dict(zip(keys, store.lookup_many(names)))  # every site's, ours too: one round trip where it can
        if read.pop(me)[0] != raw:
            rewrites += 1
            if rewrites > REWRITE_LIMIT:
                raise StoreInterference(f"{what}: store key {keys[me]!r} was deleted or overwritten {REWRITE_LIMIT} "
                                        "times by a writer without the shared secret; the store is under attack")
            store.set(keys[me], raw)
        values = remember(seen, {s: v for s, (v, _) in read.items()})
        missing, now = {s for s, v in values.items() if v is None}, time.monotonic()
        track_refusals(read, bad_since, now)
        if not missing or (refuse_after_s is not None and all(now - bad_since.get(s, now) >= refuse_after_s > 0
                                                               for s in missing)):
            store.keeper.keep(keys[me], raw, timeout_s)  # for the sites that have not read it yet
            return {**values, me: raw}
        if now - start >= timeout_s:
            forged = sorted(keys[s] for s in missing if s in bad_since)
            if forged:
                raise StoreInterference(f"{what}: store keys {forged} hold values without a valid HMAC (written by an "
                                        "outsider, or by a site without the shared secret)")
            raise PeerTimeout(f"{what}: {_sites(missing)} did not arrive within {timeout_s:g} s (sites.timeout_s); "
                              "is it running, with the same sites.store and run name?")
        tick.tick(_sites(missing))
        store.wait_change(names, 0.01 if now - start < 1.0 else POLL_S)
