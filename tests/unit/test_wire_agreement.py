"""Honest sites agree on what they sent, in every wire format and both outer modes (issue 28 item 1).

The agreement check (comm/reduce.py `disputes`) compares a source's statistics of the bytes it sent
with the owner's statistics of the bytes it received. Unit tests: the two measurements of real
encoded chunks agree under `measurements_agree` in every wire format, whichever kernels each side
runs, with exactly-zero rows, an all-zero chunk and values whose squares underflow fp32, while a
small lie does not; exclusions say what happened. Integration: 2 sites x 1 rank train with a padded
vocabulary (rows with exactly zero gradients) in every format and mode and end bitwise identical.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from zeroband.comm.kernels import STATS_BLOCK
from zeroband.comm.reduce import (
    FP32_MAX,
    declared_exclusions,
    disputes,
    measurements_agree,
    sent_exclusions,
    stat_tolerance,
    wire_codec,
)

WIRES = ["fp32", "bf16", "fp16", "int8", "int4", "sparse"]

IMPLS = [("native", "native"), ("eager", "eager"), ("native", "eager"), ("eager", "native")]


def padded_gradient(n: int = 1 << 20) -> torch.Tensor:
    """Like a padded-vocabulary gradient: heavy-tailed values, a few large ones first, a third of the
    rows exactly zero (unused tokens), a stretch of values so small their squares underflow fp32. A
    single fp32 norm of it is ~1e-4 off, which the old fixed tolerance could not absorb."""
    g = torch.Generator().manual_seed(28)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(6) * 1e-2
    x[:8] = 1.0
    x[n // 3 : 2 * n // 3] = 0.0
    x[2 * n // 3 : 2 * n // 3 + 5000] = 3e-24
    return x


def measure(wire: str, x: torch.Tensor, sender: str, owner: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(what the source says it sent, what the owner says it received): each side's [sum of squares,
    non-finite count] of one encoded chunk, the source on `sender` kernels, the owner on `owner`'s."""
    codec, n = wire_codec(wire), x.numel()
    sent, seen = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    monkeypatch.setenv("ZEROBAND_KERNELS", "eager" if sender == "eager" else "auto")
    buf = codec.encode(x, scratch=torch.empty(n), weight=0.5, stats=sent)
    monkeypatch.setenv("ZEROBAND_KERNELS", "eager" if owner == "eager" else "auto")
    codec.add_decoded(torch.empty(n), buf, n, True, torch.empty(n), seen)
    return sent, seen


@pytest.mark.parametrize("wire", WIRES)
def test_honest_measurements_of_the_same_bytes_agree(wire, monkeypatch):
    """Every wire format, every pairing of kernels (sites may differ): the source's and the owner's
    statistics of the same chunk agree, so `disputes` finds nobody; with zero rows, an all-zero chunk
    (exactly 0 on both sides) and tiny values; a 0.1% lie about the same numbers is a dispute."""
    cases = {"padded": padded_gradient(), "zeros": torch.zeros(5000), "tiny": torch.full((4099,), 1e-22)}
    for name, x in cases.items():
        for sender, owner in IMPLS:
            sent, seen = measure(wire, x, sender, owner, monkeypatch)
            what = f"{wire} {name} {sender}->{owner}: sent {sent.tolist()} seen {seen.tolist()}"
            assert seen[1] == sent[1] == 0 and measurements_agree(float(seen[0]), float(sent[0]), x.numel()), what
            # site 1 owns the chunk site 0 sent; the (0, 1) pair agrees trivially
            owners, senders = torch.zeros(2, 2, 2, dtype=torch.float64), torch.zeros(2, 2, 2, dtype=torch.float64)
            owners[1, 0], senders[0, 1] = seen, sent
            assert disputes(owners, senders, x.numel()) == [], what
            if name == "padded":
                senders[0, 1, 0] *= 1 + 1e-3
                assert disputes(owners, senders, x.numel()) == [(1, 0)], what
    assert cases["zeros"].abs().sum() == 0  # nothing above mutated the inputs


def test_agreement_tolerance_is_tight_and_handles_zero_and_overflow():
    """The bound follows from the measurement's arithmetic: ~2.4e-4 relative whatever the length
    (kernels.c and value_stats sum blocks of the same size), an absolute floor only at fp32's
    underflow scale, so a claimed 0 for a real norm, a 0.1% lie or a NaN vs a number is a dispute."""
    assert re.search(rf"#define BLOCK {STATS_BLOCK}\b", (Path(__file__).parents[2] / "zeroband/comm/kernels.c").read_text())
    rel, floor = stat_tolerance(10**9)
    assert 2.4e-4 < rel < 2.6e-4 and floor < 1e-35
    n = 1 << 20
    assert measurements_agree(0.0, 0.0, n) and measurements_agree(0.0, 1e-42, n)  # underflow noise only
    assert not measurements_agree(0.0, 1e-30, n) and not measurements_agree(1e-20, 0.0, n)
    assert measurements_agree(1.0, 1.0 + 4e-4, n) and not measurements_agree(1.0, 1.001, n)
    assert measurements_agree(math.nan, math.nan, n) and not measurements_agree(math.nan, 1.0, n)
    assert measurements_agree(math.inf, FP32_MAX, n) and not measurements_agree(math.inf, 1e30, n)


def test_exclusions_say_what_happened():
    """Each exclusion names its cause: declared NaN/inf, an outlier norm, or bytes that do not match
    what the site declared (a liar's huge payload); an abstaining site is not an exclusion."""
    # columns: sumsq, nonfinite, abstain, tokens, crc, weight
    table = torch.tensor([[1.0, 0, 0, 0, -1, 1], [1.2, 0, 0, 0, -1, 1], [1e6, 0, 0, 0, -1, 1], [0.0, 3, 0, 0, -1, 1],
                          [0.0, 0, 1, 0, -1, 1]], dtype=torch.float64)
    why = declared_exclusions(table, outlier_factor=10.0)
    assert sorted(why) == [2, 3] and why[3].startswith("non-finite") and why[2].startswith("outlier")
    claims, use, w = table[:3, :2], [True] * 3, [1 / 3] * 3
    sent = torch.tensor([[1 / 9, 0], [0.1, 0], [1e6, 0]], dtype=torch.float64)
    liar = torch.tensor([[1.0, 0], [1.2, 0], [1.0, 0]], dtype=torch.float64)  # site 2 declares 1, sends 1e6
    why = sent_exclusions(liar, use, w, sent, values=100)
    assert list(why) == [2] and why[2].startswith("statistics do not match the bytes")
    sent[1, 1] = 7
    assert sent_exclusions(claims, use, w, sent, values=100)[1] == "non-finite: sent 7 NaN/inf values"
    zero = torch.zeros(3, 2, dtype=torch.float64)  # all-zero pseudo-gradients: nobody is judged on 0
    assert sent_exclusions(zero, use, w, zero, outlier_factor=10.0, values=100) == {}
