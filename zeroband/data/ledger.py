"""Data as a shared ledger: who reads which documents of the run's order, round by round.

The train order (shuffled per epoch, zeroband/data/loader.py) is addressed by a global document
index d = epoch x N + j (N train documents, j the position in that epoch's order) and cut into
numbered spans of `span_docs` documents; a span never crosses an epoch (an epoch's last span may be
shorter). A *piece* is a half-open range [start, end) of global indices: a span, or what is left of
one that a member started and did not commit.

Each member site holds a lease per data-parallel rank: the pieces that rank reads next, in order.
At a round's commit every site applies the same `Ledger.commit` to the same inputs (the round's
members, who contributed, who was excluded, and each contributor's position per rank), so all sites
hold the same ledger without a leader:
- "committed" means trained into the outer step that round: the tokens a contributor's ranks
  trained on (were targets in a row) since the last commit. A rank reports its position as
  (documents all of whose tokens were trained, tokens trained of the next one); whole documents
  are committed, and a document cut by the round's end commits the tokens trained so far and is
  noted in `skips`: whoever reads it next starts at that token. So a document packed across a
  round boundary is neither lost nor read twice, wherever its tail goes;
- a member that was assigned documents and did not contribute (died, left out, joined this round)
  or was excluded from the average (zeroband/comm/reduce.py: its local progress is replaced by the
  average, so its reads were trained into nothing) gives its whole lease back to the front of the
  queue, dealt out again before any new span;
- every member of the round is then topped up (`assign`) so that each of its ranks holds at least
  `target` unread documents for the next round.

Why the positions: a round trains a fixed number of tokens, and documents differ in length, so
how many documents a rank consumes in a round depends on the text; no function of the membership
alone can know it. Each rank reports two integers with the round (train.py), and nothing else
crosses sites for data. Fault-free, the order is dealt like the old fixed slots, interleaved.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Piece = tuple[int, int]  # [start, end) global document indices
Position = tuple[int, int]  # (documents wholly trained, tokens trained of the next one) of a lease


def span_piece(span: int, span_docs: int, epoch_docs: int) -> Piece:
    """The documents of span `span`: spans are numbered through the epochs, none crosses one."""
    per_epoch = math.ceil(epoch_docs / span_docs)
    epoch, k = divmod(span, per_epoch)
    start = epoch * epoch_docs + k * span_docs
    return start, min(start + span_docs, (epoch + 1) * epoch_docs)


def assign(next_span: int, members: list[int], round: int, spans_per_member: int) -> dict[int, list[int]]:
    """The next `spans_per_member` x len(members) unread spans split among `members`: dealt one at a
    time in member order, starting at member `round % n` so no member is always first. Pure: the same
    for every caller that agrees on the members (the round's decision)."""
    ordered = sorted(members)
    n = len(ordered)
    out: dict[int, list[int]] = {m: [] for m in ordered}
    for i in range(spans_per_member * n):
        out[ordered[(i + round) % n]].append(next_span + i)
    return out


def split_over_ranks(pieces: list[Piece], ranks: int) -> list[list[Piece]]:
    """A site's pieces over its data-parallel ranks: piece i to rank i % ranks (deterministic)."""
    return [pieces[r::ranks] for r in range(ranks)]


def take_docs(lease: list[Piece], n: int) -> tuple[list[Piece], list[Piece]]:
    """(the first `n` documents of `lease`, the rest) as pieces; a piece may be cut in two."""
    taken, rest = [], list(lease)
    while n > 0 and rest:
        start, end = rest.pop(0)
        used = min(n, end - start)
        taken.append((start, start + used))
        if start + used < end:
            rest.insert(0, (start + used, end))
        n -= used
    if n > 0:
        raise ValueError(f"{n} more documents read than the lease holds")
    return taken, rest


def docs_in(pieces: list[Piece]) -> int:
    return sum(end - start for start, end in pieces)


def as_position(read: int | Position | list[int]) -> Position:
    """A rank's report: a bare count of documents (whole ones only) or (documents, tokens of the next)."""
    return (int(read), 0) if isinstance(read, int) else (int(read[0]), int(read[1]))


@dataclass
class Ledger:
    """The run's data position, identical on every site: the next span never handed out, pieces
    given back and not yet handed out again, and each member site's unread lease per rank."""

    span_docs: int
    epoch_docs: int
    ranks: int  # data-parallel ranks per site
    target: int  # unread documents each rank should hold after a top-up
    next_span: int = 0
    returned: list[Piece] = field(default_factory=list)
    leases: dict[int, list[list[Piece]]] = field(default_factory=dict)  # site -> per rank
    skips: dict[int, int] = field(default_factory=dict)  # document -> its tokens already committed

    # ------------------------------------------------------------------ the round's update
    def commit(self, round: int, members: list[int], reads: dict[int, list[Any]],
               excluded: list[int] | tuple[int, ...] = ()) -> dict[str, Any]:
        """Apply round `round`: `reads` maps each member that contributed to its position per rank
        (`as_position`); every other lease holder, and every site in `excluded`, gives its lease
        back. Then top up `members`. Returns the record of what happened (documents committed whole
        per site, tokens of cut documents, pieces given back, the new leases)."""
        committed: dict[int, list[Piece]] = {}
        partial: dict[int, list[list[int]]] = {}
        resumed: dict[int, int] = {}  # committed documents whose reading started at a token > 0
        given_back: list[Piece] = []
        for site in sorted(self.leases):
            if site in reads and site not in excluded:
                committed[site], partial[site], rests = [], [], []
                for lease, read in zip(self.leases[site], reads[site], strict=True):
                    rest = self._commit_rank(lease, as_position(read), committed[site], partial[site], resumed)
                    rests.append(rest)
                self.leases[site] = rests
            else:
                given_back += [p for lease in self.leases.pop(site) for p in lease]
        self.returned = sorted(given_back + self.returned)  # the oldest documents first
        # a rank that read r documents this round should hold 2r for the next: leases follow the text
        most = max((as_position(n)[0] for r in reads.values() for n in r), default=0)
        handed = self.top_up(round, members, max(self.target, 2 * most))
        return {"round": round, "members": sorted(members),
                "reads": {str(s): [list(as_position(n)) for n in r] for s, r in sorted(reads.items())},
                "excluded": sorted(excluded), "committed": {str(s): p for s, p in committed.items()},
                "partial": {str(s): p for s, p in partial.items() if p}, "resumed": {str(d): k for d, k in resumed.items()},
                "skips": {str(d): k for d, k in sorted(self.skips.items())}, "given_back": sorted(given_back),
                "handed": {str(s): p for s, p in handed.items()}, "returned": list(self.returned),
                "leases": {str(s): ls for s, ls in self.leases.items()}, "handed_end": self.handed_end,
                "digest": self.digest()}

    def _commit_rank(self, lease: list[Piece], read: Position, committed: list[Piece], partial: list[list[int]],
                     resumed: dict[int, int]) -> list[Piece]:
        """One rank's commit: its wholly trained documents, then the trained tokens of the next one
        (`skips`: where its next reader starts). Returns the rest of the lease."""
        docs, tokens = read
        taken, rest = take_docs(lease, docs)
        committed += taken
        for start, end in taken:
            for d in range(start, end):
                if (k := self.skips.pop(d, 0)) > 0:
                    resumed[d] = k
        if rest and tokens > (k := self.skips.get(rest[0][0], 0)):
            partial.append([rest[0][0], k, tokens])
            self.skips[rest[0][0]] = tokens
        return rest

    def digest(self) -> str:
        """16 hex digits of the ledger's state: equal on every site that applied the same commits."""
        return hashlib.sha256(json.dumps(self.state_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def handed_end(self) -> int:
        """One past the last document ever handed out: every one before it is committed, leased or given back."""
        return span_piece(self.next_span - 1, self.span_docs, self.epoch_docs)[1] if self.next_span else 0

    def top_up(self, round: int, members: list[int], target: int | None = None) -> dict[int, list[Piece]]:
        """Give every member enough documents that each of its ranks holds `target` unread ones:
        first the pieces given back, then new spans (`assign`). Returns what each member received."""
        target = self.target if target is None else target
        for m in members:
            self.leases.setdefault(m, [[] for _ in range(self.ranks)])
        handed: dict[int, list[Piece]] = {m: [] for m in sorted(members)}
        while any(docs_in(lease) < target for m in members for lease in self.leases[m]):
            # one pass: one more piece for every rank of every member, given-back pieces first
            slots = assign(0, members, round, self.ranks)
            queue = self.returned[: len(members) * self.ranks]
            self.returned = self.returned[len(queue):]
            fresh = len(members) * self.ranks - len(queue)
            queue += [span_piece(s, self.span_docs, self.epoch_docs) for s in range(self.next_span, self.next_span + fresh)]
            self.next_span += fresh
            for m, ids in slots.items():
                pieces = [queue[i] for i in ids]
                handed[m] += pieces
                for lease, extra in zip(self.leases[m], split_over_ranks(pieces, self.ranks)):
                    lease.extend(extra)
        return {m: p for m, p in handed.items() if p}

    def lease(self, site: int, rank: int) -> list[Piece]:
        return list(self.leases.get(site, [[]] * self.ranks)[rank])

    def lease_skips(self, lease: list[Piece]) -> dict[int, int]:
        """The documents of `lease` that an earlier reader cut at a round's end: doc -> first token to read."""
        return {a: self.skips[a] for a, _ in lease if a in self.skips}

    # ------------------------------------------------------------------ checkpoints and hand-over
    def state_dict(self) -> dict[str, Any]:
        return {"span_docs": self.span_docs, "epoch_docs": self.epoch_docs, "ranks": self.ranks,
                "next_span": self.next_span, "returned": [list(p) for p in self.returned],
                "skips": {str(d): k for d, k in sorted(self.skips.items())},
                "leases": {str(s): [[list(p) for p in lease] for lease in ls] for s, ls in self.leases.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("span_docs", "epoch_docs", "ranks"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the saved data ledger has {key}={state[key]} but this run has {getattr(self, key)}; "
                                 "its positions mean other documents")
        self.next_span = int(state["next_span"])
        self.returned = [(int(a), int(b)) for a, b in state["returned"]]
        self.skips = {int(d): int(k) for d, k in state.get("skips", {}).items()}
        self.leases = {int(s): [[(int(a), int(b)) for a, b in lease] for lease in ls]
                       for s, ls in state["leases"].items()}


def audit(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's "ledger" records (one per round, rounds 0..n, as `Ledger.commit` returns them)
    prove about its data: every document handed out (before `handed_end`) is committed whole once
    or still held (leased or given back) once, and each document's trained tokens chain without a
    gap or an overlap: [0, k1) [k1, k2) ... up to its end (committed) or its skip (held). Pure."""
    whole: dict[int, int] = {}
    chains: dict[int, list[tuple[int, int]]] = {}  # doc -> token ranges trained (-1: to its end)
    for r in records:
        for pieces in r["committed"].values():
            for a, b in pieces:
                for d in range(a, b):
                    whole[d] = whole.get(d, 0) + 1
                    chains.setdefault(d, []).append((int(r.get("resumed", {}).get(str(d), 0)), -1))
        for fragments in r.get("partial", {}).values():
            for d, k0, k1 in fragments:
                chains.setdefault(d, []).append((k0, k1))
    last = records[-1]
    held_pieces = list(last["returned"]) + [p for ls in last["leases"].values() for lease in ls for p in lease]
    held = [d for a, b in held_pieces for d in range(a, b)]
    skips = {int(d): k for d, k in last.get("skips", {}).items()}
    end = int(last["handed_end"])
    broken = []
    for d, ranges in chains.items():
        ranges.sort(key=lambda x: (x[0], x[1] == -1))
        stop = -1 if whole.get(d) else skips.get(d, 0)
        if [k0 for k0, _ in ranges] != [0] + [k1 for _, k1 in ranges[:-1]] or ranges[-1][1] != stop:
            broken.append(d)
    return {"committed": len(whole), "committed_once": sum(1 for n in whole.values() if n == 1),
            "twice": sorted(d for d, n in whole.items() if n > 1), "held": len(held),
            "held_twice": sorted({d for d in held if held.count(d) > 1}) if len(held) != len(set(held)) else [],
            "committed_and_held": sorted(set(whole) & set(held)),
            "missing": sorted(set(range(end)) - set(whole) - set(held)),
            "broken_chains": sorted(broken), "handed_end": end}


class SharedData:
    """One rank's side of the ledger in an elastic run: it follows the membership's events.

    "decision" (every attempt, before its vote): this rank writes its position in its lease (two
    integers, `Position`) to the run's store, signed; a member's vote comes after it, so every member
    that commits has written it. "commit": every member reads the contributors' positions and who
    the committed average excluded, applies the same `Ledger.commit`, and this rank reads its new
    lease. A joiner takes the ledger from a peer with the rest of the run's state
    (`register_state_dict_fn`, compared by digest like the outer state); checkpoints hold it too.
    """

    def __init__(self, loader: Any, ledger: Ledger, site: int, rank: int, store: Any, prefix: str,
                 outer: Any = None) -> None:
        self.loader, self.ledger, self.site, self.rank = loader, ledger, site, rank
        self.store, self.prefix, self.outer = store, prefix, outer

    @classmethod
    def for_run(cls, cfg: Any, world: Any, loader: Any, outer: Any) -> SharedData | None:
        """The shared ledger of an elastic DiLoCo run (None for any other run: fixed slots, as before)."""
        membership = getattr(outer, "membership", None)
        if cfg.diloco is None or not cfg.diloco.elastic or membership is None:
            return None
        span = cfg.data.span_docs
        ledger = Ledger(span, loader.train_documents, world.ranks_per_site, target=4 * span)
        shared = cls(loader, ledger, world.site_rank, world.rank, membership.signed, membership.prefix, outer)
        membership.register_state_dict_fn("ledger", shared.load_state_dict, shared.state_dict, shared.checksum)
        return shared

    def _key(self, round: int, site: int, rank: int) -> str:
        return f"{self.prefix}ledger/r{round}/s{site}/k{rank}"

    def on_event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Follow one membership event; the "ledger" record to log after a commit, else None."""
        if event["event"] == "decision":
            docs, tokens = self.loader.lease_position
            self.store.set(self._key(event["round"], self.site, self.rank), f"{docs},{tokens}")
        elif event["event"] == "commit":
            round, members = event["round"], event["members"]
            contributors = [m for m in members if m not in event.get("joined", [])]
            reads = {m: [self._read(round, m, k) for k in range(self.ledger.ranks)] for m in contributors}
            record = self.ledger.commit(round, members, reads, self._excluded(members) if contributors else [])
            if self.site in members:
                lease = self.ledger.lease(self.site, self.rank)
                self.loader.set_lease(lease, self.ledger.lease_skips(lease))
            return {"event": "ledger", **record}
        return None

    def _read(self, round: int, site: int, rank: int) -> Position:
        docs, _, tokens = self.store.get(self._key(round, site, rank)).decode().partition(",")
        return int(docs), int(tokens or 0)

    def _excluded(self, members: list[int]) -> list[int]:
        """Members whose pseudo-gradient the committed average left out (the last reduce, by group
        index = position in `members`). Rank groups of a site may exclude differently (each checks
        its own shard's bytes): the site takes their union, so every rank of every site agrees."""
        result = getattr(self.outer, "last_reduce", None)
        mine = set() if result is None else {members[i] for i in result.excluded_sites}
        topology = getattr(self.outer, "topology", None)
        if topology is not None and topology.world.ranks_per_site > 1:
            flags = torch.tensor([1.0 if m in mine else 0.0 for m in members], device=topology.world.device)
            topology.site_all_reduce(flags, op=dist.ReduceOp.MAX)
            mine = {m for m, f in zip(members, flags.tolist()) if f > 0}
        return sorted(mine)

    def checksum(self) -> list[Any]:
        """The ledger's state as bytes, for the hand-over's digest comparison across members."""
        return [torch.frombuffer(bytearray(self.ledger.digest().encode()), dtype=torch.uint8)]

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)
