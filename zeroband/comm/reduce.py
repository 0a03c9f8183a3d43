"""One entry point for averaging pseudo-gradients across sites, whatever the wire format.

`reduce_across_sites` exchanges per-site statistics first (a few bytes: sum of squares, NaN/inf
count, largest magnitude over the whole site), decides on every site alike which sites
contribute, then all-reduces the payload in the configured format. What a site says about itself
is only a first filter: before any sum is shared, each chunk owner measures what every source
actually sent, the owners share that table, and every site rejects alike a source that sent
NaN/inf, more than it declared, or an outlier (`verified_sites`). So a site lying in its
statistics cannot get huge or NaN values into the average.

| wire  | payload / param | how |
|-------|-----------------|-----|
| fp32  | 4 bytes   | raw values (comm/dense.py) |
| bf16  | 2 bytes   | raw values |
| fp16  | 2 bytes   | power-of-two scale per message, then the values |
| int8  | ~1.02     | per-block bf16 scales + int8 codes (comm/quantized.py) |
| int4  | ~0.53     | per-block bf16 scales + NF4 codes |
| sparse | ~0.036   | per 4096 values the top 2% at 2 bits + 12-bit indices (comm/codecs/sparse.py) |

Each format is one file of comm/codecs/ (its registry: bytes per parameter, error feedback, exchange).

The formats travel by the same pipelined direct reduce-scatter + all-gather with fp32
accumulation (comm/direct.py), sparse by an all-gather of every site's encoding summed in site order
on every site (comm/gather.py), so every site ends bitwise identical, and the link is kept busy
instead of waiting a round trip per segment as gloo's ring all-reduce does.

Only the global group is used here, never the site group, so this can run on a background thread
while the main thread's FSDP collectives go on (the overlapped outer step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroband import seams
from zeroband.comm import codecs
from zeroband.comm.dense import FP32_MAX
from zeroband.comm.direct import Arena, DirectExchange, WireCodec, flatten
from zeroband.comm.gather import GatherExchange
from zeroband.comm.group import GlobalGroup
from zeroband.comm.kernels import STATS_BLOCK
from zeroband.comm.timing import Parts
from zeroband.trust.auth import TrustError

STAT_COLUMNS = ("sumsq", "nonfinite", "abstain", "tokens", "crc", "weight")
SUMSQ, NONFINITE, ABSTAIN, TOKENS, CRC, WEIGHT = range(len(STAT_COLUMNS))  # their indices in a stats table
# A source may send at most this multiple of the norm it declared (quantisation moves a norm by a
# few percent at most; NF4's coarsest rounding by well under 2x).
CLAIM_SLACK = 4.0
FP32_UNIT = 2.0**-24  # fp32's unit roundoff: one rounding moves a value by at most this fraction
FP64_UNIT = 2.0**-53
FP32_UNDERFLOW = 2.0**-150  # half fp32's smallest subnormal: the most a square or a sum loses below fp32's range

# How far apart two honest measurements of the same bytes can be (`disputes`). The source measures
# what it sent while encoding, the owner what it received while decoding: statistics of the SAME
# decoded values, so the wire format's own rounding (bf16's 8 and fp16's 11 mantissa bits, the
# int8/int4 quantisation steps) happened before either side measures and does not enter the
# comparison; exactly-zero values (unused vocabulary rows) add exact zeros. What differs is only the
# measurement's arithmetic (kernels.c or torch, vector width, thread count: sites may differ), which
# both implementations share: each square rounded to fp32, summed in fp32 in groups of at most
# STATS_BLOCK values in any order, the groups added in float64 (kernels.c, kernels.value_stats). A sum
# of m non-negative terms in any order is within (m - 1) roundings of the exact sum, so one side is
# within rel = (STATS_BLOCK + 3) u32 + (values + 64) u64 (~2.4e-4) of the exact S, plus, where
# squares fall below fp32's range (|v| < 2**-63), FP32_UNDERFLOW per square and per add. The old
# check took one fp32 norm over a whole chunk (its error grows with the length: 2.7e-4 at 3.5M
# values) and a fixed 1e-4: honest fp32/bf16 sites accused each other (issue 28).
# A liar gains nothing inside this: 5e-4 of a sum of squares, where every decision built on these
# numbers (CLAIM_SLACK, outlier_factor) has margins of 100% and more.


def stat_tolerance(values: int) -> tuple[float, float]:
    """(relative, absolute) bound on how far one honest measurement of the sum of squares of
    `values` fp32 values lies from the exact sum."""
    return (STATS_BLOCK + 3) * FP32_UNIT + (values + 64) * FP64_UNIT, 2 * values * FP32_UNDERFLOW


def measurements_agree(a: float, b: float, values: int) -> bool:
    """Whether two honest measurements of the sum of squares of the same `values` fp32 values can be
    `a` and `b` (module comment above `stat_tolerance`). Pure."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    rel, floor = stat_tolerance(values)
    if math.isinf(a) or math.isinf(b):  # a group's fp32 sum past fp32's range overflows in one order, not another
        return min(a, b) >= FP32_MAX * (1 - 2 * rel)
    return abs(a - b) <= 2 * (rel * max(abs(a), abs(b)) / (1 - rel) + floor)


