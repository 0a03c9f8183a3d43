"""Mistakes a user will make stop with a message naming the problem and the fix, not a traceback."""

from __future__ import annotations

import pytest

from tests.helpers import _corrupt, _error, _train, tiny_overrides
from tests.multiproc import run_ranks
from zeroband.checkpoint import CheckpointError, find_checkpoint, verify_checkpoint


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
    assert "model.n_layers = 2, this config has 3" in err and "--checkpoint.resume none" in err


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
