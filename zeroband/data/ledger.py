"""Data as a shared ledger: which corpus documents each rank reads, round by round.

The unit is the corpus document. The train order is shuffled per epoch (zeroband/data/loader.py),
and a document is addressed by its global index d = epoch x N + j (N train documents, j its
position in that epoch's permutation), so each epoch's indices are the N corpus documents once
each. The ledger deals the indices out in order: one cursor (`dealt`, the first index never dealt)
that only moves forward, so every document of an epoch is dealt once before any document of the
next one, and the order of documents never depends on who joined or left. A *piece* is a
half-open range [start, end) of global indices.

Each member site holds a lease per data-parallel rank: the pieces that rank reads next, oldest
first. At a round's commit every site applies the same `Ledger.commit` to the same inputs (the
round's members, who contributed, who was excluded, and each contributor's position per rank),
so all sites hold the same ledger without a leader:
- "committed" means trained into the outer step that round: the tokens a contributor's ranks
  trained on (were targets in a row) since the last commit. A rank reports its position as
  (documents all of whose tokens were trained, tokens trained of the next one); whole documents
  are committed, and a document cut by the round's end commits the tokens trained so far and is
  noted in `skips`: whoever reads it next starts at that token. So a document packed across a
  round boundary is neither lost nor read twice, wherever its tail goes;
- a member that was dealt documents and did not contribute (died, left out, joined this round)
  or was excluded from the average (zeroband/comm/reduce.py: its local progress is replaced by the
  average, so its reads were trained into nothing) gives its whole lease back (`returned`);
- then every rank of every member is brought to exactly `want` unread documents, the round's
  lease size: a lease over it gives its newest documents back, one under it is dealt the
  difference, given-back documents (oldest first) before the cursor's. A join therefore takes its
  share from what was given back or never dealt, and nobody else's lease grows.

The bound: after every commit each member's rank holds exactly `want` = max(`target`, 2 x the
most documents any rank read that round) documents, whatever the churn (a rank that read r
documents in a round holds 2r for the next: leases follow the text). Documents dealt and not yet
committed are those leases plus the given-back ones, so the cursor runs ahead of what was trained
by at most that much: a document of epoch e+1 is dealt only once every document of epoch e was
committed or is held, and held ones are read first (leases are kept sorted).

Why the positions: a round trains a fixed number of tokens, and documents differ in length, so
how many documents a rank consumes in a round depends on the text; no function of the membership
alone can know it. Each rank reports two integers with the round, and nothing else crosses sites
for data. `SharedData` (zeroband/membership/data.py) is the ledger's side of the round protocol
(`RoundParticipant`): the membership calls it on the main thread before each vote and at each commit.
This module is pure: no torch, no store, no process.

`round` counts the commits the ledger applied: it travels with the ledger (checkpoints, the
hand-over to joiners), so the run's round numbers go on across a full stop and relaunch, while the
membership's own round clock starts again with a fresh store. Each commit's record names the state
it started from (`parent`) and the one it made (`digest`), so `audit` follows the run's one chain of
commits through restarts (`chain`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

Piece = tuple[int, int]  # [start, end) global document indices
Position = tuple[int, int]  # (documents wholly trained, tokens trained of the next one) of a lease
Record = dict[str, Any]


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


def merged(pieces: list[Piece]) -> list[Piece]:
    """`pieces` sorted, touching ones joined: the same documents, oldest first, in fewest pieces."""
    out: list[Piece] = []
    for start, end in sorted(pieces):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        elif end > start:
            out.append((start, end))
    return out


def as_position(read: int | Position | list[int]) -> Position:
    """A rank's report: a bare count of documents (whole ones only) or (documents, tokens of the next)."""
    return (int(read), 0) if isinstance(read, int) else (int(read[0]), int(read[1]))