def norm_floor(values: int) -> float:
    """What underflow can hide from the norm of `values` fp32 values (their squares below fp32's
    range measure as 0): an absolute slack for rules that compare norms, so an all-but-zero
    pseudo-gradient is never judged by a relative rule on 0."""
    return math.sqrt(4 * values * FP32_UNDERFLOW)


class ReplicaMismatch(TrustError):
    """Sites entered an outer step with different outer states: they diverged."""


class PeerMisbehaved(TrustError):
    """A site's messages contradict each other: it lied about what it received, or shared a sum
    that its inputs cannot add up to. Raised alike on every site that can see it."""


@dataclass
class SiteStats:
    """This site's pseudo-gradient statistics, already reduced over the site's ranks."""

    sumsq: float
    nonfinite: float
    abstain: bool = False  # takes part in the collective but contributes nothing (e.g. a joiner)
    tokens: float = 0.0  # tokens this site trained on since the last outer step
    crc: float = -1.0  # crc32 of the outer state entering the step (-1: not computed)
    weight: float = 1.0  # what multiplies this site's share: diloco.late_weight for a round's late work

    def as_list(self) -> list[float]:
        return [self.sumsq, self.nonfinite, float(self.abstain), self.tokens, self.crc, self.weight]


@dataclass
class ReduceResult:
    payload_bytes: int  # this rank's contribution before the collective
    wire_bytes: int  # what this rank sent: 2(S-1)/S of the encoded payload ((S-1) x for a gathered codec)
    sites_used: int
    excluded_sites: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)  # the sites (group indices) whose pseudo-gradients the average holds
    timings: dict[str, float] = field(default_factory=dict)  # seconds per part (comm/timing.py)
    sumsq: float | None = None  # sum of squares of this rank's averaged values (None: not measured)
    exclusions: dict[int, str] = field(default_factory=dict)  # excluded site -> what it did, in words
    wait_bound_s: float = 0.0  # longest link-derived bound of the exchange's waits (0: the link was not measured)
    mean_norm: float = 0.0  # the kept sites' mean declared norm (`mean_norm`: what "rda" rescales to)
    lane_sumsq: dict[int, float] = field(default_factory=dict)  # sites of different shapes: by lane (outer/lanes.py)


def _norm(sumsq: float) -> float:
    return math.sqrt(sumsq) if sumsq >= 0 else 0.0 if math.isfinite(sumsq) else math.inf  # NaN/inf: inf


def outliers(norms: dict[int, float], factor: float, floor: float = 0.0) -> dict[int, str]:
    """Among 3+ candidates (site -> norm), those above `factor` x the median of the others' norms
    (+ `floor`), with why; none when `factor` is 0."""
    out: dict[int, str] = {}
    if factor <= 0 or len(norms) < 3:
        return out
    for s, norm in norms.items():
        median = float(torch.tensor([v for o, v in norms.items() if o != s], dtype=torch.float64).median())
        if norm > factor * median + floor:
            out[s] = f"outlier: norm {norm:.3g} is over {factor:g}x the median {median:.3g} of the others'"
    return out


