"""The pipelined direct all-reduce (comm/direct.py) with the dense codecs, on real forked gloo groups."""

from __future__ import annotations

from zeroband.comm.direct import piece_chunks


def test_pieces_cover_everything_on_block_boundaries():
    for n, sites, block, piece in [(1, 3, 1, 4), (1000, 2, 1, 64), (70000, 3, 64, 1000), (10, 4, 64, 64)]:
        pieces = piece_chunks(n, sites, block, 4 * piece)  # piece: fp32 values
        flat = [r for chunk in pieces for r in chunk]
        assert flat[0][0] == 0 and flat[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
        assert all(a % block == 0 for a, _ in flat)
        assert len(pieces) == max(1, -(-n // max(block, piece // block * block)))
