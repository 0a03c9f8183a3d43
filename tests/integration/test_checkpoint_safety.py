"""No good checkpoint is ever deleted or replaced: foreign runs, fresh starts, corrupt candidates,
divergence, a crash while sealing, and re-running a finished run. Real runs on forked ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import _corrupt, tiny_overrides
from tests.multiproc import Died, run_ranks
from tests.unit import test_checkpoint_safety as unit_tier  # what both tiers share is defined there, once
from zeroband.checkpoint import (
    find_checkpoint,
    read_run_id,
    verify_checkpoint,
)
from zeroband.config import deep_merge, dump_config, validate_config

pytestmark = unit_tier.pytestmark


def _train(tree: dict) -> dict:
    from zeroband.train import train

    return train(validate_config(tree))


def _main(tree: dict) -> int:
    """The `zeroband train` entry point on a written config: its exit status (stderr shows the line)."""
    from zeroband.train import main

    path = Path(tree["output_dir"]) / "cfg.toml"
    dump_config(validate_config(tree), path)
    return main([str(path)])


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every manifest under root (with the sha256 of every file, it pins a checkpoint's content)."""
    return {str(p.parent.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("manifest.json"))}


def _tree(corpus: dict, out: Path, **extra: object) -> dict:
    return tiny_overrides(corpus, out, **deep_merge({"checkpoint": {"interval": 2, "keep_last": 2}}, extra))


@pytest.mark.slow
def test_foreign_checkpoint_is_never_pruned_and_the_new_one_is_kept(corpus, tmp_path):
    """Old pruning kept the highest step numbers whichever run wrote them, deleting the new save."""
    other = _tree(corpus, tmp_path / "other", train={"steps": 12}, checkpoint={"interval": 12})
    run_ranks(_train, 1, (other,))
    root = tmp_path / "t" / "checkpoints"
    root.mkdir(parents=True)
    foreign = tmp_path / "other" / "t" / "checkpoints" / "step_000000012"
    foreign.rename(root / foreign.name)  # a higher step of another run, in this run's directory
    before = _snapshot(root)
    tree = _tree(corpus, tmp_path, train={"steps": 6}, checkpoint={"keep_last": 1, "resume": "none"})
    run_ranks(_train, 1, (tree,))
    # resume=none moved it aside untouched; the new run's newest checkpoint survives its own pruning.
    [aside] = list((tmp_path / "t").glob("old-*/checkpoints"))
    assert _snapshot(aside) == before
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000000006"]
    ours = read_run_id(root / "step_000000006")
    # Put it back beside the new run's checkpoints: resuming from an explicit path and saving prunes
    # only this run's older checkpoints, never the foreign higher step, never the one just written.
    (aside / "step_000000012").rename(root / "step_000000012")
    resumed = deep_merge(tree, {"train": {"steps": 10}, "checkpoint": {"resume": str(root / "step_000000006")}})
    run_ranks(_train, 1, (resumed,))
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000000010", "step_000000012"]
    assert _snapshot(root)["step_000000012"] == before["step_000000012"]
    assert read_run_id(root / "step_000000010") == ours != read_run_id(root / "step_000000012")


def test_same_step_of_another_run_is_moved_aside_not_replaced(corpus, tmp_path):
    other = _tree(corpus, tmp_path / "other", train={"steps": 2})
    run_ranks(_train, 1, (other,))
    root = tmp_path / "t" / "checkpoints"
    root.mkdir(parents=True)
    (tmp_path / "other" / "t" / "checkpoints" / "step_000000002").rename(root / "step_000000002")
    before = _snapshot(root)
    # A run resumed from elsewhere writes step 2 into this directory, where another run's step 2 is.
    start = _tree(corpus, tmp_path / "start", train={"steps": 1}, checkpoint={"interval": 1})
    run_ranks(_train, 1, (start,))
    elsewhere = tmp_path / "start" / "t" / "checkpoints" / "step_000000001"
    # Unsigned and outside this run's directory: loading it must be a deliberate act (issue 12).
    resumed = _tree(corpus, tmp_path, train={"steps": 2}, checkpoint={"resume": str(elsewhere), "allow_unsigned": True})
    run_ranks(_train, 1, (resumed,))
    [aside] = root.glob("old-*")
    assert _snapshot(aside) == before and read_run_id(root / "step_000000002") == read_run_id(elsewhere)


