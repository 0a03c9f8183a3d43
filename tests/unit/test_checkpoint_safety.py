"""No good checkpoint is ever deleted or replaced: foreign runs, fresh starts, corrupt candidates,
divergence, a crash while sealing, and re-running a finished run. Real runs on forked ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeroband.checkpoint import (
    CheckpointError,
    prune_victims,
    verify_checkpoint,
)

pytestmark = pytest.mark.timeout(120)


def test_prune_victims_only_this_runs_older_checkpoints():
    entries = [(Path(f"{rid}{step}"), step, rid) for rid, step in
               [("a", 2), ("a", 4), ("a", 6), ("b", 8), ("a", 10), (None, 1), ("b", 1)]]
    # Written step 6 of run a, keep 2: step 4 stays beside it, step 2 goes; b, legacy and a's step 10 stay.
    assert prune_victims(entries, 2, "a", 6) == [Path("a2")]
    assert prune_victims(entries, 1, "a", 6) == [Path("a2"), Path("a4")]
    assert prune_victims(entries, 1, "b", 8) == [Path("b1")]
    assert prune_victims(entries, 3, "c", 4) == []


def test_find_checkpoint_names_what_it_skipped(tmp_path):
    (tmp_path / "step_000000003").mkdir()
    with pytest.raises(CheckpointError, match="did not finish"):
        verify_checkpoint(tmp_path / "step_000000003")


def test_a_tmp_removed_while_another_rank_measures_it_counts_what_is_left(tmp_path):
    """Unit (CI, a 2-rank site): rank 0 removes a killed save's `.tmp` while rank 1 still measures
    it for the free-space check; `Path.rglob` raised FileNotFoundError there and the save failed.
    Now what vanished counts 0. A real removal races a real walk, 100 times (rglob failed ~1 in 4)."""
    import shutil
    import threading

    from zeroband.checkpoint import tree_bytes

    for i in range(100):
        tmp = tmp_path / f"step_{i}.tmp"
        for k in range(30):
            (tmp / f"d{k}").mkdir(parents=True)
            (tmp / f"d{k}" / "f").write_bytes(b"x" * 10)
        assert tree_bytes(tmp) == 300
        remover = threading.Thread(target=shutil.rmtree, args=(tmp,))
        remover.start()
        assert 0 <= tree_bytes(tmp) <= 300
        remover.join()
        assert tree_bytes(tmp) == 0
