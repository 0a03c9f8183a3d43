"""A run directory says what really ran, belongs to one run at a time, and keeps what came before:
settings changed on resume are applied and said (or refused, naming the key), a second run with the
same name stops naming the first, and a fresh start moves the previous run aside instead of
deleting it. Pure rules in-process; the rest on real trainer processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import _main, _train
from tests.multiproc import run_ranks
from tests.unit import test_run_dir as unit_tier  # what both tiers share is defined there, once
from zeroband.checkpoint import read_run_id
from zeroband.config import deep_merge, dump_config, validate_config

_tree = unit_tier._tree
pytestmark = unit_tier.pytestmark


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


def test_resume_applies_a_new_lr_and_step_count_and_says_so(corpus, tmp_path, capfd):
    """Before: the scheduler's saved base lr won, the run trained on at 3e-3 while config.toml said 1e-4."""
    tree = _tree(corpus, tmp_path)
    run_ranks(_train, 1, (tree,))
    capfd.readouterr()
    code, err = run_ranks(_main, 1, ([str(_written(tree)), "--optim.lr", "1e-4", "--train.steps", "6"],))[0]
    assert code == 0, err
    out = capfd.readouterr().out.splitlines()
    assert "optim.lr: 0.003 -> 0.0001 from this resume on" in out and "train.steps: 4 -> 6 from this resume on" in out
    records = _records(tmp_path / "t")
    assert [(r["step"], r["lr"]) for r in records if r["kind"] == "train"] == [(2, 3e-3), (4, 3e-3), (6, 1e-4)]
    [resumed] = [r for r in records if r["kind"] == "resumed"]
    assert resumed["changed"] == {"optim.lr": ["0.003", "0.0001"], "train.steps": ["4", "6"]}
    saved = _toml(tmp_path / "t" / "config.toml")
    assert (saved["optim"]["lr"], saved["train"]["steps"]) == (1e-4, 6)


def _written(tree: dict) -> Path:
    path = Path(tree["output_dir"]) / "cfg.toml"
    dump_config(validate_config(tree), path)
    return path


@pytest.mark.parametrize("change", [["--model.dim", "128"], ["--data.shuffle_seed", "7"]])
def test_resume_refuses_a_new_model_shape_or_data_order_naming_the_key(corpus, tmp_path, change):
    tree = _tree(corpus, tmp_path)
    run_ranks(_train, 1, (tree,))
    before = (tmp_path / "t" / "config.toml").read_text()
    code, err = run_ranks(_main, 1, ([str(_written(tree)), *change],))[0]
    key = change[0][2:]
    assert code == 2 and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith("zeroband: error:")]
    assert f"{key} cannot change on resume" in line and f"Fix: --{key} {'64' if key == 'model.dim' else '1234'}" in line
    assert (tmp_path / "t" / "config.toml").read_text() == before  # still what the run really used


def test_a_second_run_with_the_same_name_stops_naming_the_first(corpus, tmp_path):
    """Before: both ran in runs/t/, the second truncated the first's metrics.jsonl and overwrote its config."""
    tree = _tree(corpus, tmp_path, train={"steps": 100000}, checkpoint={"interval": 0}, log={"interval": 1})
    first = subprocess.Popen([sys.executable, "-m", "zeroband", "train", str(_written(tree))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "t" / "metrics.jsonl"
        deadline = time.monotonic() + 90
        while not (metrics.is_file() and metrics.stat().st_size > 200) and first.poll() is None:
            assert time.monotonic() < deadline, "the first run never started training"
            time.sleep(0.2)
        code, err = run_ranks(_main, 1, ([str(_written(deep_merge(tree, {"train": {"steps": 2}})))],))[0]
        assert code == 2, err
        assert err.splitlines()[-1].startswith(f"zeroband: error: {tmp_path / 't'} is in use by another run: "
                                               f"PID {first.pid} ("), err
        assert "zeroband train" in err.splitlines()[-1]
        assert first.poll() is None  # untouched: still training, its records still its own
    finally:
        first.send_signal(signal.SIGTERM)
        _, first_err = first.communicate(timeout=60)
    assert first.returncode == 0, first_err[-2000:]
    records = _records(tmp_path / "t")
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert records[0]["kind"] == "run" and steps == list(range(1, len(steps) + 1))
    assert _toml(tmp_path / "t" / "config.toml")["train"]["steps"] == 100000


def test_a_fresh_start_moves_the_previous_run_aside_and_keeps_only_keep_old(corpus, tmp_path):
    """Before: resume=none deleted the previous run's metrics and never pruned the old checkpoints."""
    tree = _tree(corpus, tmp_path, train={"steps": 2}, checkpoint={"resume": "none", "keep_old": 2})
    run_dir, ids = tmp_path / "t", []
    for _ in range(4):
        run_ranks(_train, 1, (tree,))
        ids.append(read_run_id(run_dir / "checkpoints" / "step_000000002"))
    aside = sorted(run_dir.glob("old-*"))
    assert len(aside) == 2 and len(set(ids)) == 4  # the fourth start pruned the first run's folder
    for folder, run_id in zip(aside, ids[1:3]):  # each the whole previous run: metrics, config, checkpoints
        records = _records(folder)
        assert records[0]["run_id"] == run_id and [r["step"] for r in records if r["kind"] == "train"] == [2]
        assert (folder / "config.toml").is_file() and read_run_id(folder / "checkpoints" / "step_000000002") == run_id
    assert _records(run_dir)[0]["run_id"] == ids[3]
