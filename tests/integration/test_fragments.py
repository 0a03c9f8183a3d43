"""Streaming DiLoCo's fragments on real forked sites: identical replicas, exact resume, 1/P per sync."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    _train,
    _train_expecting_fault,
    diloco_tree,
    elastic_tree,
    final_params,
    outer_records,
    site_records,
)
from tests.multiproc import Died, run_sites


def _tree(corpus, out, **diloco):
    return diloco_tree(corpus, out, train={"steps": 16, "global_batch": 4, "micro_batch": 2},
                       checkpoint={"interval": 8, "keep_last": 5},
                       diloco={"inner_steps": 8, "fragments": 4, "log_checksum": True, **diloco})


def _identical_at(tree, steps):
    for step in steps:
        a, b = final_params(tree, 0, step), final_params(tree, 1, step)
        assert all(torch.equal(a[k], b[k]) for k in a), f"sites differ at step {step}"


@pytest.mark.parametrize("ranks,diloco", [
    (2, {"comm_dtype": "fp16"}),
    (1, {"comm_dtype": "int4", "error_feedback": True, "overlap": True}),
    (1, {"comm_dtype": "sparse", "overlap": True, "overlap_steps": 1}),
], ids=["fp16-fsdp2", "int4-overlap", "sparse-overlap1"])
def test_fragments_keep_sites_identical(corpus, tmp_path, ranks, diloco):
    tree = _tree(corpus, tmp_path, **diloco)
    out = run_sites(_train, 2, ranks, (tree,), timeout=240)
    assert out[(0, 0)]["losses"] != out[(1, 0)]["losses"]
    _identical_at(tree, (16,))
    a, b = final_params(tree, 0, 8), final_params(tree, 1, 8)  # a checkpoint mid-cycle forces no sync:
    assert not all(torch.equal(a[k], b[k]) for k in a)  # fragments 0-2 hold each site's own progress
    records = [outer_records(tmp_path, s) for s in (0, 1)]
    assert [r["outer_crc"] for r in records[0]] == [r["outer_crc"] for r in records[1]]
    blocking = [r["fragments"] for r in records[0] if not r["overlapped"]]
    assert blocking[-1] == [0, 1, 2, 3]  # the end is every fragment's boundary
    steps = [r["step"] for r in records[0]]
    assert steps == sorted(set(steps)) and 16 in steps and 8 in steps


def test_fragments_send_a_fraction_of_the_model_per_sync(corpus, tmp_path):
    whole = _tree(corpus, tmp_path / "whole", fragments=1)
    parts = _tree(corpus, tmp_path / "parts")
    run_sites(_train, 2, 1, (whole,), timeout=180)
    run_sites(_train, 2, 1, (parts,), timeout=180)
    full = outer_records(tmp_path / "whole", 0)[0]["payload_bytes"]
    per_sync = [r["payload_bytes"] for r in outer_records(tmp_path / "parts", 0) if len(r["fragments"]) == 1]
    assert per_sync and max(per_sync) < 0.5 * full  # 4 fragments balanced by bytes: ~1/4 each
    every = [r["payload_bytes"] for r in outer_records(tmp_path / "parts", 0) if r["fragments"] == [0, 1, 2, 3]]
    assert every and every[0] == pytest.approx(full, rel=0.02)  # a sync point: every fragment, the whole model


def test_fragments_resume_exactly(corpus, tmp_path):
    reference = run_sites(_train, 2, 1, (_tree(corpus, tmp_path / "full", overlap=True),), timeout=180)
    cut = _tree(corpus, tmp_path / "cut", overlap=True)
    run_sites(_train_expecting_fault, 2, 1, (cut,), faults="site0:step12:inner:raise,site1:step12:inner:raise",
              timeout=180)
    resumed = run_sites(_train, 2, 1, (cut,), timeout=180)
    for site in (0, 1):
        assert resumed[(site, 0)]["losses"] == reference[(site, 0)]["losses"][8:]
    a, b = final_params(cut, 0, 16), final_params(_tree(corpus, tmp_path / "full"), 0, 16)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fragments_on_sites_of_different_shapes_stay_identical_and_reshard(corpus, tmp_path):
    """A 1-rank and a 2-rank site: each fragment's exchange runs per lane; then the 2-rank site comes
    back with 1 rank and resumes from its resharded checkpoint."""
    tree = _tree(corpus, tmp_path, overlap=True, overlap_steps=1)
    run_sites(_train, 2, [1, 2], (tree,), timeout=240)
    _identical_at(tree, (16,))
    longer = {**tree, "train": {**tree["train"], "steps": 24}}
    out = run_sites(_train, 2, [1, 1], (longer,), timeout=240)
    assert len(out[(1, 0)]["losses"]) == 8  # resumed at step 16, resharded from 2 ranks to 1
    assert out[(0, 0)]["val"] == out[(1, 0)]["val"]
    _identical_at(longer, (24,))


# ---------------------------------------------------------------------------------- elastic membership
def _elastic(corpus, tmp_path, store_address, **kw):
    """2 fragments at H = 2: a round at every step, round r (step r) fragment (r - 1) mod 2's."""
    return elastic_tree(corpus, tmp_path, store_address, fragments=2, log_checksum=True, **kw)