def test_resume_none_moves_old_run_aside_and_auto_resume_takes_the_new_run(corpus, tmp_path):
    tree = _tree(corpus, tmp_path, train={"steps": 4})
    run_ranks(_train, 1, (tree,))
    root = tmp_path / "t" / "checkpoints"
    old_id, before = read_run_id(root / "step_000000004"), _snapshot(root)
    run_ranks(_train, 1, (deep_merge(tree, {"train": {"steps": 2}, "checkpoint": {"resume": "none"}}),))
    [aside] = (tmp_path / "t").glob("old-*/checkpoints")  # with the old run's metrics (test_run_dir.py)
    assert _snapshot(aside) == before and read_run_id(aside / "step_000000004") == old_id  # intact, bit for bit
    new_id = read_run_id(root / "step_000000002")
    assert new_id != old_id
    again = run_ranks(_train, 1, (deep_merge(tree, {"train": {"steps": 4}}),))[0]
    assert len(again["losses"]) == 2 and read_run_id(root / "step_000000004") == new_id


def test_only_corrupt_candidates_stop_auto_resume(corpus, tmp_path, capfd):
    tree = _tree(corpus, tmp_path, train={"steps": 4})
    run_ranks(_train, 1, (tree,))
    root = tmp_path / "t" / "checkpoints"
    for step in (2, 4):
        _corrupt(root / f"step_00000000{step}")
    before = _snapshot(root)
    assert run_ranks(_main, 1, (deep_merge(tree, {"train": {"steps": 6}}),)) == [2]
    err = capfd.readouterr().err.splitlines()[-1]
    assert "step_000000004, step_000000002" in err and "--checkpoint.resume none" in err, err
    assert _snapshot(root) == before and find_checkpoint(root, "auto") is None
    # Asking for a fresh start works, and keeps the (corrupt, maybe salvageable) files aside.
    assert run_ranks(_main, 1, (deep_merge(tree, {"train": {"steps": 2}, "checkpoint": {"resume": "none"}}),)) == [0]
    [aside] = (tmp_path / "t").glob("old-*/checkpoints")
    assert _snapshot(aside) == before and find_checkpoint(root, "auto").step == 2


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("mode", ["stop", "rollback"])
def test_divergence_stops_without_saving(corpus, tmp_path, capfd, mode):
    """`--optim.lr 1e4 --optim.grad_clip 0` used to train to the end with NaN and replace the good checkpoints."""
    # Warmup keeps the first steps finite (measured: the loss goes non-finite at step 6).
    tree = _tree(corpus, tmp_path, train={"steps": 4}, optim={"lr": 1e4, "grad_clip": 0.0, "warmup_steps": 20})
    run_ranks(_train, 1, (tree,))
    root = tmp_path / "t" / "checkpoints"
    before = _snapshot(root)
    bad = deep_merge(tree, {"train": {"steps": 12, "on_nonfinite": mode, "max_rollbacks": 2}})
    assert run_ranks(_main, 1, (bad,)) == [2]
    err = capfd.readouterr().err.splitlines()[-1]
    assert "non-finite loss or gradient norm" in err and "step_000000004" in err and "optim.grad_clip" in err, err
    assert _snapshot(root) == before  # nothing saved, nothing pruned
    records = _records(tmp_path / "t")
    kinds = [r["kind"] for r in records]
    # Each rollback rewinds the metrics to step 4 and says so; the redone steps are never logged twice.
    assert kinds.count("rollback") == (2 if mode == "rollback" else 0) and kinds.count("nonfinite") == 1
    train = [r["step"] for r in records if r["kind"] == "train"]
    assert len(train) == len(set(train)), train


def test_divergence_on_two_ranks_stops_both(corpus, tmp_path):
    tree = _tree(corpus, tmp_path, train={"steps": 4}, optim={"lr": 1e4, "grad_clip": 0.0, "warmup_steps": 20})
    run_ranks(_train, 2, (tree,))
    root = tmp_path / "t" / "checkpoints"
    before = _snapshot(root)
    out = run_ranks(_main, 2, (deep_merge(tree, {"train": {"steps": 12}}),))
    assert out == [2, 2] and _snapshot(root) == before


