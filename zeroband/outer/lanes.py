"""DiLoCo's cross-site data path, per lane (issue 26; one path for every shape, issue 36).

A lane (zeroband/comm/layout.py) is a set of pieces of the flat parameter space that one rank per
site holds. Sites of equal shapes have one lane per rank: its whole shard, on the round's group
(`shard{r}`; elastic: this generation's), and its tensors go to the exchange as they are (they tile
one vector: no copy). Sites of different shapes: this rank's lanes come with their groups in
`Topology.lanes`; each lane's pieces are copied, in the lane's order, into one vector that every
member of the lane builds alike. Either way the vector goes through the one exchange
(comm/reduce.py): same wire format, same summation order, so every site receives the same bytes for
every parameter, and a lane's error feedback is its own. Lanes run one after the other in the run's
lane order (no cycle of waits). Nothing here calls the site group (it may run on the exchange
thread); the callers reduce over the site where they must.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch

from zeroband.comm.group import GlobalGroup, digest48
from zeroband.comm.layout import Lane, lanes, local_slices, rows_of, shard_range
from zeroband.comm.reduce import ReduceResult, SiteStats
from zeroband.comm.timing import summed
from zeroband.mesh import Topology
from zeroband.outer.stats import tensor_stats
from zeroband.trust.mac import NO_AUTH


class LaneSet:
    """This rank's lanes: which elements of its local shard each one contributes and receives."""

    def __init__(self, topology: Topology, local: list[torch.Tensor], shapes: list[tuple[int, ...]],
                 subset: list[int] | None = None) -> None:
        """`shapes`: every parameter's full shape (a DTensor parameter's own `shape`); `local`: the
        local shards of the parameters numbered `subset` (default: all of them; a fragment: its own)."""
        world = topology.world
        subset = list(range(len(shapes))) if subset is None else subset
        self.whole = not topology.lanes  # equal shapes: one lane, this rank's whole shard on the round's group
        self.sites = world.site_count
        if self.whole:
            self.lanes: list[tuple[Lane | None, GlobalGroup | None]] = [(None, None)]
            self.slices = [[(n, 0, t.numel()) for n, t in enumerate(local)]]
            self.index, self.run_lanes = [world.rank], world.ranks_per_site
            return
        position = {i: n for n, i in enumerate(subset)}
        for i, t in zip(subset, local, strict=True):
            start, stop = shard_range(shapes[i], world.ranks_per_site, world.rank)
            if t.numel() != stop - start:  # the layout must be FSDP2's: else the lanes would mix up elements
                raise RuntimeError(f"parameter {i}: local shard of {t.numel()} elements, the lane layout expects "
                                   f"{stop - start} (FSDP2 dim-0 sharding over {world.ranks_per_site} ranks)")
        self.lanes = list(topology.lanes)
        # each lane's pieces within `subset`, numbered by position in it (empty: a fragment holds none)
        self.slices = [[(position[i], a, b) for i, a, b in local_slices(lane, shapes, world.ranks_per_site, world.rank)
                        if i in position] for lane, _ in topology.lanes]
        run = [lane.owners for lane in lanes(shapes, topology.site_ranks)]  # every lane: each is one rank's per site
        self.index, self.run_lanes = [run.index(lane.owners) for lane, _ in topology.lanes], len(run)

    def groups(self, group: GlobalGroup | None) -> list[GlobalGroup]:
        """Each lane's group; `group`: the round's (the whole shard's lane under equal shapes)."""
        out = [g if g is not None else group for _, g in self.lanes]
        assert all(g is not None for g in out), "equal shapes: the round's group is needed"
        return cast(list[GlobalGroup], out)

    def views(self, k: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Lane k's pieces of `tensors` (one per parameter, shaped like the local shard), as 1-D views
        (the whole shard's lane: the tensors themselves)."""
        if self.whole:
            return list(tensors)
        return [tensors[i].reshape(-1)[a:b] for i, a, b in self.slices[k]]

    def gather(self, k: int, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(self.views(k, tensors)) if self.slices[k] else torch.empty(0)

    def scatter(self, k: int, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        for view, part in zip(self.views(k, tensors), flat.split([v.numel() for v in self.views(k, tensors)])):
            view.copy_(part)

    def state_views(self, k: int, per_param: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Lane k's pieces of every tensor of each parameter's state (outer copy, optimizer state); a
        tensor not shaped like the shard (a step count) is taken whole: it is the same on every rank."""
        out = []
        for i, a, b in self.slices[k]:
            numel = per_param[i][0].numel()
            out += [t.reshape(-1)[a:b] if t.numel() == numel else t.reshape(-1) for t in per_param[i]]
        return out

    def fold(self, tensors: list[torch.Tensor], feedback: list[dict[int, torch.Tensor]]) -> None:
        """tensors += each lane's residual (error feedback of a codec that folds it: comm/gather.py):
        keyed by tensor (the whole shard's lane) or one vector, key 0 (a lane of pieces)."""
        for k, residual in enumerate(feedback):
            if self.whole:
                for i, t in enumerate(tensors):
                    if i in residual:
                        t.add_(residual[i].view_as(t))
            elif 0 in residual:
                views = self.views(k, tensors)
                for view, part in zip(views, residual[0].split([v.numel() for v in views])):
                    view.add_(part)

    def digests(self, per_param: list[list[torch.Tensor]], group: GlobalGroup | None = None) -> list[int]:
        """48 bits of the keyed digest of each lane's state, under its group's key (`group`: the round's)."""
        return [digest48(self.state_views(k, per_param), g.auth if g is not None else NO_AUTH)
                for k, g in enumerate(self.groups(group))]

    def site_digest(self, digests: list[int], topology: Topology) -> int:
        """48 bits naming the whole site's state, the same on every site whatever its shape: every lane's
        digest (each held by one rank of the site; float64 carries 48 bits exactly), hashed in lane order.
        A site collective: every rank of the site calls it."""
        table = torch.zeros(self.run_lanes, dtype=torch.float64, device=topology.world.device)
        table[self.index] = torch.tensor(digests, dtype=torch.float64, device=table.device)
        topology.site_all_reduce(table)
        return int.from_bytes(hashlib.sha256(table.cpu().numpy().tobytes()).digest()[:6], "big")

    def reduce(self, grads: list[torch.Tensor], stats: SiteStats, crcs: list[int] | None, group: GlobalGroup,
               one: Callable[[list[torch.Tensor], SiteStats, GlobalGroup, int], ReduceResult]) -> ReduceResult:
        """In place: `grads` <- the sites' average, lane by lane; `one(vector, stats, group, k)` runs
        one lane's exchange; `group`: the round's. `crcs`: each lane's digest, for the replica check."""
        if self.whole:  # the shard's tensors as they are: they tile one vector, averaged in place
            return one(grads, replace(stats, crc=float(crcs[0])) if crcs is not None else stats, group, 0)
        results, lane_sumsq = [], {}
        for k, lane_group in enumerate(self.groups(group)):
            if not self.slices[k]:  # every owner of the lane skips it alike: the pieces are the lane's
                continue
            flat = self.gather(k, grads)
            lane_stats = replace(stats, crc=float(crcs[k])) if crcs is not None else stats
            results.append(one([flat], lane_stats, lane_group, k))
            lane_sumsq[k] = results[-1].sumsq if results[-1].sumsq is not None else tensor_stats([flat])[0]
            self.scatter(k, flat, grads)
        return replace(combine(results, self.sites), lane_sumsq=lane_sumsq)

    def site_total(self, per_lane: dict[int, float], topology: Topology) -> float:
        """The sum over the whole site of a value each of this rank's lanes holds (the sum of squares
        of its average), the same bits on every site whatever its shape: each lane's value (alike on
        its every owner) into a float64 table of the run's lanes, summed over the site (x + 0 is
        exact), then added in lane order. A site collective: every rank of the site calls it."""
        table = torch.zeros(self.run_lanes, dtype=torch.float64, device=topology.world.device)
        for k, value in per_lane.items():
            table[self.index[k]] = value
        topology.site_all_reduce(table)
        return sum(table.cpu().tolist())


def combine(results: list[ReduceResult], sites: int) -> ReduceResult:
    """One rank's result over its lanes: bytes and seconds added, every exclusion kept (none: a
    fragment that holds nothing of this rank's lanes; every site took part, so it counts as a step)."""
    timings = summed([r.timings for r in results])
    sumsqs = [r.sumsq for r in results]
    exclusions = {s: why for r in results for s, why in r.exclusions.items()}
    return ReduceResult(
        payload_bytes=sum(r.payload_bytes for r in results), wire_bytes=sum(r.wire_bytes for r in results),
        sites_used=min((r.sites_used for r in results), default=sites),
        excluded_sites=sorted({s for r in results for s in r.excluded_sites}), timings=timings,
        sumsq=None if any(s is None for s in sumsqs) else sum(s for s in sumsqs if s is not None),
        exclusions=exclusions, wait_bound_s=max((r.wait_bound_s for r in results), default=0.0),
        mean_norm=max((r.mean_norm for r in results), default=0.0))  # (every lane reads the same site norms)



# ---------------------------------------------------------------------------------- a site changes shape
def reshard_rows(parts: list[torch.Tensor], ranks: int, rank: int) -> torch.Tensor:
    """The rows `rank` of `ranks` holds (FSDP2's dim-0 chunk) of the tensor whose row blocks, in rank
    order, are `parts` (a 0-d tensor is whole on every rank)."""
    if parts[0].dim() == 0:
        return parts[0]
    full = torch.cat(parts)
    start, stop = rows_of(full.shape[0], ranks, rank)
    return full[start:stop].clone()


def reshard_outer_state(states: list[dict[str, Any]], ranks: int, rank: int) -> dict[str, Any]:
    """DiLoCo's state (outer copy, outer optimizer state) for `rank` of `ranks`, from the states every
    rank of a site of len(states) ranks saved: the same rows, cut where the new sharding cuts. The
    quantisation residual is per piece of the old layout: it starts again empty."""
    first = dict(states[0])
    first["outer"] = [reshard_rows([s["outer"][i] for s in states], ranks, rank) for i in range(len(first["outer"]))]
    optimizer = first["optimizer"]
    new = {key: {k: reshard_rows([s["optimizer"]["state"][key][k] for s in states], ranks, rank)
                 if isinstance(v, torch.Tensor) else v for k, v in per.items()}
           for key, per in optimizer["state"].items()}
    first["optimizer"] = {**optimizer, "state": new}
    first["error_feedback"] = {} if first.get("error_feedback") is not None else None
    return first


def reshard_rank_state(name: str, states: list[Any], ranks: int, rank: int) -> Any:
    """A per-rank checkpoint entry for `rank` of `ranks` from every saved rank's (checkpoint.load_checkpoint's
    `reshard`): the outer state resharded; the rest is the site's own, alike on every rank of a run of
    sites of different shapes (data: the site's stream, data/loader.py SiteShare), so rank 0's."""
    if name != "outer":
        return states[0]
    if "fragments" in states[0]:  # diloco.fragments > 1: each fragment's state alike (zeroband/outer/fragments.py)
        return {"fragments": [reshard_outer_state([s["fragments"][p] for s in states], ranks, rank)
                              for p in range(len(states[0]["fragments"]))]}
    return reshard_outer_state(states, ranks, rank)