def declared_exclusions(table: torch.Tensor, outlier_factor: float = 0.0) -> dict[int, str]:
    """Sites left out on what they declared (columns as STAT_COLUMNS), with why: any NaN/inf, and (with
    `outlier_factor` > 0 and at least 3 candidates) a norm above `outlier_factor` x the median norm of
    the other candidates, so one broken or malicious site cannot drag the average far. Abstaining
    sites contribute nothing and are not listed; nor is a weight outside (0, 1] taken. Pure: the
    table is identical on every site."""
    present = [s for s in range(table.shape[0]) if table[s, ABSTAIN] == 0]
    out = {s: f"non-finite: declared {float(table[s, NONFINITE]):.0f} NaN/inf values" for s in present
           if table[s, NONFINITE] != 0 or not torch.isfinite(table[s, SUMSQ])}
    # a share is never more than a site's own (a weight above 1 would let one site outweigh the rest)
    out |= {s: f"weight: declared {float(table[s, WEIGHT]):g}, outside (0, 1]" for s in present
            if s not in out and not 0.0 < float(table[s, WEIGHT]) <= 1.0}
    norms = {s: _norm(float(table[s, SUMSQ])) for s in present if s not in out}
    return out | outliers(norms, outlier_factor)


def contributing_sites(table: torch.Tensor, outlier_factor: float = 0.0) -> list[bool]:
    """Which sites' pseudo-gradients enter the average: those that neither abstain nor are excluded
    by `declared_exclusions`. Every site decides the same."""
    out = declared_exclusions(table, outlier_factor)
    return [bool(table[s, ABSTAIN] == 0) and s not in out for s in range(table.shape[0])]


def site_weight(table: torch.Tensor, use: list[bool], me: int, by_tokens: bool, merge: str = "mean") -> float:
    """This site's share of the average: 1/n, or its tokens over all contributors' tokens, each times
    the site's declared weight (1; diloco.late_weight for work late by a round). "rda" divides each
    share by the site's declared norm first (the sum is then one of unit directions; `rda_scale`
    restores the size), a site with a zero pseudo-gradient taking none."""
    if not use[me]:
        return 0.0
    base = [float(table[s, TOKENS]) if by_tokens else 1.0 for s in range(len(use))]
    if not by_tokens or sum(b for b, ok in zip(base, use) if ok) <= 0:
        base = [1.0] * len(use)
    base = [b * float(table[s, WEIGHT]) for s, b in enumerate(base)]
    if merge == "rda":
        norms = [_norm(float(table[s, SUMSQ])) for s in range(len(use))]
        rda = [b / n if n > 0 else 0.0 for b, n in zip(base, norms)]
        if sum(r for r, ok in zip(rda, use) if ok) > 0:
            base = rda
    return base[me] / sum(b for b, ok in zip(base, use) if ok)


def mean_norm(table: torch.Tensor, keep: list[bool], by_tokens: bool) -> float:
    """The norm "rda" rescales the merged direction to: the kept sites' declared norms, averaged with
    their shares of a mean merge (every site computes the same from the same table)."""
    shares = [site_weight(table, keep, s, by_tokens) for s in range(len(keep))]
    return sum(w * _norm(float(table[s, SUMSQ])) for s, w in enumerate(shares) if keep[s])


def rda_scale(target_norm: float, merged_sumsq: float) -> float:
    """What multiplies the merged unit directions (whose site-wide sum of squares is `merged_sumsq`) so
    that their norm is `target_norm`; 1 where there is no direction to scale."""
    merged = _norm(merged_sumsq)
    return target_norm / merged if merged > 0 and math.isfinite(merged) else 1.0


def sent_exclusions(claims: torch.Tensor, use: list[bool], weights: list[float], sent: torch.Tensor,
                    outlier_factor: float = 0.0, values: int = 0) -> dict[int, str]:
    """Sources in `use` whose bytes betray them, with why; `sent[s]` = (sum of squares, non-finite
    count) of what source s sent on this group (its weighted shard), summed over the chunk owners;
    `values`: how many values that covers at most (for `norm_floor`).

    Rejected: any NaN/inf; a norm that could overflow the fp32 sum; a norm above CLAIM_SLACK x the
    site-wide norm it declared (its shard's can only be smaller); with `outlier_factor` and 3+
    candidates, a norm above `outlier_factor` x the median of the others. Pure: every site feeds
    the same tables, so every site rejects the same sources.
    """
    out, norms, floor = {}, {}, norm_floor(values)
    for s in (s for s, ok in enumerate(use) if ok):
        sumsq, nonfinite, w = float(sent[s, 0]), float(sent[s, 1]), weights[s]
        weighted = _norm(sumsq)
        norm = weighted / w if w > 0 else (math.inf if weighted > floor else 0.0)
        declared = _norm(max(float(claims[s, 0]), 0.0))
        if nonfinite or not math.isfinite(sumsq):
            out[s] = f"non-finite: sent {nonfinite:.0f} NaN/inf values"
        elif weighted > FP32_MAX / len(use):
            out[s] = f"sent values of norm {weighted:.3g}, which could overflow the sum"
        elif weighted > w * CLAIM_SLACK * declared * (1 + 1e-6) + (1 + w) * floor:
            out[s] = (f"statistics do not match the bytes: sent a norm of {norm:.3g}, over {CLAIM_SLACK:g}x "
                      f"the {declared:.3g} it declared")
        else:
            norms[s] = norm
    return out | outliers(norms, outlier_factor, floor)


