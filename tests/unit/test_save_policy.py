"""The save policy (zeroband/checkpointer.py) as a pure function: no processes, no files."""

from zeroband.checkpointer import should_save, sync_due
from zeroband.config import CheckpointConfig


def test_interval_end_and_stop():
    cfg = CheckpointConfig(interval=4, save_at_end=True)
    assert [s for s in range(1, 13) if should_save(cfg, s, last=False)] == [4, 8, 12]
    assert should_save(cfg, 10, last=True)
    assert not should_save(CheckpointConfig(interval=4, save_at_end=False), 10, last=True)
    assert should_save(CheckpointConfig(interval=0, save_at_end=False), 3, last=False, stopping=True)


def test_never_the_same_step_twice():
    cfg = CheckpointConfig(interval=4, save_at_end=True)
    assert not should_save(cfg, 8, last=True, saved_at=8)  # the last step was also an interval step
    assert not should_save(cfg, 8, last=False, stopping=True, saved_at=8)  # SIGTERM right after a save
    assert should_save(cfg, 0, last=True, saved_at=None)  # a joiner at the very last boundary: no step trained


def test_sync_points_are_saves_and_the_end():
    cfg = CheckpointConfig(interval=4, save_at_end=False)
    assert [s for s in range(1, 11) if sync_due(cfg, s, 10)] == [4, 8, 10]
    assert [s for s in range(1, 11) if sync_due(CheckpointConfig(interval=0), s, 10)] == [10]
