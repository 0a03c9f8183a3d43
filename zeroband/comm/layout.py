"""The cross-site layout of the flat parameter space when sites have different shapes (issue 26).

Every site holds the same parameters, each sharded by FSDP2 over the site's own ranks: dim 0 cut
like `torch.chunk` (rows of ceil(n0 / R) per rank, the last ranks shorter or empty); a one-rank
site holds every parameter whole. The flat parameter space is the parameters, flattened, one after
the other in `model.parameters()` order.

The exchange cuts that space at the union of every site's shard boundaries. Each piece then lies
inside one shard on every site, so its owners are one rank per site (`owners`, indexed by site)
and nothing moves inside a site. Pieces with the same owners form a `Lane`: one cross-site group
whose members each put the lane's pieces, in flat order, into one vector and average it with the
others. Every site's owner of a piece sends and receives the same bytes in the same order, so the
sites stay bitwise identical. A rank of a smaller site belongs to more lanes (it moves more).

Equal shapes give lane r = rank r of every site, holding that rank's whole shard in its own order:
exactly the group `shard{r}` and the vector of the equal-shape exchange (`uniform`).
Lanes are ordered by their first piece; every rank runs its lanes in that one order, so blocking
exchanges on several lanes cannot wait on each other in a cycle. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def rows_of(n0: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of a dim-0 length `n0` that FSDP2 (torch.chunk) gives `rank` of `ranks`."""
    if ranks == 1:
        return 0, n0
    chunk = math.ceil(n0 / ranks)
    start = min(rank * chunk, n0)
    return start, min(start + chunk, n0)


def shard_range(shape: tuple[int, ...], ranks: int, rank: int) -> tuple[int, int]:
    """Elements [start, stop) of the flattened parameter of `shape` that `rank` of `ranks` holds."""
    if not shape:  # a 0-d parameter is not sharded
        return 0, 1
    row = math.prod(shape[1:])
    start, stop = rows_of(shape[0], ranks, rank)
    return start * row, stop * row


@dataclass(frozen=True)
class Piece:
    param: int  # index in model.parameters()
    start: int  # elements [start, stop) of the flattened parameter
    stop: int
    owners: tuple[int, ...]  # the rank holding it, per site


@dataclass
class Lane:
    owners: tuple[int, ...]  # one rank per site
    pieces: list[Piece] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.stop - p.start for p in self.pieces)

    def name(self) -> str:
        """Its store name: `shard{r}` where every site's owner is rank r (today's group), else `lane{r0.r1...}`."""
        if len(set(self.owners)) == 1:
            return f"shard{self.owners[0]}"
        return "lane" + ".".join(map(str, self.owners))


def pieces(shapes: list[tuple[int, ...]], site_ranks: list[int]) -> list[Piece]:
    """The flat space cut at the union of every site's shard boundaries, in flat order; empty pieces dropped."""
    out = []
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        cuts = {0, numel}
        for ranks in site_ranks:
            cuts |= {b for r in range(ranks) for b in shard_range(shape, ranks, r)}
        bounds = sorted(c for c in cuts if 0 <= c <= numel)
        for a, b in zip(bounds, bounds[1:]):
            owners = tuple(_owner(shape, ranks, a) for ranks in site_ranks)
            out.append(Piece(i, a, b, owners))
    return out


def _owner(shape: tuple[int, ...], ranks: int, element: int) -> int:
    """The rank of `ranks` whose shard holds `element` of the flattened parameter."""
    for r in range(ranks):
        start, stop = shard_range(shape, ranks, r)
        if start <= element < stop:
            return r
    raise ValueError(f"element {element} of a parameter of shape {shape} is in no shard of {ranks} ranks")


def lanes(shapes: list[tuple[int, ...]], site_ranks: list[int]) -> list[Lane]:
    """Every lane of the run, ordered by its first piece (the order every rank runs them in)."""
    by_owners: dict[tuple[int, ...], Lane] = {}
    for piece in pieces(shapes, site_ranks):
        by_owners.setdefault(piece.owners, Lane(piece.owners)).pieces.append(piece)
    return list(by_owners.values())


def my_lanes(shapes: list[tuple[int, ...]], site_ranks: list[int], site: int, rank: int) -> list[Lane]:
    """The lanes `rank` of `site` is a member of, in the run's order."""
    return [lane for lane in lanes(shapes, site_ranks) if lane.owners[site] == rank]


def local_slices(lane: Lane, shapes: list[tuple[int, ...]], ranks: int, rank: int) -> list[tuple[int, int, int]]:
    """(parameter, start, stop) of each of the lane's pieces in this rank's local shard of that
    parameter (flattened), in the lane's order: what it contributes and receives."""
    out = []
    for p in lane.pieces:
        base = shard_range(shapes[p.param], ranks, rank)[0]
        out.append((p.param, p.start - base, p.stop - base))
    return out


def uniform(site_ranks: list[int]) -> bool:
    """Every site has the same ranks: the equal-shape exchange, unchanged."""
    return len(set(site_ranks)) <= 1
