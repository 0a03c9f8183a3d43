"""Liveness without a leader: every site bumps its own counter in the store; everyone watches.

A site's rank 0 runs `Heartbeat` on its own thread and its own store connection, so a long inner
step never delays it, while a hung (SIGSTOP) or partitioned site stops bumping. Observers use
`Liveness`, which remembers, on its own clock, when each counter last changed: no clock is shared
between sites, so skew cannot fake a death. A site that leaves on purpose writes `leave/<site>`
and is dead at once, without waiting for `dead_after_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist

log = logging.getLogger(__name__)


def heartbeat_key(prefix: str, site: int) -> str:
    return f"{prefix}hb/{site}"


def leave_key(prefix: str, site: int) -> str:
    return f"{prefix}leave/{site}"


class Heartbeat:
    def __init__(self, open_client: Callable[[], dist.Store], prefix: str, site: int, interval_s: float) -> None:
        self.open_client, self.key, self.interval_s = open_client, heartbeat_key(prefix, site), interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zeroband-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def _run(self) -> None:
        store = self.open_client()
        while not self.stopped.is_set():
            try:
                store.add(self.key, 1)
            except Exception as e:  # a store hiccup must not kill the thread: the next beat retries
                log.warning("heartbeat %s failed: %s", self.key, e)
            self.stopped.wait(self.interval_s)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5 * self.interval_s + 5)


class Liveness:
    """Which sites are alive, as seen from here."""

    def __init__(self, store: dist.Store, prefix: str, sites: Iterable[int], dead_after_s: float) -> None:
        self.store, self.prefix, self.dead_after_s = store, prefix, dead_after_s
        self.sites = list(sites)
        self.seen: dict[int, tuple[int, float]] = {}  # site -> (counter, local time it last changed)
        self.left: set[int] = set()

    def poll(self) -> None:
        now = time.monotonic()
        for site in self.sites:
            # not latched: a site that left and later restarts deletes its leave key and is back
            if self.store.check([leave_key(self.prefix, site)]):
                self.left.add(site)
                continue
            self.left.discard(site)
            count = self.store.add(heartbeat_key(self.prefix, site), 0)
            if count and (site not in self.seen or self.seen[site][0] != count):
                self.seen[site] = (count, now)

    def alive(self) -> set[int]:
        now = time.monotonic()
        return {s for s, (_, t) in self.seen.items() if s not in self.left and now - t < self.dead_after_s}

    def dead_among(self, sites: Iterable[int]) -> set[int]:
        self.poll()
        return set(sites) - self.alive()
