"""The data ledger (zeroband/data/ledger.py): the corpus document as the unit, dealt once per
epoch in order whatever the churn, leases within their bound, and the audit of a run's records
through relaunches. The dealing logic is pure: random join/leave/kill/exclude sequences check its
invariants after every commit."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from zeroband.data.ledger import (
    Ledger,
    audit,
    chain,
    dealt_of_spans,
    docs_in,
    epoch_table,
    merged,
    take_docs,
)


def test_take_docs_cuts_a_piece_and_merged_joins_touching_ones() -> None:
    assert take_docs([(0, 4), (8, 10)], 5) == ([(0, 4), (8, 9)], [(9, 10)])
    with pytest.raises(ValueError, match="more documents"):
        take_docs([(0, 2)], 3)
    assert merged([(8, 10), (0, 4), (4, 6), (7, 7)]) == [(0, 6), (8, 10)]


def _held(ledger: Ledger) -> list[int]:
    pieces = [p for ls in ledger.leases.values() for lease in ls for p in lease] + ledger.returned
    return [d for a, b in pieces for d in range(a, b)]


def _reads(rng: random.Random, ledger: Ledger, sites: list[int], most: int) -> dict[int, list[tuple[int, int]]]:
    """Each rank's position: whole documents read (at most its lease, and `most`), tokens of the next."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in sites:
        out[s] = []
        for k in range(ledger.ranks):
            docs = rng.randint(0, min(most, docs_in(ledger.lease(s, k))))
            out[s].append((docs, rng.choice([0, rng.randint(1, 30)]) if docs < docs_in(ledger.lease(s, k)) else 0))
    return out


def _check(ledger: Ledger, record: dict[str, Any], whole: dict[int, int], before: int, held_before: int) -> None:
    """The invariants after one commit (see the module docstring of zeroband/data/ledger.py)."""
    for pieces in record["committed"].values():
        for a, b in pieces:
            for d in range(a, b):
                whole[d] = whole.get(d, 0) + 1
    held = _held(ledger)
    # every document dealt is committed once or held once: none twice in its epoch, none skipped, so no
    # document of an epoch is unread (neither read nor held to be read next) once a later one is dealt
    assert max(whole.values(), default=1) == 1, "a document committed twice"
    assert sorted(held + list(whole)) == list(range(ledger.dealt)), "a document lost or held twice"
    # the bound: every rank of every member holds exactly the round's want, nobody else holds a lease
    assert set(ledger.leases) == set(record["members"])
    assert all(docs_in(lease) == record["want"] for ls in ledger.leases.values() for lease in ls)
    assert all(lease == sorted(lease) for ls in ledger.leases.values() for lease in ls), "oldest first"
    # the cursor moves only to fill leases: what it dealt is what the round needed beyond the given-back
    fresh = ledger.dealt - before
    assert fresh >= 0 and (fresh == 0 or not ledger.returned), "dealt new documents while given-back ones waited"
    assert len(held) <= max(held_before, 0) + sum(docs_in(lease) for ls in ledger.leases.values() for lease in ls)


def _simulate(seed: int, rounds: int = 30) -> tuple[Ledger, list[dict[str, Any]]]:
    """A run of random churn: sites die (kill -9, a hang, a group kill), leave, join and rejoin,
    are excluded from an average, ranks read random amounts and rounds end inside documents."""
    rng = random.Random(seed)
    ranks = rng.choice([1, 2])
    ledger = Ledger(epoch_docs=rng.randint(7, 40), ranks=ranks, target=rng.randint(1, 6))
    slots = list(range(rng.randint(2, 6)))
    members = sorted(rng.sample(slots, rng.randint(1, len(slots))))
    records = [ledger.commit(members, {})]
    whole: dict[int, int] = {}
    _check(ledger, records[0], whole, 0, 0)
    for _ in range(rounds):
        before, held_before = ledger.dealt, len(_held(ledger))
        dying = [m for m in members if rng.random() < 0.2]  # killed, hung, left: no report, lease back
        if len(dying) == len(members) and rng.random() < 0.5:
            dying = dying[1:]
        contributors = [m for m in members if m not in dying]
        joiners = [s for s in slots if s not in members and rng.random() < 0.3]
        excluded = [m for m in contributors if rng.random() < 0.1]
        reads = _reads(rng, ledger, contributors, most=rng.randint(0, 12))
        new = sorted(contributors + joiners) or sorted(rng.sample(slots, 1))
        record = json.loads(json.dumps(ledger.commit(new, reads, excluded)))
        records.append(record)
        _check(ledger, record, whole, before, held_before)
        members = new
        again = Ledger(ledger.epoch_docs, ranks, ledger.target)
        again.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
        assert again == ledger and again.digest() == record["digest"]
    return ledger, records


