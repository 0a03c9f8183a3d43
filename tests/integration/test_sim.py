"""zeroband.sim (k sites on threads of one process) gives the numbers of the multi-process run."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import _train, diloco_tree, final_params, outer_records, site_records
from tests.multiproc import run_ranks
from tests.multiproc import run_sites as run_forked


def _simulate(tree: dict, sites: int, step_s: list[float] | None = None) -> dict:
    """zeroband.sim in a forked child: its gloo threads must not live on in the pytest process, whose
    later forks would inherit them mid-operation and hang."""
    from zeroband.sim import run_sites

    try:
        return run_sites(tree, sites, step_s=step_s)
    except RuntimeError as e:
        return {"error": str(e)}


def run_simulated(tree: dict, sites: int, step_s: list[float] | None = None) -> dict:
    return run_ranks(_simulate, 1, (tree, sites, step_s), timeout=120)[0]


@pytest.mark.parametrize("diloco, precision", [
    ({"comm_dtype": "fp16", "inner_steps": 2}, "fp32"),
    ({"comm_dtype": "int8", "error_feedback": True, "inner_steps": 3, "outer_lr_schedule": "inner"}, "fp32"),
    ({"mode": "data_parallel", "comm_dtype": "fp32"}, "fp32"),
    ({"overlap": True, "inner_steps": 2}, "fp32"),
    ({"comm_dtype": "fp16", "inner_steps": 2}, "bf16"),  # 1-rank sites: autocast, per thread
])
def test_simulated_sites_equal_forked_sites(corpus, tmp_path, diloco, precision):
    """Same config, 3 sites: the same losses on every site and bitwise the same final parameters.

    Exact equality is the right bar: both paths run the same code with one intra-op thread, so every
    operation sees the same inputs in the same order; only the transport of the global group differs,
    and it moves bytes, not values.
    """
    extra = dict(train={"steps": 6, "global_batch": 2, "micro_batch": 2, "mixed_precision": precision},
                 checkpoint={"interval": 0},
                 eval={"interval": 3, "batches": 2}, diloco=diloco)
    forked, simulated = diloco_tree(corpus, tmp_path / "forked", **extra), diloco_tree(corpus, tmp_path / "sim", **extra)
    out = run_forked(_train, 3, 1, (forked,), timeout=120)
    sim = run_simulated(simulated, 3)
    assert sim["losses"] == out[(0, 0)]["losses"]
    assert sim["val"] == out[(0, 0)]["val"]
    for site in (0, 1, 2):
        a, b = final_params(forked, site, 6), final_params(simulated, site, 6)
        assert all(torch.equal(a[k], b[k]) for k in a), f"site {site} differs"


def test_a_failing_site_fails_the_simulated_run(corpus, tmp_path):
    tree = diloco_tree(corpus, tmp_path, train={"steps": 2}, data={"tokenizer": str(tmp_path / "missing")})
    assert "simulated site 0 failed" in run_simulated(tree, 2)["error"]


def test_simulated_run_resumes_from_its_checkpoints(corpus, tmp_path):
    """A simulated run is built as `zeroband train` builds one (train.build_run): started again, it
    resumes from the sites' newest common checkpoint and ends with the bits of an uninterrupted run."""
    tree = diloco_tree(corpus, tmp_path, train={"steps": 6, "global_batch": 2, "micro_batch": 2},
                       checkpoint={"interval": 2}, eval={"interval": 0, "batches": 1})
    straight = run_simulated(tree, 2)
    whole = [final_params(tree, site, 6) for site in (0, 1)]
    for site in (0, 1):  # as if the run had stopped after step 4
        shutil.rmtree(tmp_path / "t" / "checkpoints" / f"site{site}" / "step_000000006")
    resumed = run_simulated(tree, 2)
    assert resumed["losses"] == straight["losses"][4:]  # only steps 5 and 6 were trained again
    for site in (0, 1):
        again = final_params(tree, site, 6)
        assert all(torch.equal(whole[site][k], again[k]) for k in again), f"site {site} differs"


@pytest.mark.parametrize("overlap", [False, True])
def test_sites_of_different_speeds_on_a_virtual_clock(corpus, tmp_path, overlap):
    """Time-budget rounds with site 1 at half speed (`StepClock`): it runs half the inner steps of
    each round, every outer step leaves both sites with the same bits, and at each boundary its lr
    schedule stands where site 0's does (the run's rounds, not its own step count). Overlapped,
    each average lands at the next boundary and the last round blocks on both sites alike."""
    tree = diloco_tree(corpus, tmp_path, train={"steps": 12, "global_batch": 2, "micro_batch": 2},
                       optim={"warmup_steps": 2, "schedule": "cosine"}, log={"interval": 1},
                       diloco={"inner_steps": 4, "round_seconds": 4.0, "log_checksum": True, "overlap": overlap})
    run_simulated(tree, 2, step_s=[1.0, 2.0])
    outer = [outer_records(tmp_path, s) for s in (0, 1)]
    assert [r["step"] for r in outer[0]] == ([8, 12] if overlap else [4, 8, 12])  # the first lands at round 2
    assert [r["step"] for r in outer[1]] == ([4, 6] if overlap else [2, 4, 6])
    assert [r["overlapped"] for r in outer[0]] == ([True, False] if overlap else [False] * 3)
    assert [r["outer_crc"] for r in outer[0]] == [r["outer_crc"] for r in outer[1]]
    lrs = [{r["step"]: r["lr"] for r in site_records(tmp_path, s, "train")} for s in (0, 1)]
    assert [lrs[0][s] for s in (4, 8)] == [lrs[1][s] for s in (2, 4)]


