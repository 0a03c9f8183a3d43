"""Data as a shared ledger: who reads which documents of the run's order, round by round.

The train order (shuffled per epoch, zeroband/data/loader.py) is addressed by a global document
index d = epoch x N + j (N train documents, j the position in that epoch's order) and cut into
numbered spans of `span_docs` documents; a span never crosses an epoch (an epoch's last span may be
shorter). A *piece* is a half-open range [start, end) of global indices: a span, or what is left of
one that a member started and did not commit.

Each member site holds a lease per data-parallel rank: the pieces that rank reads next, in order.
At a round's commit every site applies the same `Ledger.commit` to the same inputs (the round's
members, who contributed, and each contributor's documents read per rank), so all sites hold the
same ledger without a leader:
- a contributor's documents read this round are committed (a document counts when its first token
  entered the packing buffer); the rest of its lease stays its own;
- a member that was assigned documents and did not contribute (died, left out, excluded) gives its
  whole unread lease back to the front of the queue, dealt out again before any new span;
- every member of the round is then topped up (`assign`) so that each of its ranks holds at least
  `target` unread documents for the next round.

Why the read counts: a round trains a fixed number of tokens, and documents differ in length, so
how many documents a rank consumes in a round depends on the text; no function of the membership
alone can know it. Each site reports one integer per rank with the round (train.py), and nothing
else crosses sites for data. Fault-free, the order is dealt like the old fixed slots, interleaved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

Piece = tuple[int, int]  # [start, end) global document indices


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

    # ------------------------------------------------------------------ the round's update
    def commit(self, round: int, members: list[int], reads: dict[int, list[int]]) -> dict[str, Any]:
        """Apply round `round`: `reads` maps each member that contributed to its documents read per
        rank; every other lease holder gives its lease back. Then top up `members`. Returns the
        record of what happened (committed pieces per site, pieces given back, the new leases)."""
        committed: dict[int, list[Piece]] = {}
        given_back: list[Piece] = []
        for site in sorted(self.leases):
            if site in reads:
                done = [take_docs(lease, n) for lease, n in zip(self.leases[site], reads[site], strict=True)]
                committed[site] = [p for taken, _ in done for p in taken]
                self.leases[site] = [rest for _, rest in done]
            else:
                given_back += [p for lease in self.leases.pop(site) for p in lease]
        self.returned = sorted(given_back) + self.returned
        # a rank that read r documents this round should hold 2r for the next: leases follow the text
        most = max((n for r in reads.values() for n in r), default=0)
        handed = self.top_up(round, members, max(self.target, 2 * most))
        return {"round": round, "members": sorted(members), "reads": {str(s): r for s, r in sorted(reads.items())},
                "committed": {str(s): p for s, p in committed.items()}, "given_back": sorted(given_back),
                "handed": {str(s): p for s, p in handed.items()}, "returned": list(self.returned),
                "leases": {str(s): ls for s, ls in self.leases.items()}, "handed_end": self.handed_end}

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

    # ------------------------------------------------------------------ checkpoints and hand-over
    def state_dict(self) -> dict[str, Any]:
        return {"span_docs": self.span_docs, "epoch_docs": self.epoch_docs, "ranks": self.ranks,
                "next_span": self.next_span, "returned": [list(p) for p in self.returned],
                "leases": {str(s): [[list(p) for p in lease] for lease in ls] for s, ls in self.leases.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("span_docs", "epoch_docs", "ranks"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the saved data ledger has {key}={state[key]} but this run has {getattr(self, key)}; "
                                 "its positions mean other documents")
        self.next_span = int(state["next_span"])
        self.returned = [(int(a), int(b)) for a, b in state["returned"]]
        self.leases = {int(s): [[(int(a), int(b)) for a, b in lease] for lease in ls]
                       for s, ls in state["leases"].items()}


class SharedData:
    """One rank's side of the ledger in an elastic run: it follows the membership's events.

    "decision" (every attempt, before its vote): this rank writes how many documents of its lease it
    has read to the run's store, signed; a member's vote comes after it, so every member that
    commits has written it. "commit": every member reads the contributors' counts, applies the same
    `Ledger.commit`, and this rank reads its new lease. A joiner takes the ledger from a peer with
    the rest of the run's state (`register_state_dict_fn`); checkpoints hold it too.
    """

    def __init__(self, loader: Any, ledger: Ledger, site: int, rank: int, store: Any, prefix: str) -> None:
        self.loader, self.ledger, self.site, self.rank = loader, ledger, site, rank
        self.store, self.prefix = store, prefix

    @classmethod
    def for_run(cls, cfg: Any, world: Any, loader: Any, outer: Any) -> SharedData | None:
        """The shared ledger of an elastic DiLoCo run (None for any other run: fixed slots, as before)."""
        membership = getattr(outer, "membership", None)
        if cfg.diloco is None or not cfg.diloco.elastic or membership is None:
            return None
        span = cfg.data.span_docs
        ledger = Ledger(span, loader.train_documents, world.ranks_per_site, target=4 * span)
        shared = cls(loader, ledger, world.site_rank, world.rank, membership.signed, membership.prefix)
        membership.register_state_dict_fn("ledger", shared.load_state_dict, shared.state_dict)
        return shared

    def _key(self, round: int, site: int, rank: int) -> str:
        return f"{self.prefix}ledger/r{round}/s{site}/k{rank}"

    def on_event(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Follow one membership event; the "ledger" record to log after a commit, else None."""
        if event["event"] == "decision":
            self.store.set(self._key(event["round"], self.site, self.rank), str(self.loader.lease_read))
        elif event["event"] == "commit":
            round, members = event["round"], event["members"]
            contributors = [m for m in members if m not in event.get("joined", [])]
            reads = {m: [int(self.store.get(self._key(round, m, k))) for k in range(self.ledger.ranks)]
                     for m in contributors}
            record = self.ledger.commit(round, members, reads)
            if self.site in members:
                self.loader.set_lease(self.ledger.lease(self.site, self.rank))
            return {"event": "ledger", **record}
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)