@pytest.mark.parametrize("block", range(4))
def test_random_churn_deals_every_document_once_per_epoch_within_the_bound(block: int) -> None:
    epochs = 0
    for seed in range(block * 50, block * 50 + 50):
        ledger, records = _simulate(seed)
        found = audit(records)
        assert not (found["twice"] or found["lost"] or found["held_twice"] or found["committed_and_held"]
                    or found["broken_chains"] or found["leases_off_bound"] or found["differing"]), (seed, found)
        assert all(e["never"] == 0 and e["twice"] == 0 for e in found["epochs"]), (seed, found["epochs"])
        assert found["rounds"] == len(records) and found["last_round"] == len(records) - 1
        epochs = max(epochs, len(found["epochs"]))
    assert epochs >= 5  # the sequences cross several epochs


def test_joins_and_leaves_deal_nothing_new_and_leave_other_leases_alone() -> None:
    """The soak's failure (issue 34): each join gave every member another piece, so leases grew with
    every join and the cursor ran through epochs nobody read. Now a joiner takes what was given back
    or never dealt, and a site that comes and goes a hundred times moves the cursor by its own lease."""
    ledger = Ledger(epoch_docs=50, ranks=2, target=4)
    ledger.commit([0, 1], {})
    first = {s: [ledger.lease(s, k) for k in range(2)] for s in (0, 1)}
    assert ledger.dealt == 16
    for _ in range(100):
        ledger.commit([0, 1, 2], {0: [(0, 0)] * 2, 1: [(0, 0)] * 2})  # site 2 joins, nobody read anything
        assert ledger.dealt == 24 and {s: [ledger.lease(s, k) for k in range(2)] for s in (0, 1)} == first
        ledger.commit([0, 1], {0: [(0, 0)] * 2, 1: [(0, 0)] * 2})  # and is killed before it reports
        assert ledger.dealt == 24 and docs_in(ledger.returned) == 8
    record = ledger.commit([0, 1, 3], {0: [(0, 0)] * 2, 1: [(0, 0)] * 2})  # a new site takes site 2's old lease
    assert record["handed"] == {"3": [(16, 24)]} and ledger.dealt == 24 and not ledger.returned


def test_a_left_out_sites_lease_is_held_one_commit_for_its_late_work() -> None:
    """diloco.late_weight > 0 (`hold_late`): a site left out of a commit keeps its lease, untouched
    and not topped up, for one more commit. Read there (its late work merged), its documents commit;
    not read, they are given back then. Without hold_late they go back at once, as before."""
    ledger = Ledger(epoch_docs=100, ranks=1, target=4, hold_late=True)
    ledger.commit([0, 1], {})
    lease1 = ledger.lease(1, 0)
    left = ledger.commit([0], {0: [(2, 0)]})  # site 1 late: not a member
    assert left["held"] == [1] and left["given_back"] == [] and ledger.lease(1, 0) == lease1
    late = ledger.commit([0, 1], {0: [(1, 0)], 1: [(3, 0)]})  # its late work, 3 documents read
    assert late["held"] == [] and late["committed"]["1"] == [(lease1[0][0], lease1[0][0] + 3)]
    ledger.commit([0], {0: [(1, 0)]})  # late again
    gone = ledger.commit([0], {0: [(1, 0)]})  # and never brought its work: the lease goes back
    assert gone["given_back"] and 1 not in ledger.leases
    plain = Ledger(epoch_docs=100, ranks=1, target=4)
    plain.commit([0, 1], {})
    assert plain.commit([0], {0: [(0, 0)]})["given_back"] == merged(plain.returned) != []


