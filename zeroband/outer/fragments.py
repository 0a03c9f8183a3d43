"""Streaming DiLoCo's fragments (Douillard et al. 2025, arXiv 2501.18512): `diloco.fragments = P`.

The parameters are split into P fragments balanced by bytes (whole tensors, greedy: `split`).
Fragment p is one `DiLoCo` over its own parameters, with its own outer copy, outer optimizer state,
error feedback and overlap, whose rounds end at inner steps = (p + 1) x H / P mod H: one fragment
syncs every H / P steps, each every H steps, so a site's uplink carries 1/P of the model at a time
and each fragment's all-reduce overlaps the others' compute. Every fragment goes through the same
exchange as a whole-model step (codecs, MACs, review); the fragments share one membership. Sites
of different shapes exchange each fragment per lane (zeroband/outer/lanes.py: a lane's pieces within
the fragment; a lane with none there is skipped by all its owners alike). Not built yet: time-budget
rounds with fragments (the config refuses them).

Elastic membership: each fragment's boundary is one round of the run's shared clock, and the
round's proposer, a holder of the state, names the fragment it syncs (`Decision.topic`): every
holder is at the same inner step, so at the same fragment. A site without the state (a joiner, or
one left out of a round) takes the rounds as they come, each with the fragment it names
(`DiLoCo.takes`, `join`), until a peer handed it the state: every fragment's outer state, which
its local model then takes whole. What a site left out of a
round loses is its local progress on every fragment since that fragment's last round: the data
ledger gives back the documents of the round it missed (as without fragments); the documents of
the earlier rounds stay counted, their effect kept in the fragments that synced since.

The end of the run is a boundary of every fragment, blocking: after it every site holds the same
bits. A checkpoint is not: it saves each fragment where its cycle stands (outer copy, optimizer
state, round clock; the local model is the site's own), so checkpoints do not change what is
trained; an exchange in flight there (overlap) lands first, as the checkpoint needs none in flight.
The fragment whose round ends at the checkpoint steps blocking, as a whole-model step would. The exchanges of the
fragments take the global group one at a time, in the same order on every site: before a fragment's
boundary, the exchanges the others have in flight are waited for (not applied: each lands when its
own rule says).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from zeroband.comm.group import GlobalGroup
from zeroband.comm.reduce import ReduceResult
from zeroband.comm.timing import summed
from zeroband.config import DilocoConfig
from zeroband.membership.base import FixedMembership, Membership
from zeroband.mesh import Topology
from zeroband.outer.base import OuterStats
from zeroband.outer.diloco import DiLoCo


def split(numels: list[int], fragments: int) -> list[list[int]]:
    """Parameter indices of each fragment: whole tensors, largest first onto the lightest fragment
    (ties to the lower index), each fragment's indices in parameter order. A pure function of the
    full shapes' sizes, so every rank of every site, whatever its shard, splits alike."""
    if not 1 <= fragments <= len(numels):
        raise ValueError(f"diloco.fragments={fragments} must be between 1 and the model's {len(numels)} "
                         "parameter tensors (a fragment holds whole tensors)")
    load = [0] * fragments
    parts: list[list[int]] = [[] for _ in range(fragments)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        lightest = min(range(fragments), key=lambda p: (load[p], p))
        load[lightest] += numels[i]
        parts[lightest].append(i)
    return [sorted(p) for p in parts]


def offsets(inner_steps: int, fragments: int) -> list[int]:
    """The step (mod H) at which each fragment's rounds end: (p + 1) x H / P, the last at H."""
    return [(p + 1) * inner_steps // fragments % inner_steps for p in range(fragments)]


def merged(stats: list[OuterStats]) -> OuterStats:
    """One "outer" record for the fragments that stepped at one inner step: bytes and seconds added,
    norms combined over the fragments, the replica digest of all of them (in fragment order)."""
    if len(stats) == 1:
        return stats[0]
    timings = summed([s.timings for s in stats])
    crcs = [s.outer_crc for s in stats]
    crc = None if None in crcs else int.from_bytes(hashlib.sha256(str(crcs).encode()).digest()[:6], "big")
    return replace(stats[-1], allreduce_s=sum(s.allreduce_s for s in stats),
                   outer_step_s=sum(s.outer_step_s for s in stats),
                   payload_bytes=sum(s.payload_bytes for s in stats), wire_bytes=sum(s.wire_bytes for s in stats),
                   pseudo_grad_norm=sum(s.pseudo_grad_norm**2 for s in stats) ** 0.5,
                   avg_pseudo_grad_norm=sum(s.avg_pseudo_grad_norm**2 for s in stats) ** 0.5,
                   sites_used=min(s.sites_used for s in stats),
                   excluded_sites=sorted({x for s in stats for x in s.excluded_sites}),
                   overlapped=all(s.overlapped for s in stats), outer_crc=crc,
                   wait_bound_s=max(s.wait_bound_s for s in stats), timings=timings,
                   fragments=[f for s in stats for f in s.fragments])


class Fragments:
    """P `DiLoCo`s, one per fragment, behind the one `Outer` interface the loop talks to."""

    def __init__(self, model: torch.nn.Module, cfg: DilocoConfig, topology: Topology, tokens_per_step: int,
                 lr_factor: Callable[[int], float] | None, total_steps: int, group: GlobalGroup | None = None,
                 membership: Membership | None = None) -> None:
        """On the fixed `group`, or on `membership` (elastic: zeroband/membership/elastic.py)."""
        params = list(model.parameters())
        if membership is None:
            assert group is not None, "Fragments needs a `membership` or the fixed `group`"
            membership = FixedMembership(group, topology, topology.timeout_s)
        self.membership = membership
        self.parts = split([p.numel() for p in params], cfg.fragments)  # full sizes: alike on every rank
        self.fragments = [
            DiLoCo(model, cfg, topology, tokens_per_step, lr_factor, membership=self.membership,
                   subset=idx, offset=offset, state_key=f"outer.{p}", topic=p)
            for p, (idx, offset) in enumerate(zip(self.parts, offsets(cfg.inner_steps, cfg.fragments)))]
        self.current = self.fragments[0]  # the fragment whose round runs (or ran last)
        self.total_steps = total_steps  # train.steps: the end, where every fragment syncs
        self.cfg, self.budgeted = cfg, bool(cfg.round_seconds)

    def attach(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.membership.attach(sink)

    @property
    def last_reduce(self) -> ReduceResult | None:
        """The exchange of the round that runs or ran last (the data ledger reads whom it excluded)."""
        return self.current.last_reduce

    @torch.no_grad()
    def start(self, resumed: bool = False) -> None:
        self.fragments[0].note_outer_device()
        self.membership.start(resumed)  # once: the sites prove the secret and agree on the run
        if not self.membership.holds_state:
            self.join()
        else:
            for f in self.fragments:
                f.start_replicas(resumed)
        for f in self.fragments:
            f.clock.restart()  # a time budget's first rounds count from here, where the sites meet

    @torch.no_grad()
    def join(self, topic: int = 0) -> None:
        """Rounds as they come, each with the fragment its proposer named (a round that names none only
        hands the state over: fragment `topic`, any one, takes it), until a peer handed the run's
        state over; then the local model is every fragment's outer copy (no progress of its own)."""
        while not self.membership.holds_state:
            self.current = self.fragments[topic]
            self.current.sync(None)
            topic = self.current.redirect if self.current.redirect is not None else topic
        for f in self.fragments:
            f.copy.to_local()

    def leave(self) -> None:
        self.membership.leave()

    def sync_gradients(self) -> None:
        pass

    def finished(self, step: int, total_steps: int) -> bool:
        if self.budgeted:  # the last fragment's rounds are the run's: it syncs at each whole round
            return self.fragments[-1].clock.finished(step, total_steps)
        return step >= total_steps

    def run_step(self, step: int) -> int:
        return self.fragments[-1].clock.run_step(step) if self.budgeted else step

    def after_inner_step(self, step: int, sync_point: bool = False) -> OuterStats | None:
        """Each fragment whose round ends here steps (every one at the end), in fragment order; at a
        checkpoint, exchanges still in flight land."""
        if self.budgeted:
            return self._after_budget(step)
        end = sync_point and step >= self.total_steps
        stats: list[OuterStats] = []
        for p in range(len(self.fragments)):
            f = self.current = self.fragments[p]
            if end or f.due(step):  # it takes the group: the others' exchanges finish first
                self._quiesce(but=f)
            s = f.after_inner_step(step, sync_point, force=end)
            if not self.membership.holds_state:  # left out of the round (elastic): back with the state
                self.join(f.redirect if f.redirect is not None else p)
                break
            if s is None and sync_point:
                s = f.settle()
            if s is not None:
                stats.append(replace(s, fragments=[p]))
        return merged(sorted(stats, key=lambda s: s.fragments)) if stats else None

    def _after_budget(self, step: int) -> OuterStats | None:
        """Under a time budget: the fragments whose round ends here (read once: a wall clock moves on)
        step in the order of their deadlines, (round, fragment), which every site shares whatever its
        speed, though a slow step may end two; the others count the step. The last fragment's
        boundary is the run's: at a sync point there (its clock's `blocks`) every exchange
        in flight lands, and a round due after it waits a step, so every site saves at the same
        point. At the run's last one every fragment syncs, blocking (`_close`)."""
        last, p_last = self.fragments[-1].clock, len(self.fragments) - 1
        ending = [p for p, f in enumerate(self.fragments) if f.due(step)]
        if p_last in ending and last.rounds + 1 >= self.total_steps // self.cfg.inner_steps:
            return self._close(step)
        settles = p_last in ending and last.blocks(last.rounds + 1)
        if settles:
            ending = [p for p in ending if (self.fragments[p].clock.rounds, p) <= (last.rounds, p_last)]
        ending.sort(key=lambda p: (self.fragments[p].clock.rounds, p))
        stats: list[OuterStats] = []
        for p in ending + [p for p in range(len(self.fragments)) if p not in ending]:
            f = self.current = self.fragments[p]
            if p in ending:
                self._quiesce(but=f)  # it takes the group: the others' exchanges finish first
            s = f.after_inner_step(step, settles, decided=p in ending)  # blocking at a checkpoint
            if s is None and settles:  # one still in flight lands: a checkpoint needs none
                s = f.settle()
            stats += [replace(s, fragments=[p])] if s is not None else []
        return merged(sorted(stats, key=lambda s: s.fragments)) if stats else None

    def _close(self, step: int) -> OuterStats:
        """The run's last boundary under a budget: the last fragment ends round K = train.steps // H,
        every other fragment round K + 1 (its progress since its K-th), each taking the rounds it still
        owes in (round, fragment) order, blocking. A slow site may owe a fragment two here (its K-th
        fell in this step too): the second counts no step of its own, a contribution of no tokens."""
        rounds = self.total_steps // self.cfg.inner_steps
        owed = sorted((r, p) for p, f in enumerate(self.fragments)
                      for r in range(f.clock.rounds, rounds + (p != len(self.fragments) - 1)))
        stats, ticked = [], set()
        for _, p in owed:
            f = self.current = self.fragments[p]
            self._quiesce(but=f)
            if p in ticked:
                f.clock.rounds += 1
                s = f.boundary(step, True)
            else:
                s = f.after_inner_step(step, True, decided=True)
                ticked.add(p)
            stats += [replace(s, fragments=[p])] if s is not None else []
        return merged(sorted(stats, key=lambda s: s.fragments))  # every fragment owes its last round

    def _quiesce(self, but: DiLoCo) -> None:
        for f in self.fragments:
            if f is not but and f.overlap.pending is not None:
                f.overlap.pending.wait(f.group)

    def state_dict(self) -> dict[str, Any]:
        return {"fragments": [f.state_dict() for f in self.fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fragments")
        if saved is None or len(saved) != len(self.fragments):
            have = "none" if saved is None else len(saved)
            raise ValueError(f"the checkpoint holds {have} fragments' outer state, this run has diloco.fragments="
                             f"{len(self.fragments)}: resume with the fragments it was saved with")
        for f, s in zip(self.fragments, saved):
            f.load_state_dict(s)
