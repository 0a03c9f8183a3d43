"""The trainer on real forked ranks with gloo: it learns, FSDP2 is exact, checkpoints survive kills."""

from __future__ import annotations

import pytest


def test_wsd_schedule_shape():
    from zeroband.config import OptimConfig
    from zeroband.optim import lr_factor

    cfg = OptimConfig(schedule="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0)
    factors = [lr_factor(s, 100, cfg) for s in range(100)]
    assert factors[0] == 0.1 and factors[9] == 1.0 and factors[50] == 1.0 and factors[79] == 1.0
    assert factors[80] == 1.0 and factors[90] == 0.5 and factors[99] == pytest.approx(0.05)