def test_the_next_epoch_is_dealt_only_once_this_one_is_dealt_out() -> None:
    ledger = Ledger(epoch_docs=10, ranks=1, target=4)
    ledger.commit([0, 1], {})  # 0: [0, 4), 1: [4, 8)
    record = ledger.commit([0], {0: [(2, 0)]})  # site 1 died: its lease goes to site 0 first
    assert record["committed"] == {"0": [(0, 2)]} and ledger.lease(0, 0) == [(2, 6)] and ledger.returned == [(6, 8)]
    record = ledger.commit([0, 1], {0: [(2, 0)]})  # then the rest of it, then epoch 0's last two, then epoch 1
    assert ledger.lease(0, 0) == [(4, 8)] and ledger.lease(1, 0) == [(8, 12)]
    assert record["dealt"] == 12 and record["want"] == 4


def test_a_lease_follows_the_text_and_gives_its_newest_back_when_it_shrinks() -> None:
    ledger = Ledger(epoch_docs=100, ranks=1, target=2)
    ledger.commit([0], {})
    ledger.commit([0], {0: [(2, 0)]})  # read 2: want 4
    assert ledger.lease(0, 0) == [(2, 6)]
    ledger.commit([0], {0: [(0, 5)]})  # read none: want back to 2, documents 4 and 5 given back
    assert ledger.lease(0, 0) == [(2, 4)] and ledger.returned == [(4, 6)] and ledger.skips == {2: 5}
    ledger.commit([0, 1], {0: [(1, 0)]})  # round 3: member 3 % 2 first, the given-back documents to it
    assert ledger.lease(1, 0) == [(4, 6)] and ledger.lease(0, 0) == [(3, 4), (6, 7)] and not ledger.returned


def test_a_cut_document_goes_on_from_its_first_untrained_token() -> None:
    ledger = Ledger(epoch_docs=100, ranks=1, target=4)
    ledger.commit([0, 1], {})
    first = ledger.commit([0, 1], {0: [(1, 7)], 1: [(0, 3)]})  # both rounds end inside a document
    assert first["partial"] == {"0": [[1, 0, 7]], "1": [[4, 0, 3]]} and ledger.skips == {1: 7, 4: 3}
    assert ledger.lease_skips(ledger.lease(0, 0)) == {1: 7}
    second = ledger.commit([0], {0: [(2, 0)]})  # site 1 died: its cut document goes to site 0, at token 3
    assert second["given_back"] == [(4, 8)] and ledger.skips[4] == 3 and ledger.lease(0, 0) == [(3, 6), (8, 9)]
    assert second["committed"] == {"0": [(1, 3)]} and second["resumed"] == {"1": 7}
    excluded = ledger.commit([0], {0: [(1, 9)]}, excluded=[0])  # excluded: nothing it read counts
    assert excluded["committed"] == {} and excluded["excluded"] == [0] and ledger.skips == {4: 3}
    assert ledger.lease_skips(ledger.lease(0, 0)) == {4: 3}


def test_load_refuses_a_ledger_of_another_corpus_and_reads_a_span_checkpoint() -> None:
    with pytest.raises(ValueError, match="epoch_docs=100 but this run has 90"):
        Ledger(90, 1, 8).load_state_dict(Ledger(100, 1, 8).state_dict())
    old = {"span_docs": 4, "epoch_docs": 10, "ranks": 1, "next_span": 4, "returned": [[2, 3]], "skips": {},
           "leases": {"0": [[[10, 14]]]}}  # spans 0..3: [0,4) [4,8) [8,10) [10,14)
    assert dealt_of_spans(old) == 14 and dealt_of_spans({**old, "next_span": 0}) == 0
    ledger = Ledger(10, 1, 4)
    ledger.load_state_dict(old)
    assert ledger.dealt == 14 and ledger.round == 0 and ledger.lease(0, 0) == [(10, 14)]


