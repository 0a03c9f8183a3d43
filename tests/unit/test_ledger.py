"""The data ledger (zeroband/data/ledger.py): assignment, commits under churn, state round trips."""

from __future__ import annotations

import json
import random

import pytest

from zeroband.data.ledger import Ledger, assign, audit, docs_in, span_piece, split_over_ranks, take_docs


def test_assign_splits_the_next_spans_among_the_members_whatever_their_order() -> None:
    got = assign(10, [2, 0, 5], round=4, spans_per_member=3)
    assert got == assign(10, [5, 2, 0], round=4, spans_per_member=3)  # the caller's order does not matter
    spans = sorted(s for ids in got.values() for s in ids)
    assert spans == list(range(10, 19)) and all(len(ids) == 3 for ids in got.values())
    assert got != assign(10, [2, 0, 5], round=5, spans_per_member=3)  # the first pick rotates with the round
    assert assign(0, [7], 0, 2) == {7: [0, 1]} and assign(3, [1, 2], 0, 0) == {1: [], 2: []}


def test_spans_cover_each_epoch_and_never_cross_one() -> None:
    pieces = [span_piece(s, 4, 10) for s in range(6)]  # 10 documents per epoch: spans of 4, 4, 2
    assert pieces == [(0, 4), (4, 8), (8, 10), (10, 14), (14, 18), (18, 20)]


def test_take_docs_cuts_a_piece() -> None:
    assert take_docs([(0, 4), (8, 10)], 5) == ([(0, 4), (8, 9)], [(9, 10)])
    assert split_over_ranks([(0, 1), (1, 2), (2, 3)], 2) == [[(0, 1), (2, 3)], [(1, 2)]]
    with pytest.raises(ValueError, match="more documents"):
        take_docs([(0, 2)], 3)


def _check_partition(ledger: Ledger, committed: list[tuple[int, int]]) -> None:
    """Committed, leased and given-back documents are exactly the documents handed out so far, once each."""
    held = [p for ls in ledger.leases.values() for lease in ls for p in lease] + ledger.returned
    docs = [d for a, b in committed + held for d in range(a, b)]
    end = span_piece(ledger.next_span - 1, ledger.span_docs, ledger.epoch_docs)[1] if ledger.next_span else 0
    assert sorted(docs) == list(range(end)), "a document is missing or counted twice"


def test_churn_commits_every_document_exactly_once() -> None:
    """Sites die mid-round (no reads), rejoin, a new one joins, one leaves for good, one is excluded
    from an average, rounds end inside documents: every document handed out is committed, held or
    given back exactly once, its tokens chain without gap or overlap, given-back ones are read next."""
    rng = random.Random(0)
    ledger = Ledger(span_docs=5, epoch_docs=37, ranks=2, target=12)
    records = [ledger.commit(0, [0, 1, 2], {})]
    committed: list[tuple[int, int]] = []
    members = [0, 1, 2]
    plan = {3: "kill 1", 5: "join 1", 6: "join 3", 7: "exclude 3", 8: "leave 0", 9: "kill 2", 10: "join 2"}
    for r in range(1, 14):
        action, _, site = plan.get(r, " ").partition(" ")
        contributors = [m for m in members if not (action in ("kill", "leave") and m == int(site))]
        reads = {m: [(rng.randint(0, min(12, docs_in(ledger.lease(m, k)) - 1)), rng.randint(0, 40)) for k in range(2)]
                 for m in contributors}
        excluded = [int(site)] if action == "exclude" else []
        record = ledger.commit(r, contributors + ([int(site)] if action == "join" else []), reads, excluded)
        records.append(json.loads(json.dumps(record)))
        members = record["members"]
        committed += [p for ps in record["committed"].values() for p in ps]
        if action in ("kill", "leave", "exclude"):
            assert record["given_back"] and str(site) not in record["committed"], "the site's lease goes back"
        _check_partition(ledger, committed)
        again = Ledger(5, 37, 2, 12)
        again.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
        assert again == ledger and again.digest() == record["digest"]
    assert ledger.next_span > 8  # spans past the first epoch (37 docs) were dealt
    found = audit(records)
    assert found["committed"] == found["committed_once"] > 40 and found["held"] > 0, found
    assert not (found["twice"] or found["held_twice"] or found["committed_and_held"] or found["missing"]
                or found["broken_chains"]), found
    assert sum(len(f) for r in records for f in r["partial"].values()) > 10 and any(r["resumed"] for r in records)


def test_a_cut_document_goes_on_from_its_first_untrained_token() -> None:
    ledger = Ledger(span_docs=4, epoch_docs=100, ranks=1, target=4)
    ledger.top_up(0, [0, 1])
    first = ledger.commit(1, [0, 1], {0: [(1, 7)], 1: [(0, 3)]})  # both rounds end inside a document
    assert first["partial"] == {"0": [[1, 0, 7]], "1": [[4, 0, 3]]} and ledger.skips == {1: 7, 4: 3}
    assert ledger.lease_skips(ledger.lease(0, 0)) == {1: 7}
    second = ledger.commit(2, [0], {0: [(2, 0)]})  # site 1 died: its cut document goes to site 0, at token 3
    assert second["given_back"][0] == (4, 8) == ledger.returned[0] and ledger.skips[4] == 3
    assert second["committed"] == {"0": [(1, 3)]} and second["resumed"] == {"1": 7}
    excluded = ledger.commit(3, [0], {0: [(1, 9)]}, excluded=[0])  # excluded: nothing it read counts
    assert excluded["committed"] == {} and excluded["excluded"] == [0] and ledger.skips == {4: 3}
    assert (4, 8) in ledger.lease(0, 0) and ledger.lease_skips(ledger.lease(0, 0)) == {4: 3}


def test_given_back_pieces_are_dealt_before_new_spans() -> None:
    ledger = Ledger(span_docs=4, epoch_docs=100, ranks=1, target=4)
    ledger.top_up(0, [0, 1])
    lost = ledger.lease(1, 0)
    record = ledger.commit(1, [0], {0: [4]})  # site 1 died: its unread lease goes to site 0 first
    assert record["given_back"] == lost and record["handed"]["0"][0] == lost[0]
    assert record["committed"] == {"0": [(0, 4)]}


def test_load_refuses_a_ledger_of_other_spans() -> None:
    with pytest.raises(ValueError, match="span_docs=4 but this run has 8"):
        Ledger(8, 100, 1, 8).load_state_dict(Ledger(4, 100, 1, 8).state_dict())


def test_the_report_proves_a_run_s_data_and_names_a_ledger_that_differs(tmp_path, capsys) -> None:
    from zeroband.tools.report import main

    ledger = Ledger(span_docs=4, epoch_docs=100, ranks=1, target=4)
    records = [ledger.commit(0, [0, 1], {}), ledger.commit(1, [0, 1], {0: [(2, 5)], 1: [(1, 0)]}),
               ledger.commit(2, [0], {0: [(1, 3)]})]  # site 1 died in round 2
    for site, mine in ((0, records), (1, records[:2])):
        (tmp_path / f"site{site}").mkdir()
        lines = [json.dumps({"kind": "data", **r}) for r in mine]
        (tmp_path / f"site{site}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["data", str(tmp_path)]) == 0
    assert "committed: 4 / 4 (twice 0, lost 0, token chains broken 0; 3 rounds" in capsys.readouterr().out
    forged = {"kind": "data", **records[1], "digest": "0" * 16}
    (tmp_path / "site1" / "metrics.jsonl").write_text(json.dumps(forged) + "\n")
    assert main(["data", str(tmp_path)]) == 1 and "ledgers differing [1]" in capsys.readouterr().out
