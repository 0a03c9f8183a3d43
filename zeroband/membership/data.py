"""The data ledger (zeroband/data/ledger.py) as a participant of the elastic round protocol
(`RoundParticipant`, zeroband/membership/rounds.py): each rank reports its position in its lease
before its site votes, and every member applies the same commit when the round is committed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroband.comm.reduce import ReduceResult
from zeroband.data.ledger import Ledger, Position, Record
from zeroband.data.loader import PackedBatches
from zeroband.membership.base import EventLog
from zeroband.membership.rounds import Decision
from zeroband.mesh import Topology
from zeroband.trust.signed import SignedStore


class SharedData:
    """One rank's side of the ledger in an elastic run: a participant of the round protocol
    (`RoundParticipant`, zeroband/membership/rounds.py), called by the membership on the main thread.

    `before_vote` (every attempt): this rank writes its position in its lease (two integers,
    `Position`) to the run's store, signed; its site votes after every rank wrote it, so every
    member that commits has. `on_commit`: every member reads the contributors' positions and who the
    committed average excluded, applies the same `Ledger.commit`, and this rank reads its new lease.
    A joiner takes the ledger from a peer with the rest of the run's state (a state dict the
    membership hands over, compared by digest like the outer state); checkpoints hold it too. Each
    commit's record goes to `attach`'s sink (metrics.jsonl, kind "data")."""

    def __init__(self, loader: PackedBatches, ledger: Ledger, topology: Topology, store: SignedStore, prefix: str,
                 last_reduce: Callable[[], ReduceResult | None]) -> None:
        self.loader, self.ledger, self.topology = loader, ledger, topology
        self.site, self.rank = topology.world.site_rank, topology.world.rank
        self.store, self.prefix, self.last_reduce = store, prefix, last_reduce
        self.records = EventLog(self.site)

    def attach(self, sink: Callable[[Record], None]) -> None:
        self.records.attach(sink)

    def _key(self, round: int, site: int, rank: int) -> str:
        return f"{self.prefix}ledger/r{round}/s{site}/k{rank}"

    def before_vote(self, round: int, attempt: int, decision: Decision) -> None:
        docs, tokens = self.loader.lease_position
        self.store.set(self._key(round, self.site, self.rank), f"{docs},{tokens}")

    def on_commit(self, round: int, decision: Decision) -> None:
        members = decision.members
        holders = [m for m in members if m not in decision.fresh]
        late = self._late(members) if holders and round > 0 else set()  # a round that averaged: its reduce
        contributors = [m for m in members if m in holders or m in late]
        reads = {m: [self._read(round, m, k) for k in range(self.ledger.ranks)] for m in contributors}
        record = self.ledger.commit(members, reads, self._excluded(members) if contributors else [], round)
        if self.site in members:
            lease = self.ledger.lease(self.site, self.rank)
            self.loader.set_lease(lease, self.ledger.lease_skips(lease))
        self.records.emit("ledger", **record)

    def _read(self, round: int, site: int, rank: int) -> Position:
        raw = self.store.get(self._key(round, site, rank))
        docs, _, tokens = raw.decode().partition(",")
        return int(docs), int(tokens or 0)

    def _late(self, members: list[int]) -> set[int]:
        """Members that brought a pseudo-gradient to the committed average, kept or excluded: for a
        member without the state before this round, the late work of the round it was left out of
        (diloco.late_weight), read from the lease the ledger held for it. The table is the same on
        every rank group (abstaining is a site's), so every rank agrees."""
        result = self.last_reduce()
        return set() if result is None else {members[i] for i in [*result.used, *result.excluded_sites]}

    def _excluded(self, members: list[int]) -> list[int]:
        """Members whose pseudo-gradient the committed average left out (the last reduce, by group
        index = position in `members`). Rank groups of a site may exclude differently (each checks
        its own shard's bytes): the site takes their union, so every rank of every site agrees."""
        result = self.last_reduce()
        mine = set() if result is None else {members[i] for i in result.excluded_sites}
        if self.topology.world.ranks_per_site > 1:
            flags = torch.tensor([1.0 if m in mine else 0.0 for m in members], device=self.topology.world.device)
            self.topology.site_all_reduce(flags, op=dist.ReduceOp.MAX)
            mine = {m for m, f in zip(members, flags.tolist()) if f > 0}
        return sorted(mine)

    def checksum(self) -> list[torch.Tensor]:
        """The ledger's state as bytes, for the hand-over's digest comparison across members."""
        return [torch.frombuffer(bytearray(self.ledger.digest().encode()), dtype=torch.uint8)]

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)