def verified_sites(claims: torch.Tensor, use: list[bool], weights: list[float], sent: torch.Tensor,
                   outlier_factor: float = 0.0, values: int = 0) -> list[bool]:
    """`use`, less the sources `sent_exclusions` rejects."""
    out = sent_exclusions(claims, use, weights, sent, outlier_factor, values)
    return [ok and s not in out for s, ok in enumerate(use)]


def check_replicas(table: torch.Tensor) -> None:
    """Every site that takes part must enter the step with the same outer state (crc column)."""
    crcs = {s: int(table[s, CRC]) for s in range(table.shape[0]) if table[s, CRC] >= 0 and table[s, ABSTAIN] == 0}
    if len(set(crcs.values())) > 1:
        raise ReplicaMismatch(f"sites diverged: checksums of the outer state entering this step are {crcs}")


def disputes(seen: torch.Tensor, sent: torch.Tensor, values: int) -> list[tuple[int, int]]:
    """(owner, source) pairs where what the owner says it received (`seen[owner, source]`) is not
    what the source says it sent (`sent[source, owner]`): both are statistics of the same decoded
    bytes (at most `values` values), so beyond `measurements_agree` they differ only if one lies."""
    size = seen.shape[0]
    out = []
    for c in range(size):
        for s in range(size):
            a, b = seen[c, s], sent[s, c]
            if c != s and (a[1] != b[1] or not measurements_agree(float(a[0]), float(b[0]), values)):
                out.append((c, s))
    return out


def gather_bounds(seen: torch.Tensor, keep: list[bool], scale: float | None, values: int = 0) -> list[float]:
    """Largest norm each owner's shared sum can have: the norms of the kept inputs it saw, added up
    (triangle inequality), rescaled, with room for one rounding of the wire format (and for what
    underflow hid from each measured norm)."""
    floor = norm_floor(values) * (sum(keep) + 1)
    return [CLAIM_SLACK * (scale or 1.0) * sum(_norm(float(seen[c, s, 0])) for s, ok in enumerate(keep) if ok)
            + CLAIM_SLACK * floor + 1e-30 for c in range(seen.shape[0])]


@dataclass
class SentReview:
    """comm/direct.py's Review: judge every source on what it sent, identically on every site."""

    group: GlobalGroup
    claims: torch.Tensor
    use: list[bool]
    weights: list[float]
    outlier_factor: float
    parts: Parts = field(default_factory=Parts)
    values: int = 0  # the exchange's length: bounds how many values any one statistic covers
    keep: list[bool] = field(default_factory=list)
    bounds: list[float] = field(default_factory=list)
    exclusions: dict[int, str] = field(default_factory=dict)

    def decide(self, seen: torch.Tensor, sent: torch.Tensor) -> tuple[list[bool], float | None]:
        size = self.group.size
        with self.parts("network_wait"):
            # a peer may still be receiving this site's scatter: bound as for all of it at fp32 (the most it can be)
            table = self.group.gather_scalars(torch.cat([seen.reshape(-1), sent.reshape(-1)]).tolist(),
                                              nbytes=4 * self.values)
        owners, senders = table[:, : 2 * size].view(size, size, 2), table[:, 2 * size :].view(size, size, 2)
        if bad := disputes(owners, senders, self.values):
            raise PeerMisbehaved("; ".join(f"site {c} says site {s} sent it other values than site {s} says it sent"
                                           for c, s in bad) + ": one of each pair lies, the step cannot be trusted")
        # each owner saw its own chunk: sum the owners' tables, in the same order on every site
        self.exclusions = sent_exclusions(self.claims, self.use, self.weights, owners.sum(dim=0), self.outlier_factor,
                                          self.values)
        self.keep = [ok and s not in self.exclusions for s, ok in enumerate(self.use)]
        scale = None
        if self.keep != self.use:
            kept = sum(w for w, ok in zip(self.weights, self.keep) if ok)
            scale = 1.0 / kept if kept > 0 else 0.0  # the survivors' weights sum to 1 again
        self.bounds = gather_bounds(owners, self.keep, scale, self.values)
        return self.keep, scale

    def check_gathered(self, got: torch.Tensor) -> None:
        for c in range(self.group.size):
            sumsq, nonfinite = float(got[c, 0]), float(got[c, 1])
            if nonfinite or not math.sqrt(sumsq) <= self.bounds[c]:
                raise PeerMisbehaved(f"site {c} shared a sum of norm {math.sqrt(sumsq):.3g} (non-finite values: "
                                     f"{nonfinite:.0f}) that its inputs bound by {self.bounds[c]:.3g}")


