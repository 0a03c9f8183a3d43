"""Checkpoints are data: a crafted one that would run code is refused before anything is unpickled.

DCP metadata is a pickle, so a sha256 manifest proves nothing against whoever wrote it: only a
signature under the run's secret, or the checkpoint being the run's own, lets it load.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from zeroband.checkpoint import CheckpointError, check_trust


def test_trust_rule_without_a_secret(tmp_path):
    own, other = tmp_path / "run" / "checkpoints", tmp_path / "downloads"
    unsigned = {"step": 1, "files": {}}
    check_trust(own / "step_1", unsigned, None, own)  # the run's own checkpoint
    with pytest.raises(CheckpointError, match="allow_unsigned"):
        check_trust(other / "step_1", unsigned, None, own)
    check_trust(other / "step_1", unsigned, None, own, allow_unsigned=True)  # the deliberate act
    with pytest.raises(CheckpointError, match="not signed"):
        check_trust(own / "step_1", unsigned, b"a-secret-of-enough-length", own)
    forged = {**unsigned, "signature": {"alg": "hmac-sha256", "mac": "00" * 32}}
    with pytest.raises(CheckpointError, match="is signed and no secret is at hand"):  # never read as unsigned
        check_trust(own / "step_1", forged, None, own)
    with pytest.raises(CheckpointError, match="signs its checkpoints"):  # a multi-site run's, signature stripped
        check_trust(own / "step_1", unsigned, None, own, require_signature=True)
    check_trust(own / "step_1", forged, None, own, allow_unsigned=True)  # the loud opt-out
    with pytest.raises(CheckpointError, match="does not verify"):
        check_trust(own / "step_1", forged, b"a-secret-of-enough-length", own, allow_unsigned=True)


def test_rng_state_is_plain_data_and_old_tuples_still_restore(tmp_path):
    import random

    import numpy as np

    from zeroband.checkpoint import _NUMPY_ARRAYS, rng_state, set_rng_state

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    torch.save(rng_state(), tmp_path / "new.pt")
    legacy = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(legacy, tmp_path / "old.pt")  # the format before RNG states were plain values
    expected = draws()
    set_rng_state(torch.load(tmp_path / "new.pt", weights_only=True))
    assert draws() == expected
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "old.pt", weights_only=True)
    with torch.serialization.safe_globals(_NUMPY_ARRAYS):
        set_rng_state(torch.load(tmp_path / "old.pt", weights_only=True))
    assert draws() == expected
