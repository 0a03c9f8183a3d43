"""int8 / 4-bit all-reduce on real forked gloo groups: identical sites, bounded error, exact bytes."""

from __future__ import annotations

import pytest
import torch

from zeroband.comm.direct import chunk_bounds
from zeroband.comm.quantized import Codec


def test_codec_rejects_non_finite():
    with pytest.raises(ValueError, match="non-finite"):
        Codec(8, 64).encode(torch.tensor([1.0, float("inf")]))


def test_chunks_cover_everything_on_block_boundaries():
    for n, sites in [(1, 4), (255, 3), (1000, 4), (70000, 3)]:
        bounds = chunk_bounds(n, sites, 64)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all(a % 64 == 0 for a, _ in bounds)
