"""Liveness without a leader: every site bumps its own counter in the store; everyone watches.

Beats and leave notices are signed with the shared secret (zeroband/trust/signed.py): a
forged beat or leave notice reads as absent, so nobody can keep a dead site alive or make a live
one look gone. A beat is `<process nonce>:<stamp>`, the stamp the writer's wall clock in ns, forced
to grow at every beat: an observer accepts a beat only if its stamp is newer than the last it
accepted from that site, so recorded beats replayed (alternated) keep nobody alive, and a restarted
site (a later clock) is seen at once.

With the secret nobody without the run's credentials writes or deletes a key (a tcp:// store
admits no one else, etcd is reached with its access control); an insecure run trusts whoever can
reach the store. So no beat is deleted: a missing beat is one not written yet.

A site's rank 0 runs `Heartbeat` on its own thread and its own store connection, so a long inner
step never delays it, while a hung (SIGSTOP) or partitioned site stops bumping. Observers use
`Liveness`, which remembers, on its own clock, when each counter last changed: no clock is shared
between sites, so skew cannot fake a death. A site that leaves on purpose writes `leave/<site>`
and is dead at once, without waiting for `dead_after_s`.

On etcd liveness is etcd's own: the same thread (`LeaseHeartbeat`) keeps a lease of
`dead_after_s` alive with this site's presence key attached, and observers (`LeaseLiveness`) count a site alive while that key exists; its lease
expires (death) or is revoked (leave) and etcd deletes the key. Both observers are a `Presence`:
what the round protocol asks of liveness, and how it waits for the store to change (`wait`:
a poll interval on a TCPStore, a watch on etcd).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist

from zeroband.store.etcd import EtcdStore
from zeroband.trust.signed import SignedStore

POLL_S = 0.05  # between reads of a store that cannot be watched
WATCH_S = 0.5  # longest watch: time-based rules (grace, overdue votes, timeouts) are checked this often

log = logging.getLogger(__name__)


def heartbeat_key(prefix: str, site: int) -> str:
    return f"{prefix}hb/{site}"


def leave_key(prefix: str, site: int) -> str:
    return f"{prefix}leave/{site}"


def beat_stamp(beat: bytes | None) -> int | None:
    """The stamp of a (verified) beat, or None for no beat or one that is not ours."""
    try:
        return int(beat.rsplit(b":", 1)[1]) if beat else None
    except (IndexError, ValueError):
        return None


class Presence:
    """What the round protocol asks of liveness (`Liveness` on a TCPStore, `LeaseLiveness` on etcd)."""

    sites: list[int]
    me: int | None  # the observing site, alive whatever the store says
    dead_after_s: float
    left: set[int]  # sites gone by their signed leave notice
    store: SignedStore  # its `refused`: keys whose values failed the run's key (another secret)

    def poll(self) -> None:
        raise NotImplementedError

    def alive(self) -> set[int]:
        raise NotImplementedError

    def wait(self) -> None:
        """Until the store may have changed: a poll interval, or a watch."""
        time.sleep(POLL_S)

    def alive_after_poll(self) -> set[int]:
        self.poll()
        return self.alive()

    def dead_among(self, sites: Iterable[int]) -> set[int]:
        return set(sites) - self.alive_after_poll()


class Heartbeat:
    def __init__(self, open_client: Callable[[], dist.Store], prefix: str, site: int, interval_s: float,
                 sign_key: bytes | None = None) -> None:
        self.open_client, self.key, self.interval_s = open_client, heartbeat_key(prefix, site), interval_s
        self.sign_key = sign_key
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zeroband-heartbeat", daemon=True)
        self.nonce, self.stamp = secrets.token_hex(8), 0

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def _run(self) -> None:
        store: SignedStore | None = None
        while not self.stopped.is_set():
            try:
                if store is None:  # opened here, in the try: a failed open is retried at the next beat,
                    store = SignedStore(self.open_client(), self.sign_key)  # never a dead thread (no beats)
                self.beat(store)
            except Exception as e:  # a store hiccup must not kill the thread: the next beat retries
                log.warning("heartbeat %s failed: %s", self.key, e)
            self.stopped.wait(self.interval_s)
        if store is not None:
            self.last(store)

    def beat(self, store: SignedStore) -> None:
        self.stamp = max(self.stamp + 1, time.time_ns())
        store.set(self.key, f"{self.nonce}:{self.stamp}")

    def last(self, store: SignedStore) -> None:
        """After the last beat (a clean stop)."""

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5 * self.interval_s + 5)


class LeaseHeartbeat(Heartbeat):
    """The presence key, attached to a lease of `ttl_s` that every beat renews; a lease found expired
    (this process froze past it: the others took it for dead) is replaced, as a restarted site's
    would be. Revoked at a clean stop, so the others see the site gone at once."""

    def __init__(self, open_client: Callable[[], dist.Store], prefix: str, site: int, interval_s: float,
                 ttl_s: float, sign_key: bytes | None = None) -> None:
        super().__init__(open_client, prefix, site, interval_s, sign_key)
        self.ttl_s, self.lease = ttl_s, ""

    def beat(self, store: SignedStore) -> None:
        etcd = store.store
        assert isinstance(etcd, EtcdStore), "leases need an etcd store"
        if not self.lease or not etcd.keepalive(self.lease):
            self.lease = ""
            lease = etcd.grant(self.ttl_s)
            etcd.set(self.key, store.seal(self.key, self.nonce), lease=lease)
            self.lease = lease

    def last(self, store: SignedStore) -> None:
        if self.lease and isinstance(store.store, EtcdStore):
            try:
                store.store.revoke(self.lease)
            except Exception as e:  # its TTL ends it anyway
                log.warning("revoking the lease of %s failed: %s", self.key, e)


class Liveness(Presence):
    """Which sites are alive, as seen from here (by their beats)."""

    def __init__(self, store: dist.Store, prefix: str, sites: Iterable[int], dead_after_s: float,
                 sign_key: bytes | None = None, me: int | None = None) -> None:
        self.store, self.prefix, self.dead_after_s = SignedStore(store, sign_key), prefix, dead_after_s
        self.sites, self.me = list(sites), me  # `me`: the observing site, alive whatever its key says
        self.seen: dict[int, tuple[int, float]] = {}  # site -> (newest stamp, local time it was accepted)
        self.absent: dict[int, float] = {}  # site -> local time its beat was first found missing
        self.left: set[int] = set()

    def poll(self) -> None:
        now = time.monotonic()
        for site in self.sites:
            value, present = self.store.lookup(heartbeat_key(self.prefix, site))
            stamp = beat_stamp(value)
            newer = stamp is not None and (site not in self.seen or stamp > self.seen[site][0])
            if self.store.check([leave_key(self.prefix, site)]):
                self.left.add(site)
                if newer and stamp is not None:  # its last beat (it stops beating first): only a later one is news
                    self.seen[site] = (stamp, now)
                continue
            if site in self.left and not newer and site != self.me:  # (this site knows it came back)
                continue  # it restarts (deleting its notice): gone until a newer beat
            self.left.discard(site)
            if stamp is None:
                if present and site not in self.seen:
                    continue  # a refused beat of a site never seen: no sign that it exists at all
                self.absent.setdefault(site, now)  # not written yet (or refused): no news until it is
                continue
            self.absent.pop(site, None)
            if newer:  # only a newer beat: a replayed older one is no sign of life
                self.seen[site] = (stamp, now)

    def alive(self) -> set[int]:
        """Sites with news within dead_after_s: a newer beat, or their key found missing (a site not
        started yet counts from when it was first found missing). This site itself is always alive."""
        now, me = time.monotonic(), {self.me} - self.left if self.me is not None else set()
        return me | {s for s in self.sites if s not in self.left and now - self.last_news(s) < self.dead_after_s}

    def last_news(self, site: int) -> float:
        """When `site` last gave news, on this site's clock (-inf: never polled)."""
        times = [self.seen[site][1]] if site in self.seen else []
        return max(times + ([self.absent[site]] if site in self.absent else []), default=float("-inf"))


class LeaseLiveness(Presence):
    """Liveness from etcd's leases: a site is alive while its presence key exists and verifies
    (`LeaseHeartbeat` keeps it; etcd deletes it when the lease ends), so a missing key is a death,
    at once; this site is alive to itself."""

    def __init__(self, store: EtcdStore, prefix: str, sites: Iterable[int], dead_after_s: float,
                 sign_key: bytes | None = None, me: int | None = None) -> None:
        self.etcd, self.store, self.prefix = store, SignedStore(store, sign_key), prefix
        self.sites, self.me, self.dead_after_s = list(sites), me, dead_after_s
        self.left: set[int] = set()  # a leaver revokes its lease: gone like a dead site, no notice needed
        self.present: set[int] = set()

    def poll(self) -> None:
        keys = [heartbeat_key(self.prefix, s) for s in self.sites]
        values = self.etcd.read_many(keys)
        self.present = {s for s, k, raw in zip(self.sites, keys, values)
                        if raw is not None and self.store.open(k, raw) is not None}

    def alive(self) -> set[int]:
        return self.present | ({self.me} if self.me is not None else set())

    def wait(self) -> None:
        self.etcd.wait_change(self.prefix, WATCH_S)
