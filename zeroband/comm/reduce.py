"""One entry point for averaging pseudo-gradients across sites, whatever the wire format.

`reduce_across_sites` exchanges per-site statistics first (a few bytes: sum of squares, NaN/inf
count, largest magnitude over the whole site), decides on every site alike which sites
contribute, then all-reduces the payload in the configured format:

| wire  | payload / param | how |
|-------|-----------------|-----|
| fp32  | 4 bytes   | raw values (comm/dense.py) |
| bf16  | 2 bytes   | raw values |
| fp16  | 2 bytes   | power-of-two scale per message, then the values |
| int8  | ~1.02     | per-block bf16 scales + int8 codes (comm/quantized.py) |
| int4  | ~0.53     | per-block bf16 scales + NF4 codes |

All formats travel by the same pipelined direct reduce-scatter + all-gather with fp32
accumulation (comm/direct.py), so every site ends bitwise identical, and the link is kept busy
instead of waiting a round trip per segment as gloo's ring all-reduce does.

Only the global group is used here, never the site group, so this can run on a background thread
while the main thread's FSDP collectives go on (the overlapped outer step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeroband.comm.dense import DenseCodec
from zeroband.comm.direct import DirectExchange, WireCodec, flatten
from zeroband.comm.quantized import DEFAULT_BLOCK, Codec
from zeroband.mesh import GlobalGroup

QUANTIZED_BITS = {"int8": 8, "int4": 4}
STAT_COLUMNS = ("sumsq", "nonfinite", "max_abs", "abstain", "tokens")


@dataclass
class SiteStats:
    """This site's pseudo-gradient statistics, already reduced over the site's ranks."""

    sumsq: float
    nonfinite: float
    max_abs: float
    abstain: bool = False  # takes part in the collective but contributes nothing (e.g. a joiner)
    tokens: float = 0.0  # tokens this site trained on since the last outer step

    def as_list(self) -> list[float]:
        return [self.sumsq, self.nonfinite, self.max_abs, float(self.abstain), self.tokens]


@dataclass
class ReduceResult:
    payload_bytes: int  # this rank's contribution before the collective
    wire_bytes: int  # what this rank sent: 2(S-1)/S of the encoded payload
    sites_used: int
    excluded_sites: list[int] = field(default_factory=list)
    site_norms: list[float] = field(default_factory=list)


def contributing_sites(table: torch.Tensor, outlier_factor: float = 0.0) -> list[bool]:
    """Which sites' pseudo-gradients enter the average; columns as STAT_COLUMNS.

    Excluded: a site that abstains, a site with any NaN/inf, and (with `outlier_factor` > 0 and at
    least 3 candidates) a site whose norm exceeds `outlier_factor` x the median norm of the other
    candidates: one broken or malicious site cannot drag the average far. The decision depends
    only on the table, which is identical on every site, so every site decides the same.
    """
    use = [bool(table[s, 1] == 0 and table[s, 3] == 0 and torch.isfinite(table[s, 0])) for s in range(table.shape[0])]
    candidates = [s for s, ok in enumerate(use) if ok]
    if outlier_factor > 0 and len(candidates) >= 3:
        norms = table[:, 0].sqrt()
        for s in candidates:
            others = torch.stack([norms[o] for o in candidates if o != s])
            if norms[s] > outlier_factor * others.median():
                use[s] = False
    return use


def site_weight(table: torch.Tensor, use: list[bool], me: int, by_tokens: bool) -> float:
    """This site's share of the average: 1/n, or its tokens over all contributors' tokens."""
    if not use[me]:
        return 0.0
    if by_tokens:
        total = sum(float(table[s, 4]) for s, ok in enumerate(use) if ok)
        return float(table[me, 4]) / total if total > 0 else 1.0 / sum(use)
    return 1.0 / sum(use)


def wire_codec(wire: str) -> WireCodec:
    if wire in QUANTIZED_BITS:
        bits = QUANTIZED_BITS[wire]
        return Codec(bits, DEFAULT_BLOCK[bits])
    return DenseCodec(wire)


def reduce_across_sites(
    grads: list[torch.Tensor],
    stats: SiteStats,
    group: GlobalGroup,
    wire: str,
    bucket_bytes: int,
    error_feedback: dict[int, torch.Tensor] | None = None,
    outlier_factor: float = 0.0,
    weight_by_tokens: bool = False,
) -> ReduceResult:
    """In place: grads <- mean over contributing sites. Returns what it cost and who took part."""
    codec = wire_codec(wire)
    numel = sum(g.numel() for g in grads)
    exchange = DirectExchange(numel, group, codec, max(1, bucket_bytes // 4))  # receives posted first
    table_ready = group.post_scalars(stats.as_list())
    flat = flatten(grads)  # meanwhile: CPU work that does not depend on the table
    table = table_ready()
    use = contributing_sites(table, outlier_factor)
    n = sum(use)
    weight = site_weight(table, use, group.rank, weight_by_tokens)
    wire_bytes = exchange.run(grads, weight, error_feedback, flat)
    payload = codec.nbytes(numel) - codec.header  # a per-message header is wire bytes, not payload
    return ReduceResult(
        payload_bytes=payload,
        wire_bytes=wire_bytes,
        sites_used=n,
        excluded_sites=[s for s, ok in enumerate(use) if not ok and table[s, 3] == 0],
        site_norms=[float(v) for v in table[:, 0].sqrt()],
    )