def test_epoch_table_counts_the_corpus_per_epoch() -> None:
    rows = epoch_table({0: 1, 1: 2, 5: 1}, {2}, dealt=6, n=4)
    assert rows == [{"epoch": 0, "documents": 4, "once": 1, "twice": 1, "held": 1, "never": 1, "not_dealt": 0},
                    {"epoch": 1, "documents": 4, "once": 1, "twice": 0, "held": 0, "never": 1, "not_dealt": 2}]


def _relaunched(seed: int) -> tuple[list[dict[str, Any]], int]:
    """Records of a run stopped in full and relaunched from the lowest site's checkpoint, which is two
    commits older than the others' (they went on after it left): those two commits are undone."""
    rng = random.Random(seed)
    ledger = Ledger(epoch_docs=13, ranks=1, target=3)
    records = [ledger.commit([0, 1, 2], {})]
    saved: dict[int, dict[str, Any]] = {}
    for r in range(1, 12):
        members = [0, 1, 2] if r < 8 else [1, 2]
        records.append(ledger.commit(members, _reads(rng, ledger, members, 5)))
        saved[r] = ledger.state_dict()
    ledger = Ledger(13, 1, 3)
    ledger.load_state_dict(saved[7])  # the lowest site's checkpoint: it left after round 7
    records.append(ledger.commit([0, 1, 2], {}))  # the relaunch's first round: everyone fresh
    for _ in range(6):
        records.append(ledger.commit([0, 1, 2], _reads(rng, ledger, [0, 1, 2], 5)))
    for i, record in enumerate(records):
        record["time"] = i
    return records, ledger.round


def test_the_audit_follows_the_run_through_a_relaunch() -> None:
    """Issue 34: after a full stop and relaunch the rounds started again at 0 and the audit read two
    sets of records as one ledger that differed. Now the round goes on from the checkpoint and the
    audit follows each record's parent: the relaunch undid rounds 8-11, which are reported as such."""
    records, last = _relaunched(0)
    assert [r["round"] for r in records] == list(range(12)) + list(range(8, 15))
    line, off = chain(records[::-1])  # in any order, from any sites
    assert [r["round"] for r in line] == list(range(15)) and last == 15
    assert off == {"differing": [], "superseded": [8, 9, 10, 11], "missing": []}
    found = audit(records + records[3:6])  # the same commits logged by several sites
    assert found["rounds"] == 15 and not (found["twice"] or found["lost"] or found["broken_chains"]), found
    assert found["committed"] > 20 and all(e["never"] == 0 for e in found["epochs"])
    forged = {**records[4], "digest": "0" * 16}  # same inputs, another result: sites that differ
    assert chain(records + [forged])[1]["differing"] == [4]
    assert chain([r for r in records if r["round"] != 5])[1]["missing"] == [5]


def test_the_report_prints_the_epochs_and_names_a_ledger_that_differs(tmp_path, capsys) -> None:
    from zeroband.tools.report import main

    records, _ = _relaunched(1)
    for site in (0, 1):
        (tmp_path / f"site{site}").mkdir()
        lines = [json.dumps({"kind": "data", **r}) for r in records[site::2]]
        (tmp_path / f"site{site}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rounds 0-14, unlogged [], ledgers differing [], undone by a relaunch 4)" in out, out
    assert "| epoch | documents | read once | twice | never |" in out and "| 0 | 13 | 13 | 0 | 0 |" in out, out
    forged = {"kind": "data", **records[3], "digest": "0" * 16}
    with (tmp_path / "site1" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(forged) + "\n")
    assert main(["data", str(tmp_path)]) == 1 and "ledgers differing [3]" in capsys.readouterr().out
