"""Every cross-site wait ends within its timeout, says what it waits for, and logs while it waits.

Why a thread: gloo cannot wait in short slices. `Work.wait(timeout)` that expires closes the pair
for good ("Application timeout caused pair closure"), and `Work.is_completed()` never turns true
unless someone waits (both measured on torch 2.13). So the blocking work runs on a helper thread,
which notes before each wait whom it waits for (`Watch.wait`); the caller polls that thread
(`Watch.join`): a log line every `log_every_s` ("waiting 10 s for site 1 (all-gather piece 3)"),
and at the deadline `PeerTimeout` naming the same. The abandoned thread is bounded too: the
group's own gloo timeout ends it.

SIGTERM: a Python handler runs only on the main thread between bytecodes, never inside a gloo
wait. `request_stop()` (called by train.py's SIGTERM handler) shortens every interruptible watch
to `STOP_GRACE_S`, so a site blocked on a frozen peer stops within seconds, while an exchange
that is merely slow still gets a few seconds to finish.

Store waits (`wait_keys`) poll `store.check`, so they need no thread.

Every such log line reads "waiting N s for <site K | what> (...)": `zeroband launch` finds them in
the site logs (`zeroband.tools.launch.WAIT_LINE`) and shows them on its terminal as they happen.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

log = logging.getLogger(__name__)


class Work(Protocol):
    """A pending operation (torch's c10d Work, comm/transport.py's): `wait` blocks until it completed or raises."""

    def wait(self, timeout: Any = ...) -> bool: ...


T = TypeVar("T")

LOG_EVERY_S = 10.0
POLL_S = 0.1
STOP_GRACE_S = 5.0
_STOP = threading.Event()


class PeerTimeout(TimeoutError):
    """A cross-site wait ran out of time; the message names the phase and the peer."""


class PeerLost(ConnectionError):
    """The transport failed while waiting on a peer (connection reset or closed, gloo's own timeout)."""


class TransportError(PeerLost):
    """A connection of the cross-site transport failed (comm/transport.py); the watcher adds the phase."""


class TransportTimeout(PeerTimeout):
    """A transport operation outlived the group's timeout (comm/transport.py)."""


class Interrupted(RuntimeError):
    """SIGTERM arrived while this site was blocked waiting on a peer."""


def request_stop() -> None:
    """Called from a SIGTERM handler: interruptible watches end within STOP_GRACE_S."""
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def clear_stop() -> None:
    _STOP.clear()


class Watch:
    """What one cross-site worker is blocked on, and the watcher that bounds it.

    `interruptible`: SIGTERM ends the wait (fixed groups); elastic sites finish their round on
    SIGTERM and leave, so their watch ignores it. `check`: what the group's owner checks while any
    of its waits runs (elastic: a member seen dead, the attempt aborted), where a call names none.
    """

    def __init__(self, timeout_s: float, log_every_s: float = LOG_EVERY_S, interruptible: bool = True) -> None:
        self.timeout_s, self.log_every_s, self.interruptible = timeout_s, log_every_s, interruptible
        self.current = "the exchange to start"
        self.bound: tuple[float, str] | None = None  # the current wait's own bound (seconds, how it was derived)
        self.bound_end = math.inf  # when it runs out (monotonic)
        self.check: Callable[[], None] | None = None

    def wait(self, work: Work, peer: int | str, phase: str, bound: tuple[float, str] | None = None) -> None:
        """On the worker thread: note whom we wait for, then wait, bounded by the group's timeout and
        by `bound` where the link was measured (comm/link.py wait_bound; `join` enforces it too)."""
        self.current = f"{_who(peer)} ({phase})"
        self.bound, self.bound_end = bound, math.inf if bound is None else time.monotonic() + bound[0]
        if bound is None:
            work.wait()
            return
        work.wait(timedelta(seconds=bound[0]))
        self.bound, self.bound_end = None, math.inf  # kept after a failure: the error names it

    def run(self, fn: Callable[[], T], what: str, check: Callable[[], None] | None = None) -> T:
        """fn() on a helper thread, watched from here (see `join`)."""
        box: dict[str, Any] = {}
        self.bound, self.bound_end = None, math.inf  # an earlier failed wait's bound is not this run's

        def target() -> None:
            try:
                box["result"] = fn()
            except BaseException as e:  # re-raised by the watcher
                box["error"] = e

        thread = threading.Thread(target=target, name=f"zeroband-watched-{what}", daemon=True)
        thread.start()
        start = time.monotonic()
        self.join(thread, what, check)
        if "error" in box:
            raise self._named(box["error"], what, time.monotonic() - start)
        return box["result"]

    def _named(self, error: BaseException, what: str, elapsed: float) -> BaseException:
        """gloo's and the transport's errors say neither the phase nor the site: name both (others pass
        unchanged)."""
        if isinstance(error, TransportTimeout):
            return self._timeout(what, elapsed) if self.bound is None else self._stalled(what)
        if isinstance(error, TransportError):
            return PeerLost(f"{what}: lost {self.current}: {error}")
        text = str(error).strip()
        if not isinstance(error, RuntimeError) or "gloo" not in text:
            return error
        first = text.splitlines()[0].split("] ", 1)[-1]  # drop the C++ source location
        if "Timed out" in text:
            return self._timeout(what, elapsed)
        return PeerLost(f"{what}: lost {self.current}: {first}")

    def _timeout(self, what: str, elapsed: float) -> PeerTimeout:
        return PeerTimeout(f"{what}: no answer from {self.current} after {elapsed:.0f} s "
                           f"(sites.timeout_s={self.timeout_s:g}); that site is frozen, dead or unreachable")

    def _stalled(self, what: str) -> PeerTimeout:
        seconds, why = self.bound or (self.timeout_s, "")
        return PeerTimeout(f"{what}: no answer from {self.current} within {seconds:.1f} s (link bound: {why}; "
                           f"sites.timeout_s={self.timeout_s:g}); that site is frozen, dead or unreachable")

    def join(self, thread: threading.Thread, what: str, check: Callable[[], None] | None = None) -> None:
        """Wait for `thread`, logging every log_every_s; `check` (else `self.check`) may raise to give up early."""
        check = check or self.check
        start = time.monotonic()
        deadline, next_log = start + self.timeout_s, start + self.log_every_s
        while thread.is_alive():
            thread.join(POLL_S)
            if not thread.is_alive():
                return
            now = time.monotonic()
            if check is not None:
                check()
            if self.interruptible and _STOP.is_set():
                if deadline - now > STOP_GRACE_S:
                    log.warning("SIGTERM during %s: giving the wait for %s %.0f s more", what, self.current,
                                STOP_GRACE_S)
                    deadline = now + STOP_GRACE_S
                elif now >= deadline:
                    raise Interrupted(f"SIGTERM while {what} waited {now - start:.0f} s for {self.current}")
            if now >= self.bound_end + POLL_S:  # the worker's own wait ends at bound_end: this is a backstop
                raise self._stalled(what)
            if now >= deadline:
                raise PeerTimeout(f"{what}: no answer from {self.current} after {now - start:.0f} s "
                                  f"(sites.timeout_s={self.timeout_s:g}); that site is frozen, dead or unreachable")
            if now >= next_log:
                log.warning("waiting %.0f s for %s during %s", now - start, self.current, what)
                next_log = now + self.log_every_s


def _who(peer: int | str) -> str:
    return f"site {peer}" if isinstance(peer, int) else peer


def wait_keys(store: dist.Store, keys: Mapping[int, str], what: str, timeout_s: float,
              log_every_s: float = LOG_EVERY_S, check: Callable[[set[int]], None] | None = None) -> None:
    """Wait until every site's key is in the store; logs and names the missing sites.

    `check(missing)` runs on every poll and may raise to end the wait early with a better reason.
    """
    start = time.monotonic()
    next_log = start + log_every_s
    while True:
        if store.check(list(keys.values())):  # one round trip for all: a key each costs one per site
            return
        now = time.monotonic()
        if check is None and now - start < timeout_s and now < next_log:
            time.sleep(POLL_S if now - start > 1.0 else 0.01)
            continue  # who is missing matters only to `check`, the log and the timeout
        missing = {site for site, key in keys.items() if not store.check([key])}
        if not missing:
            return
        if check is not None:
            check(missing)
        now = time.monotonic()
        if now - start >= timeout_s:
            raise PeerTimeout(f"{what}: {_sites(missing)} did not arrive within {timeout_s:g} s "
                              f"(sites.timeout_s); is it running, with the same sites.store and run name?")
        if now >= next_log:
            log.warning("waiting %.0f s for %s (%s)", now - start, _sites(missing), what)
            next_log = now + log_every_s
        time.sleep(POLL_S if now - start > 1.0 else 0.01)


HOST_LINGER_S = 3.0


def read_by_all(store: dist.Store, prefix: str, site: int, sites: int, timeout_s: float) -> None:
    """Before raising on something every site read from the store: wait (bounded, best effort) until
    every site has read it too, since the store may live in a site's process and go with it."""
    keys = {s: f"{prefix}read-by/{s}" for s in range(sites)}
    try:
        store.set(keys[site], "1")
        wait_keys(store, keys, "the other sites to read the same values", min(timeout_s, 30.0))
        if site == 0:  # site 0 usually hosts the store: give the others time to finish with it (leave, cleanup)
            time.sleep(min(timeout_s, HOST_LINGER_S))
    except Exception:  # the error about to be raised says more than this one would
        pass


class Ticker:
    """For a polling loop that is bounded on its own: a log line every log_every_s while it waits."""

    def __init__(self, what: str, log_every_s: float = LOG_EVERY_S) -> None:
        self.what, self.log_every_s = what, log_every_s
        self.start = time.monotonic()
        self.next_log = self.start + log_every_s

    def tick(self, waiting_for: str) -> None:
        now = time.monotonic()
        if now >= self.next_log:
            log.warning("waiting %.0f s for %s (%s)", now - self.start, waiting_for, self.what)
            self.next_log = now + self.log_every_s


def _sites(sites: set[int]) -> str:
    ordered = sorted(sites)
    return f"site {ordered[0]}" if len(ordered) == 1 else f"sites {ordered}"
