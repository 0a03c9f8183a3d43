"""Mistakes a user will make stop with a message naming the problem and the fix, not a traceback."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.multiproc import run_ranks
from tests.test_train import _train
from zeroband.checkpoint import CheckpointError, find_checkpoint, verify_checkpoint


def _main(argv: list[str]) -> tuple[int, str]:
    """zeroband.train.main in a forked rank, with stderr captured."""
    from zeroband.train import main

    sys.stderr = io.StringIO()
    code = main(argv)
    return code, sys.stderr.getvalue()


def _args(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _args(value, f"{prefix}{key}.")
        else:
            out += [f"--{prefix}{key}", json.dumps(value) if isinstance(value, str) else str(value).lower()]
    return out


def _error(tree: dict, ranks: int = 1) -> str:
    code, err = run_ranks(_main, ranks, (_args(tree),))[0]
    assert code == 2, err
    assert "Traceback" not in err
    return err


def test_missing_data_path(corpus, tmp_path):
    err = _error(tiny_overrides(corpus, tmp_path, data={"path": str(tmp_path / "nope.jsonl")}))
    assert "data.path" in err and "zeroband data" in err


def test_tokenizer_larger_than_model_vocab(corpus, tmp_path):
    err = _error(tiny_overrides(corpus, tmp_path, model={"vocab_size": 256}))
    assert "384 tokens but model.vocab_size=256" in err and "--model.vocab_size 384" in err


def test_world_size_that_does_not_fit(corpus, tmp_path):
    err = _error(tiny_overrides(corpus, tmp_path, train={"global_batch": 4, "micro_batch": 2}), ranks=3)
    assert "3 x 2 = 6" in err and "train.global_batch" in err


def test_checkpoint_of_another_model_shape(corpus, tmp_path):
    run_ranks(_train, 1, (tiny_overrides(corpus, tmp_path, train={"steps": 2}),))
    err = _error(tiny_overrides(corpus, tmp_path, train={"steps": 4}, model={"n_layers": 3}))
    assert "model.n_layers: checkpoint 2 vs config 3" in err and "--checkpoint.resume none" in err


def _corrupt(ckpt: Path) -> None:
    victim = next(p for p in sorted((ckpt / "dcp").iterdir()) if p.suffix == ".distcp")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_corrupt_and_partial_checkpoints(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 4}, checkpoint={"interval": 2})
    run_ranks(_train, 1, (tree,))
    root = tmp_path / "t" / "checkpoints"
    newest = root / "step_000000004"
    _corrupt(newest)
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(newest)
    # An explicit resume from it refuses with a clear message...
    err = _error(tiny_overrides(corpus, tmp_path, train={"steps": 6}, checkpoint={"resume": str(newest)}))
    assert "fails its sha256 check" in err
    # ...while auto-resume skips it (loudly) and takes the previous complete one.
    assert find_checkpoint(root, "auto").step == 2
    (root / "step_000000002" / "manifest.json").unlink()  # now a partial checkpoint too
    with pytest.raises(CheckpointError, match="did not finish"):
        verify_checkpoint(root / "step_000000002")
    assert find_checkpoint(root, "auto") is None