def describe_exclusions(exclusions: dict[int, str]) -> str:
    """One line for the log: which sites were left out of an average and why."""
    return "; ".join(f"site {s} ({why})" for s, why in sorted(exclusions.items()))


def wire_codec(wire: str, settings: Any = None) -> WireCodec:
    """The codec of wire format `wire` (zeroband/comm/codecs/) for `settings` (the run's [diloco]; None:
    its defaults), through the `codec` seam (zeroband/seams.py: a test may wrap it)."""
    return seams.current().codec(codecs.spec(wire).codec(settings))


def reduce_across_sites(
    grads: list[torch.Tensor],
    stats: SiteStats,
    group: GlobalGroup,
    wire: str,
    piece_bytes: int,
    error_feedback: dict[int, torch.Tensor] | None = None,
    outlier_factor: float = 0.0,
    weight_by_tokens: bool = False,
    arena: Arena | None = None,
    settings: Any = None,
    merge: str = "mean",
) -> ReduceResult:
    """In place: grads <- mean over contributing sites. Returns what it cost and who took part.
    `arena`: memory kept by the caller between calls (comm/direct.py's Arena); `settings`: the run's
    [diloco], for a codec that has settings of its own (None: their defaults)."""
    codec, parts = wire_codec(wire, settings), Parts()
    kind = GatherExchange if codecs.spec(wire).exchange == "gather" else DirectExchange
    with parts.cpu():  # the CPU of the thread that runs the exchange (often not the training loop's)
        return _reduce(grads, stats, group, codec, parts, piece_bytes, error_feedback, outlier_factor,
                       weight_by_tokens, arena, kind, merge)


def _reduce(grads: list[torch.Tensor], stats: SiteStats, group: GlobalGroup, codec: WireCodec, parts: Parts,
            piece_bytes: int, error_feedback: dict[int, torch.Tensor] | None, outlier_factor: float,
            weight_by_tokens: bool, arena: Arena | None, kind: type[DirectExchange] = DirectExchange,
            merge: str = "mean") -> ReduceResult:
    numel = sum(g.numel() for g in grads)
    exchange = kind(numel, group, codec, piece_bytes, parts, arena)  # receives posted first
    table_ready = group.post_scalars(stats.as_list())
    with parts("encode"):
        flat = flatten(grads)  # meanwhile: CPU work that does not depend on the table (none: grads share one vector)
    with parts("network_wait"):
        table = table_ready()
    check_replicas(table)
    use = contributing_sites(table, outlier_factor)
    weights = [site_weight(table, use, s, weight_by_tokens, merge) for s in range(group.size)]
    review = SentReview(group, table, use, weights, outlier_factor, parts, values=numel)
    finite = bool(table[group.rank, NONFINITE] == 0)  # this site's own count, which covers this rank's grads
    wire_bytes = exchange.run(grads, weights[group.rank], error_feedback, flat, review if group.size > 1 else None,
                              finite)
    keep = review.keep or use
    payload = codec.nbytes(numel) - codec.header  # a per-message header is wire bytes, not payload
    return ReduceResult(
        payload_bytes=payload,
        wire_bytes=wire_bytes,
        sites_used=sum(keep),
        used=[s for s, ok in enumerate(keep) if ok],
        excluded_sites=[s for s, ok in enumerate(keep) if not ok and table[s, ABSTAIN] == 0],
        timings=parts.seconds,
        sumsq=exchange.sumsq,
        exclusions=declared_exclusions(table, outlier_factor) | review.exclusions,
        wait_bound_s=group.take_bound(),
        mean_norm=mean_norm(table, keep, weight_by_tokens),
    )
