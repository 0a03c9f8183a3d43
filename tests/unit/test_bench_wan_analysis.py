"""scripts/bench_wan.py's analysis of fragments rows (pure functions over records and counter samples)."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_wan

    return bench_wan


def _records(h: int, fragments: int, rounds: int) -> list[dict]:
    out = [{"kind": "train", "step": s, "time": float(s)} for s in range(1, h * rounds + 1)]
    for s in range(1, h * rounds + 1):
        if s % (h // fragments) == 0:
            out.append({"kind": "outer", "step": s, "outer_step_s": 0.5, "allreduce_s": 0.25, "payload_bytes": 100})
    return out


def test_a_round_adds_every_fragment_sync(bench):
    rounds = bench.site_rounds(_records(8, 4, 3), 8, False)
    assert [(r["W"], r["O"], r["A"], r["payload"]) for r in rounds] == [(8.0, 2.0, 1.0, 400)] * 2
    whole = bench.site_rounds(_records(8, 1, 3), 8, False)
    assert [(r["O"], r["payload"]) for r in whole] == [(0.5, 100)] * 2


def test_peak_counts_the_busiest_second_inside_the_steady_rounds(bench):
    # 100 B/s steadily, and a burst of 1000 B between t = 10.0 and 10.5
    samples = [(t / 10, int(10 * t + (1000 if t >= 105 else 0 if t <= 100 else 200 * (t - 100))), 0)
               for t in range(0, 300)]
    rounds = [{"t0": 5.0, "t1": 20.0}]
    assert bench.peak_tx(samples, rounds) == pytest.approx(1100, rel=0.02)
    assert bench.peak_tx(samples, [{"t0": 12.0, "t1": 20.0}]) == pytest.approx(100, rel=0.02)


def test_sync_wire_counts_the_outer_steps_and_not_the_chatter_between_them(bench):
    # chatter 50 B/s all along; a 2000-byte burst in each of two outer steps (ending at t = 10 and 20, 1 s long)
    def tx(t: float) -> float:
        burst = sum(2000 * min(1.0, max(0.0, t - (end - 1.0))) for end in (10.0, 20.0))
        return 50 * t + burst

    samples = [(i / 50, int(tx(i / 50)), 0) for i in range(0, 1500)]
    records = [{"kind": "outer", "step": s, "time": end, "outer_step_s": 1.0} for s, end in ((8, 10.0), (16, 20.0))]
    got = bench.sync_wire(samples, records, {"t0": 5.0, "t1": 20.0}, chatter=50.0)
    assert got == pytest.approx(4000, abs=20)  # the round's payload; 15 s of chatter (750 B) left out
