"""Identical replicas across sites: site 0's parameters handed to every site (sealed), every site's
verdict agreed on before anyone acts, and the keyed digest that proves the sites hold the same bits.
What DiLoCo, its fragments and cross-site data parallel share (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from zeroband.comm.group import GlobalGroup, checksum_table
from zeroband.mesh import Topology
from zeroband.outer.lanes import LaneSet
from zeroband.trust.auth import TrustError
from zeroband.trust.mac import WireAuthError


def broadcast_from_site0(tensors: list[torch.Tensor], group: GlobalGroup, topology: Topology,
                         lanes: LaneSet | None = None) -> None:
    """Every site takes site 0's tensors: one sealed message (trust/mac.py, under this incarnation's
    session key), opened before any value is used. A site that received it altered applies nothing,
    and every site then stops with the same line (`refuse_if_any`), not just the one that saw it.
    `lanes`: one message per lane, of the lane's pieces of `tensors` (equal shapes: one, on `group`)."""
    parts = [(group, tensors)] if lanes is None else [(g, lanes.views(k, tensors))
                                                      for k, g in enumerate(lanes.groups(group))
                                                      if lanes.slices[k]]  # (a fragment may hold none of a lane)
    received = [_receive_from_site0(ts, g) for g, ts in parts]
    refuse_if_any(not all(ok for _, ok in received), [g for g, _ in parts], topology, "initial broadcast", lambda sites: (
        f"the parameters that sites {sites} received from site 0 failed authentication (altered on the way: "
        "an on-path attacker or a corrupting link); no site applied them. Check the network path between the sites"))
    for (_, ts), (flat, _) in zip(parts, received):
        for t, v in zip(ts, _split(flat, ts)):
            t.copy_(v.view_as(t))


def _receive_from_site0(tensors: list[torch.Tensor], group: GlobalGroup) -> tuple[torch.Tensor, bool]:
    """Site 0's `tensors` as one fp32 vector, and whether its seal verified (nothing applied yet)."""
    numel = sum(t.numel() for t in tensors)
    buf = torch.empty(4 * numel + group.auth.tag_bytes, dtype=torch.uint8)
    flat = buf[: 4 * numel].view(torch.float32)
    if group.rank == 0:
        for t, v in zip(tensors, _split(flat, tensors)):
            v.copy_(t.detach().reshape(-1))

    def send() -> bool:
        try:
            group.broadcast_sealed(buf, src=0)
            return True
        except WireAuthError:
            return False

    return flat, group.watched(send, "initial broadcast")


def _split(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive 1-D views of `flat`, one per tensor."""
    return list(flat.split([t.numel() for t in tensors]))


def refuse_if_any(bad: bool, group: GlobalGroup | list[GlobalGroup], topology: Topology, when: str,
                  why: Callable[[list[int]], str]) -> None:
    """Every site says whether `bad` holds for it (on every shard's group, or every lane's); if it does
    anywhere, every rank of every site raises the same TrustError, naming those sites."""
    groups = group if isinstance(group, list) else [group]
    tables = [g.watched(partial(g.gather_scalars, [float(bad)]), f"agreeing on the {when}")[:, 0] for g in groups]
    flags = torch.stack(tables).amax(dim=0).to(topology.world.device)
    topology.site_all_reduce(flags, op=dist.ReduceOp.MAX)  # another rank's shard may be the one altered
    sites = [s for s, f in enumerate(flags.tolist()) if f]
    if sites:
        raise TrustError(f"{when}: {why(sites)}")


def verify_identical(tensors: list[torch.Tensor], group: GlobalGroup, topology: Topology, when: str,
                     per_lane: list[tuple[GlobalGroup, list[torch.Tensor]]] | None = None) -> None:
    """The keyed digest (trust/mac.py `replica_digest`, not CRC32: a linear checksum lets an attacker
    choose a change that keeps it) of this rank's tensors must agree on every site and shard (or, for
    sites of different shapes, `per_lane`: each lane's group and its pieces of the tensors)."""
    tables = [g.watched(partial(checksum_table, ts, g), f"checksum after {when}")
              for g, ts in per_lane or [(group, tensors)]]
    differ = [t for t in tables if len(set(t)) > 1]
    mismatch = torch.tensor([float(bool(differ))], device=topology.world.device)
    topology.site_all_reduce(mismatch, op=dist.ReduceOp.MAX)
    if mismatch.item():
        raise TrustError(
            f"sites disagree after {when}: keyed digests of shard {topology.world.rank} per site are "
            f"{differ[0] if differ else tables[0]}"
        )
