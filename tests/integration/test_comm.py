"""The pipelined direct all-reduce (comm/direct.py) with the dense codecs, on real forked gloo groups."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch

from tests.multiproc import free_port, run_sites
from zeroband.comm.dense import DenseCodec, all_reduce_dense

SHAPES = [(97, 31), (5,), (1,), (300,)]


def site_tensors(site: int) -> list[torch.Tensor]:
    """Mixed magnitudes, so a per-message fp16 scale has something to get wrong."""
    g = torch.Generator().manual_seed(100 + site)
    scales = [1e-6, 1e2, 1.0, 1e-3]
    return [torch.randn(s, generator=g) * c for s, c in zip(SHAPES, scales)]


# ----------------------------------------------------------------------- codec (no processes)
@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_dense_codec_round_trip(wire):
    codec = DenseCodec(wire)
    x = torch.cat([torch.randn(1000) * 1e-7, torch.randn(1000) * 3e4, torch.zeros(3)])
    buf = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(x.numel())
    y = codec.decode(buf, x.numel())
    if wire == "fp32":
        assert torch.equal(x, y)
    else:
        # Relative to the message's largest value: bf16 ~2^-8, fp16 with its scale ~2^-11 (no overflow
        # at 3e4 * the scale, no underflow of the 1e-7 values relative to that bound).
        bound = 2.0**-8 if wire == "bf16" else 2.0**-11
        assert float((y - x).abs().max()) <= bound * float(x.abs().max())
        assert torch.isfinite(y).all() and y[-1] == 0
    small = torch.randn(100) * 1e-9  # a message of tiny values alone keeps fp16's relative precision
    assert float(((DenseCodec("fp16").decode(DenseCodec("fp16").encode(small), 100) - small) / small).abs().max()) < 2**-10


# ----------------------------------------------------------------------- real groups
def _group(port: int, prefix: str, streams: int = 1, store=None):
    import torch.distributed as dist

    from zeroband.comm.group import new_global_group

    site, sites = int(os.environ["ZEROBAND_SITE_RANK"]), int(os.environ["ZEROBAND_SITE_COUNT"])
    timeout = timedelta(seconds=30)
    store = store or dist.TCPStore("127.0.0.1", port, is_master=site == 0, timeout=timeout, wait_for_workers=False)
    return new_global_group(store, prefix, site, sites, timeout, streams=streams), site


def _reduce_all(port: int, wires: list[str], piece_bytes: int) -> dict:
    group, site = _group(port, "c/")
    out = {"table": group.gather_scalars([float(site), 10.0 * site + 1])}
    for wire in wires:
        t = site_tensors(site)
        sent = all_reduce_dense(t, group, wire, 1.0 / group.size, piece_bytes)
        out[wire] = (t, sent)
    out["again"] = group.gather_scalars([float(-site)])  # same tag reused: matched in order
    return out


def _reduce_per_streams(port: int) -> dict:
    group, site = _group(port, "one/")
    out = {}
    for streams in (1, 4):
        group = group if streams == 1 else _group(port, "four/", 4, group.store)[0]
        gen = torch.Generator().manual_seed(site)
        t = [torch.randn(600_000, generator=gen), torch.randn(7, generator=gen)]
        all_reduce_dense(t, group, "fp16", 0.5, 1 << 20)
        out[streams] = t
    return out


def test_four_streams_give_bitwise_the_same_all_reduce_as_one():
    """Issue 27: the same bytes arrive over 4 connections per peer as over 1, so the fp16 direct
    all-reduce (pieces of 1 MB, cut into 64 KB+ slices per stream) ends bitwise identical."""
    res = run_sites(_reduce_per_streams, 2, 1, (free_port(),), timeout=60)
    ref = res[(0, 0)][1]
    assert all(torch.equal(a, b) for s in (0, 1) for k in (1, 4) for a, b in zip(ref, res[(s, 0)][k]))


@pytest.mark.parametrize("sites", [2, 3])
def test_pipelined_dense_all_reduce_identical_exact_bytes(sites):
    wires = ["fp32", "bf16", "fp16"]
    res = run_sites(_reduce_all, sites, 1, (free_port(), wires, 4 * 50), timeout=60)  # 50 values: many pieces
    per_site = [res[(s, 0)] for s in range(sites)]
    exact = [sum(site_tensors(s)[i].double() for s in range(sites)) / sites for i in range(len(SHAPES))]
    n = sum(math.prod(s) for s in SHAPES)
    for wire in wires:
        first = per_site[0][wire][0]
        for other in per_site[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, other[wire][0])), f"{wire}: sites differ"
        for got, ref in zip(first, exact):
            rel = float((got.double() - ref).norm() / ref.norm())
            assert rel <= {"fp32": 1e-6, "bf16": 1e-2, "fp16": 1e-3}[wire], (wire, rel)
        elem = 4 if wire == "fp32" else 2
        total_sent = sum(p[wire][1] for p in per_site)
        # Every value leaves its site once per phase: 2(S-1)/S of the payload per site, plus the fp16
        # scale header of each message.
        messages = (total_sent - 2 * (sites - 1) * n * elem) / 4
        assert (wire == "fp16" and messages > 0 and messages == int(messages)) or total_sent == 2 * (sites - 1) * n * elem
    for p in per_site:
        assert torch.equal(p["table"], torch.tensor([[s, 10.0 * s + 1] for s in range(sites)], dtype=torch.float64))
        assert torch.equal(p["again"][:, 0], -torch.arange(sites, dtype=torch.float64))