@dataclass
class Ledger:
    """The run's data position, identical on every site: the first document never dealt, pieces
    given back and not yet dealt again, and each member site's unread lease per rank."""

    epoch_docs: int
    ranks: int  # data-parallel ranks per site
    target: int  # the least unread documents each rank holds after a commit
    round: int = 0  # commits applied: the run's round number, through restarts
    dealt: int = 0  # global index of the first document never dealt (epoch: dealt // epoch_docs)
    returned: list[Piece] = field(default_factory=list)
    leases: dict[int, list[list[Piece]]] = field(default_factory=dict)  # site -> per rank
    skips: dict[int, int] = field(default_factory=dict)  # document -> its tokens already committed
    # diloco.late_weight > 0: a site left out of a round keeps its lease one more commit, where its
    # late pseudo-gradient (the documents it read) may still be merged; otherwise it gives it back
    hold_late: bool = False
    held: dict[int, int] = field(default_factory=dict)  # site -> the round whose commit held its lease

    # ------------------------------------------------------------------ the round's update
    def commit(self, members: list[int], reads: dict[int, list[Any]], excluded: list[int] | tuple[int, ...] = (),
               protocol_round: int | None = None) -> Record:
        """Apply the next round: `reads` maps each member that contributed to its position per rank
        (`as_position`); every other lease holder, and every site in `excluded`, gives its lease
        back. Then every rank of `members` holds `want` documents (`deal_to`). Returns the record
        of what happened (documents committed whole per site, tokens of cut documents, pieces given
        back, the new leases); `protocol_round`: the membership's round, noted in it."""
        parent = self.digest()
        committed: dict[int, list[Piece]] = {}
        partial: dict[int, list[list[int]]] = {}
        resumed: dict[int, int] = {}  # committed documents whose reading started at a token > 0
        given_back: list[Piece] = []
        for site in sorted(self.leases):
            late = self.held.pop(site, None) is not None
            if site in reads and site not in excluded:
                committed[site], partial[site] = [], []
                self.leases[site] = [self._commit_rank(lease, as_position(read), committed[site], partial[site], resumed)
                                     for lease, read in zip(self.leases[site], reads[site], strict=True)]
            elif self.hold_late and not late and site not in members and site not in excluded:
                self.held[site] = self.round  # left out: its work may come to the next merge
            else:
                given_back += [p for lease in self.leases.pop(site) for p in lease]
        self.returned = merged(given_back + self.returned)
        want = max(self.target, 2 * max((as_position(n)[0] for r in reads.values() for n in r), default=0))
        handed = self.deal_to(members, want)
        record = {"round": self.round, "protocol_round": protocol_round, "members": sorted(members),
                  "reads": {str(s): [list(as_position(n)) for n in r] for s, r in sorted(reads.items())},
                  "excluded": sorted(excluded), "committed": {str(s): merged(p) for s, p in committed.items()},
                  "partial": {str(s): p for s, p in partial.items() if p}, "resumed": {str(d): k for d, k in resumed.items()},
                  "skips": {str(d): k for d, k in sorted(self.skips.items())}, "given_back": merged(given_back),
                  "handed": {str(s): p for s, p in handed.items()}, "returned": list(self.returned),
                  "leases": {str(s): ls for s, ls in sorted(self.leases.items())}, "want": want,
                  "held": sorted(self.held),
                  "dealt": self.dealt, "epoch_docs": self.epoch_docs, "parent": parent}
        self.round += 1
        return {**record, "digest": self.digest()}

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

    def deal(self, n: int) -> list[Piece]:
        """The next `n` documents to deal: given-back ones first (oldest first), then the cursor's."""
        taken, self.returned = take_docs(self.returned, min(n, docs_in(self.returned)))
        if (fresh := n - docs_in(taken)) > 0:
            taken.append((self.dealt, self.dealt + fresh))
            self.dealt += fresh
        return taken

    def deal_to(self, members: list[int], want: int) -> dict[int, list[Piece]]:
        """Every rank of `members` to exactly `want` unread documents: a lease over it gives its newest
        documents back first, then the ones under it are dealt the difference (`deal`), member by
        member from member `round % n` on, so no member always gets the oldest. Returns what each
        member received."""
        for m in members:
            self.leases.setdefault(m, [[] for _ in range(self.ranks)])
        for ranks in self.leases.values():
            for k, lease in enumerate(ranks):
                ranks[k], extra = take_docs(lease, min(want, docs_in(lease)))
                self.returned = merged(self.returned + extra)
        ordered = sorted(members)
        ordered = ordered[self.round % len(ordered):] + ordered[:self.round % len(ordered)] if ordered else []
        handed: dict[int, list[Piece]] = {}
        for m in ordered:
            for k, lease in enumerate(self.leases[m]):
                got = self.deal(want - docs_in(lease))
                self.leases[m][k] = merged(lease + got)
                handed[m] = merged(handed.get(m, []) + got)
        return {m: p for m, p in sorted(handed.items()) if p}

    def digest(self) -> str:
        """16 hex digits of the ledger's state: equal on every site that applied the same commits."""
        return hashlib.sha256(json.dumps(self.state_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def lease(self, site: int, rank: int) -> list[Piece]:
        return list(self.leases.get(site, [[]] * self.ranks)[rank])

    def lease_skips(self, lease: list[Piece]) -> dict[int, int]:
        """The documents of `lease` that an earlier reader cut at a round's end: doc -> first token to read."""
        return {d: k for d, k in self.skips.items() if any(a <= d < b for a, b in lease)}

    # ------------------------------------------------------------------ checkpoints and hand-over
    def state_dict(self) -> dict[str, Any]:
        return {"epoch_docs": self.epoch_docs, "ranks": self.ranks, "round": self.round, "dealt": self.dealt,
                "returned": [list(p) for p in self.returned],
                "skips": {str(d): k for d, k in sorted(self.skips.items())},
                "leases": {str(s): [[list(p) for p in lease] for lease in ls] for s, ls in sorted(self.leases.items())},
                **({"held": {str(s): r for s, r in sorted(self.held.items())}} if self.held else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch_docs", "ranks"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the saved data ledger has {key}={state[key]} but this run has {getattr(self, key)}; "
                                 "its positions mean other documents")
        self.round = int(state.get("round", 0))
        self.dealt = int(state["dealt"]) if "dealt" in state else dealt_of_spans(state)
        self.returned = [(int(a), int(b)) for a, b in state["returned"]]
        self.skips = {int(d): int(k) for d, k in state.get("skips", {}).items()}
        self.leases = {int(s): [[(int(a), int(b)) for a, b in lease] for lease in ls]
                       for s, ls in state["leases"].items()}
        self.held = {int(s): int(r) for s, r in state.get("held", {}).items()}


def dealt_of_spans(state: dict[str, Any]) -> int:
    """`Ledger.dealt` of a checkpoint from before it (numbered spans of `span_docs`, none crossing an
    epoch): one past the last span's end. The pieces it holds are global indices either way."""
    n, span, spans = int(state["epoch_docs"]), int(state["span_docs"]), int(state["next_span"])
    if spans == 0:
        return 0
    per_epoch = -(-n // span)
    epoch, k = divmod(spans - 1, per_epoch)
    return min(epoch * n + (k + 1) * span, (epoch + 1) * n)


# ---------------------------------------------------------------------- what the records prove
def commit_inputs(record: Record) -> str:
    """What a commit was applied to (the state it started from and the round's reports): two records
    with the same inputs must hold the same result on every site."""
    keys = ("round", "parent", "members", "reads", "excluded")
    return json.dumps({k: record.get(k) for k in keys}, sort_keys=True)


def chain(records: list[Record]) -> tuple[list[Record], dict[str, list[int]]]:
    """The run's one line of commits among every site's records (duplicates, restarts included): from
    the newest round back through each record's `parent`. Also what did not fit on it, by round:
    "differing" (sites that applied the same inputs and got different ledgers: a bug), "superseded"
    (commits a relaunch from an older checkpoint undid: their training was rolled back with them),
    "missing" (rounds nobody logged). Pure."""
    by_digest: dict[str, Record] = {}
    results: dict[str, set[str]] = {}
    for r in records:
        by_digest.setdefault(r["digest"], r)
        results.setdefault(commit_inputs(r), set()).add(r["digest"])
    differing = sorted({json.loads(k)["round"] for k, digests in results.items() if len(digests) > 1})
    line: list[Record] = []
    missing: list[int] = []
    # the newest record written (a branch a relaunch undid was written before it), then the highest round
    tip = max(by_digest.values(), key=lambda r: (r.get("time", 0), r["round"], r["digest"]), default=None)
    while tip is not None:
        line.append(tip)
        parent = by_digest.get(tip.get("parent", ""))
        if parent is None and tip["round"] > 0:  # nobody logged the round before: go on from the newest older one
            older = [r for r in by_digest.values() if r["round"] < tip["round"]]
            parent = max(older, key=lambda r: (r["round"], r["digest"]), default=None)
            missing += range(parent["round"] + 1 if parent else 0, tip["round"])
        tip = parent
    line.reverse()
    on_line = {r["digest"] for r in line}
    superseded = sorted({r["round"] for r in by_digest.values() if r["digest"] not in on_line} - set(differing))
    return line, {"differing": differing, "superseded": superseded, "missing": sorted(missing)}


def epoch_table(committed: dict[int, int], held: set[int], dealt: int, n: int) -> list[dict[str, Any]]:
    """Per epoch of the corpus (N documents, each once per epoch): documents read once, more than
    once, held (dealt, read next by their holder), never (neither, in an epoch the cursor has left:
    unread while a later epoch is read) and not yet dealt."""
    rows = []
    for epoch in range(max(dealt - 1, 0) // n + 1):
        docs = range(epoch * n, (epoch + 1) * n)
        read = [committed.get(d, 0) for d in docs]
        kept = sum(1 for d in docs if d in held and not committed.get(d))
        undealt = max(0, (epoch + 1) * n - max(dealt, epoch * n))
        rows.append({"epoch": epoch, "documents": n, "once": read.count(1), "twice": sum(1 for k in read if k > 1),
                     "held": kept, "never": n - undealt - kept - sum(1 for k in read if k), "not_dealt": undealt})
    return rows


def audit(records: list[Record]) -> dict[str, Any]:
    """What a run's "ledger" records prove about its data, on the run's line of commits (`chain`):
    per epoch, documents read once, twice, never (`epoch_table`); every document dealt (before
    `dealt`) committed whole once or still held once; each document's trained tokens chaining
    without a gap or an overlap: [0, k1) [k1, k2) ... up to its end (committed) or its skip (held);
    and every lease within the round's bound (`want` documents per rank). Pure."""
    line, off = chain(records)
    if not line:
        return {"rounds": 0}
    whole: dict[int, int] = {}
    chains: dict[int, list[tuple[int, int]]] = {}  # doc -> token ranges trained (-1: to its end)
    lease_max: list[int] = []
    over: list[int] = []
    for r in line:
        for pieces in r["committed"].values():
            for a, b in pieces:
                for d in range(a, b):
                    whole[d] = whole.get(d, 0) + 1
                    chains.setdefault(d, []).append((int(r.get("resumed", {}).get(str(d), 0)), -1))
        for fragments in r.get("partial", {}).values():
            for d, k0, k1 in fragments:
                chains.setdefault(d, []).append((k0, k1))
        held_for = {str(s) for s in r.get("held", [])}  # a left-out site's lease, kept as it was (not topped up)
        sizes = [docs_in(lease) for s, ls in r["leases"].items() if s not in held_for for lease in ls]
        lease_max.append(max(sizes, default=0))
        if any(s != r["want"] for s in sizes):
            over.append(r["round"])
    last = line[-1]
    held_pieces = list(last["returned"]) + [p for ls in last["leases"].values() for lease in ls for p in lease]
    held = [d for a, b in held_pieces for d in range(a, b)]
    skips = {int(d): k for d, k in last.get("skips", {}).items()}
    broken = []
    for d, ranges in chains.items():
        ranges.sort(key=lambda x: (x[0], x[1] == -1))
        stop = -1 if whole.get(d) else skips.get(d, 0)
        if [k0 for k0, _ in ranges] != [0] + [k1 for _, k1 in ranges[:-1]] or ranges[-1][1] != stop:
            broken.append(d)
    dealt = int(last["dealt"])
    return {"rounds": len(line), "first_round": line[0]["round"], "last_round": last["round"], **off,
            "committed": len(whole), "committed_once": sum(1 for n in whole.values() if n == 1),
            "twice": sorted(d for d, n in whole.items() if n > 1), "held": len(held),
            "held_twice": sorted({d for d in held if held.count(d) > 1}) if len(held) != len(set(held)) else [],
            "committed_and_held": sorted(set(whole) & set(held)),
            "lost": sorted(set(range(dealt)) - set(whole) - set(held)), "broken_chains": sorted(broken),
            "dealt": dealt, "epochs": epoch_table(whole, set(held), dealt, int(last["epoch_docs"])),
            "lease_max": lease_max, "want_max": max(r["want"] for r in line), "leases_off_bound": over}

