"""Seconds per part of an outer step: cheap timers whose totals travel as structured fields.

`parts("encode")` around a piece of work adds its wall seconds to `parts.seconds["encode"]`
(one perf_counter pair, ~0.2 us). The outer step hands the dict on in OuterStats.timings, which
metrics.jsonl records and scripts/bench_step.py read; parts never nest, so they add up.

`parts.cpu()` around a thread's share of the step adds that thread's CPU seconds to
`seconds["cpu_user"]` and `seconds["cpu_sys"]` (not parts: they overlap the wall parts). User
time is the step's own computing; a wall part also counts time the thread sat preempted, e.g.
by the transport's threads copying socket data when there are fewer cores than busy threads.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

CPU_KEYS = ("cpu_user", "cpu_sys")


def thread_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of the calling thread (the process's where threads are not told apart)."""
    usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return usage.ru_utime, usage.ru_stime


class Parts:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - t0)

    @contextmanager
    def cpu(self) -> Iterator[None]:
        before = thread_cpu()
        try:
            yield
        finally:
            for key, t0, t1 in zip(CPU_KEYS, before, thread_cpu()):
                self.add(key, t1 - t0)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds


def summed(timings: list[dict[str, float]]) -> dict[str, float]:
    """Seconds per part added over several steps' (or lanes', or fragments') timings."""
    parts = Parts()
    for t in timings:
        for part, seconds in t.items():
            parts.add(part, seconds)
    return parts.seconds