def _fragment_rounds(records: list[dict]) -> dict[int, list[int]]:
    return {r["step"]: r["fragments"] for r in records}


@pytest.mark.parametrize("wire", [{"comm_dtype": "fp16"}, {"comm_dtype": "int4", "error_feedback": True},
                                  {"comm_dtype": "sparse"}], ids=["fp16", "int4-ef", "sparse"])
def test_elastic_fragments_lose_a_site_and_stay_identical(corpus, tmp_path, store_address, wire):
    tree = _elastic(corpus, tmp_path, store_address, **wire)
    out = run_sites(_train, 3, 1, (tree,), faults="site2:step5:inner:kill", allow_death=True, timeout=150)
    assert isinstance(out[(2, 0)], Died)
    assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 10
    records = outer_records(tmp_path, 0)
    assert _fragment_rounds(records) == {s: [(s - 1) % 2] for s in range(1, 10)} | {10: [0, 1]}
    assert records[0]["sites_used"] == 3 and records[-1]["sites_used"] == 2
    assert [r["outer_crc"] for r in records] == [r["outer_crc"] for r in outer_records(tmp_path, 1)]
    _identical_at(tree, (10,))


def test_elastic_fragments_a_late_site_is_left_out_and_takes_the_next_fragments_round(corpus, tmp_path,
                                                                                    store_address):
    """Site 1 comes to round 4 (fragment 1's) after the grace window: the round goes on without it,
    and it joins round 5, fragment 0's, with that fragment (a site without the state contributes
    zeros shaped like the round's fragment), takes every fragment's state and ends identical.
    The window is grace_s = "auto" (membership/grace.py): the configured 5 s before anything is
    measured (round 1), then the floor, 1 s (rounds of one step are worth less than waiting)."""
    tree = _elastic(corpus, tmp_path, store_address, steps=80, grace_s="auto")  # site 0 alone must not finish in LATE_S
    out = run_sites(_train, 2, 1, (tree,), faults="site1:step4:inner:late", timeout=180)
    assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 80
    by_step = {r["step"]: r for r in outer_records(tmp_path, 0)}
    assert by_step[4]["sites_used"] == 1 and by_step[80]["sites_used"] == 2
    left = [e for e in site_records(tmp_path, 1, "membership") if e["event"] == "left_out"]
    assert left and left[0]["round"] == 4, left
    graces = [e for e in site_records(tmp_path, 0, "membership") if e["event"] == "grace"]
    assert graces[0]["round"] == 1 and graces[0]["grace_s"] == 5.0 and graces[0]["late_s"] is None, graces
    assert graces[1]["round"] == 2 and graces[1]["grace_s"] < 5.0 and graces[1]["step_s"] > 0, graces
    assert len(graces) < 20, graces  # recorded when it changes, not at each of the 80 rounds
    _identical_at(tree, (80,))



class _Slowed:
    """Site 1's loop, each inner step 0.15 s longer: a slower site on the wall clock."""

    def __init__(self, inner) -> None:
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def after_inner_step(self, step: int, sync_point: bool = False):
        import time

        time.sleep(0.15)
        return self.inner.after_inner_step(step, sync_point)


def _site_1_slowed(tree: dict) -> dict:
    import os

    from zeroband import seams

    if int(os.environ["ZEROBAND_SITE_RANK"]) == 1:
        seams.use(seams.Seams(outer=lambda outer, model: _Slowed(outer)))
    return _train(tree)


def test_fragments_under_a_time_budget_on_the_wall_clock(corpus, tmp_path):
    """Two fragments, rounds of 1 s of the wall clock, overlapped, site 1 slower: each site runs the
    steps that fit, both take the fragments' rounds in the same order, and they end identical."""
    tree = diloco_tree(corpus, tmp_path, train={"steps": 12, "global_batch": 4, "micro_batch": 2},
                       checkpoint={"interval": 0}, eval={"interval": 0, "batches": 1},
                       diloco={"inner_steps": 4, "fragments": 2, "round_seconds": 1.0, "overlap": True})
    out = run_sites(_site_1_slowed, 2, 1, (tree,), timeout=180)
    assert out[(0, 0)]["steps"] > out[(1, 0)]["steps"]
    order = [[p for r in outer_records(tmp_path, s) for p in r["fragments"]] for s in (0, 1)]
    assert order[0] == order[1] and order[0][-2:] == [0, 1]
    _identical_at(tree, (12,))  # saved at the end under the run step, rounds x inner_steps