def test_crash_between_the_seal_renames_keeps_a_valid_checkpoint(corpus, tmp_path):
    tree = _tree(corpus, tmp_path, train={"steps": 4}, checkpoint={"keep_last": 3})
    run_ranks(_train, 1, (tree,))
    root = tmp_path / "t" / "checkpoints"
    original = (root / "step_000000004" / "manifest.json").read_bytes()
    # Replay steps 3-4 from step 2: saving step 4 again is killed between the two renames.
    replay = deep_merge(tree, {"checkpoint": {"resume": str(root / "step_000000002")}})
    out = run_ranks(_train, 1, (replay,), faults="site0:step4:seal:kill", allow_death=True)
    assert out == [Died(-9)]
    assert not (root / "step_000000004").exists() and (root / "step_000000004.tmp").is_dir()
    info = find_checkpoint(root, "auto")
    assert info.path.name == "step_000000004.old" and info.step == 4
    assert (info.path / "manifest.json").read_bytes() == original
    # The next save of step 4 seals over it cleanly and drops the aside copy.
    run_ranks(_train, 1, (replay,))
    assert sorted(p.name for p in root.iterdir()) == ["step_000000002", "step_000000004"]
    verify_checkpoint(root / "step_000000004")


def test_rerunning_a_finished_run_does_not_rewrite_it(corpus, tmp_path, capfd):
    tree = _tree(corpus, tmp_path, train={"steps": 4})
    run_ranks(_train, 1, (tree,))
    root = tmp_path / "t" / "checkpoints"
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    metrics_before = (tmp_path / "t" / "metrics.jsonl").read_bytes()
    assert run_ranks(_main, 1, (tree,)) == [0]
    assert "run complete" in capfd.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before
    assert (tmp_path / "t" / "metrics.jsonl").read_bytes() == metrics_before


def test_metrics_after_resume_have_no_duplicates(corpus, tmp_path):
    from tests.helpers import _train_expecting_fault

    tree = _tree(corpus, tmp_path, train={"steps": 8}, checkpoint={"interval": 4})
    assert "injected fault" in run_ranks(_train_expecting_fault, 1, (tree,),
                                         faults="site0:step7:inner:raise")[0]
    assert max(r["step"] for r in _records(tmp_path / "t")) == 6  # steps 5-6 logged, then lost
    run_ranks(_train, 1, (tree,))
    records = _records(tmp_path / "t")
    keys = [(r["kind"], r["step"]) for r in records]
    assert len(keys) == len(set(keys)), keys
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6, 8]
    [resumed] = [r for r in records if r["kind"] == "resumed"]
    assert resumed["step"] == 4 and resumed["from"].endswith("step_000000004")


def test_explicit_bad_resume_path_is_one_line(corpus, tmp_path, capfd):
    tree = _tree(corpus, tmp_path, checkpoint={"resume": str(tmp_path / "nope")})
    assert run_ranks(_main, 1, (tree,)) == [2]
    assert "is not a directory" in capfd.readouterr().err.splitlines()[-1]


def test_diverging_diloco_sites_stop_before_their_outer_step(corpus, tmp_path):
    from tests.helpers import diloco_tree
    from tests.multiproc import run_sites

    tree = diloco_tree(corpus, tmp_path, train={"steps": 12}, checkpoint={"interval": 2},
                       optim={"lr": 1e4, "grad_clip": 0.0, "warmup_steps": 20})
    assert run_sites(_main, 2, 1, (tree,), timeout=100) == {(0, 0): 2, (1, 0): 2}
    for site in (0, 1):
        records = _records(tmp_path / "t" / f"site{site}")
        [bad] = [r["step"] for r in records if r["kind"] == "nonfinite"]  # step 6 on this machine
        outer = [r["step"] for r in records if r["kind"] == "outer"]
        assert outer == list(range(2, bad, 2)) and outer, (outer, bad)  # every outer step before it, none after
        root = tmp_path / "t" / "checkpoints" / f"site{site}"
        assert [verify_checkpoint(p)["step"] for p in sorted(root.iterdir())] == outer[-2:]