@pytest.mark.parametrize("overlap", [False, True])
def test_sites_of_different_speeds_resume_exactly(corpus, tmp_path, overlap):
    """Under a time budget checkpoints are named by the run step (rounds x inner_steps), so a fast
    and a slow site save the same rounds under the same names, agree on one, and a resumed run ends
    with the bits of an uninterrupted one (overlapped: rounds 1 and 3 launch in the background, and
    2, a checkpoint, and 4, the end, block on every site alike)."""
    tree = diloco_tree(corpus, tmp_path, train={"steps": 16, "global_batch": 2, "micro_batch": 2},
                       checkpoint={"interval": 8, "keep_last": 3}, eval={"interval": 0, "batches": 1},
                       diloco={"inner_steps": 4, "round_seconds": 4.0, "overlap": overlap})
    straight = run_simulated(tree, 2, step_s=[1.0, 2.0])
    saved = [sorted(p.name for p in (tmp_path / "t" / "checkpoints" / f"site{s}").glob("step_*")) for s in (0, 1)]
    assert saved[0] == saved[1] == ["step_000000008", "step_000000016"]
    whole = [final_params(tree, site, 16) for site in (0, 1)]
    for site in (0, 1):  # as if the run had stopped after round 2
        shutil.rmtree(tmp_path / "t" / "checkpoints" / f"site{site}" / "step_000000016")
    resumed = run_simulated(tree, 2, step_s=[1.0, 2.0])
    assert resumed["losses"] == straight["losses"][8:]  # site 0 trained its last two rounds again, only those
    for site in (0, 1):
        again = final_params(tree, site, 16)
        assert all(torch.equal(whole[site][k], again[k]) for k in again), f"site {site} differs"


@pytest.mark.parametrize("overlap", [False, True])
def test_fragments_of_sites_of_different_speeds(corpus, tmp_path, overlap):
    """Two fragments under a time budget, site 1 at half speed: fragment 0's rounds end half a round
    after fragment 1's, on both sites in the same order, each landing with the same bits on both;
    the run ends with every fragment synced, and a resume from a checkpoint round is exact."""
    tree = diloco_tree(corpus, tmp_path, train={"steps": 16, "global_batch": 2, "micro_batch": 2},
                       checkpoint={"interval": 8, "keep_last": 3}, eval={"interval": 0, "batches": 1},
                       diloco={"inner_steps": 4, "round_seconds": 4.0, "fragments": 2, "log_checksum": True,
                               "overlap": overlap})
    straight = run_simulated(tree, 2, step_s=[1.0, 2.0])
    outer = [outer_records(tmp_path, s) for s in (0, 1)]
    assert [r["step"] // 2 for r in outer[0]] == [r["step"] for r in outer[1]]  # the same boundaries, in order
    assert [r["fragments"] for r in outer[0]] == [r["fragments"] for r in outer[1]]
    assert [r["outer_crc"] for r in outer[0]] == [r["outer_crc"] for r in outer[1]]
    assert outer[0][-1]["step"] == 16 and outer[0][-1]["fragments"] == [0, 1]
    whole = [final_params(tree, site, 16) for site in (0, 1)]
    for site in (0, 1):
        shutil.rmtree(tmp_path / "t" / "checkpoints" / f"site{site}" / "step_000000016")
    resumed = run_simulated(tree, 2, step_s=[1.0, 2.0])
    assert resumed["losses"] == straight["losses"][8:]
    for site in (0, 1):
        again = final_params(tree, site, 16)
        assert all(torch.equal(whole[site][k], again[k]) for k in again), f"site {site} differs"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_slow_step_that_ends_two_fragments_ends_them_in_order(corpus, tmp_path, overlap):
    """Site 1's step (5 s) outlasts half a round (2 s): one of its steps ends both fragments' rounds,
    which it takes in the order of their deadlines, as site 0 takes them steps apart; both sites end
    the run with the same bits."""
    tree = diloco_tree(corpus, tmp_path, train={"steps": 16, "global_batch": 2, "micro_batch": 2},
                       eval={"interval": 0, "batches": 1}, checkpoint={"interval": 0},
                       diloco={"inner_steps": 4, "round_seconds": 4.0, "fragments": 2, "overlap": overlap})
    run_simulated(tree, 2, step_s=[1.0, 5.0])
    order = [[p for r in outer_records(tmp_path, s) for p in r["fragments"]] for s in (0, 1)]
    assert order[0] == order[1] and order[0][-2:] == [0, 1]
    a, b = final_params(tree, 0, 16), final_params(tree, 1, 16)  # named by the run step
    assert all(torch.equal(a[k], b[k]) for k in a)
