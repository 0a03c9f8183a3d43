"""Seconds per part of an outer step: cheap timers whose totals travel as structured fields.

`parts("encode")` around a piece of work adds its wall seconds to `parts.seconds["encode"]`
(one perf_counter pair, ~0.2 us). The outer step hands the dict on in OuterStats.timings, which
metrics.jsonl records and scripts/bench_step.py read; parts never nest, so they add up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


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

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds
