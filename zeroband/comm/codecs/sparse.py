"""The sparse wire codec (SparseLoCo, arXiv 2508.15706): per chunk of 4096 values, the top
`diloco.density` of them by magnitude, each as 2 bits, at 12-bit local indices; error feedback always.

Wire format of one chunk of c values (c = 4096 but for the last), k = keep(c, density) of them sent:

    lo, hi     2 x bf16   the two magnitudes a value decodes to: the mean |value| of the k - k // 2
                          smaller and of the k // 2 larger selected values (rounded to nearest)
    codes      ceil(k / 4) bytes, 2 bits per value, in index order: bit 0 the sign (1: negative),
                          bit 1 the magnitude (1: hi), whichever of lo / hi is nearer
    indices    3 x ceil(k / 2) bytes, two 12-bit indices per 3 bytes, strictly increasing

At density 0.02: k = 82, 4 + 21 + 123 = 148 bytes per 4096 values, 0.036 bytes per parameter,
headers and all. Decoding is exact bf16 -> fp32 conversion and a scatter of distinct indices: the
same bits on every site. A chunk whose indices are not strictly increasing (or out of range) decodes
to NaN, which the review rejects alike on every site (comm/reduce.py), rather than raising on some.

A sum of sparse contributions has the union of their indices: it would not re-encode without losing
most of what it carries, so every site's encoded contribution goes to every site and each sums them
in site order (`exchange="gather"`, comm/gather.py). What a site's top-k left out stays in its
residual (`feedback="always"`, folded into the next contribution by zeroband/outer/diloco.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from zeroband.comm.codecs import CodecSpec
from zeroband.comm.kernels import Row, accumulate, add_stats

CHUNK = 4096  # values per chunk: a local index fits 12 bits
LEVEL_BYTES = 4  # lo, hi as bf16


def keep(c: int, density: float) -> int:
    """Values sent of a chunk of c: ceil(density x c), at least one, at most c."""
    return min(c, max(1, math.ceil(density * c)))


def chunk_bytes(c: int, density: float) -> int:
    k = keep(c, density)
    return LEVEL_BYTES + -(-k // 4) + 3 * -(-k // 2)


@dataclass(frozen=True)
class SparseCodec:
    """A 1-D fp32 chunk as top-k values at 2 bits with 12-bit indices (module comment)."""

    density: float
    block: int = CHUNK
    header = 0

    def nbytes(self, n: int) -> int:
        full, rest = divmod(n, self.block)
        return full * chunk_bytes(self.block, self.density) + (chunk_bytes(rest, self.density) if rest else 0)

    def _rows(self, n: int) -> list[tuple[int, int, int, int]]:
        """(first value, chunks, values per chunk, first byte) of the full chunks and of the short last one."""
        full, rest = divmod(n, self.block)
        out = [(0, full, self.block, 0)] if full else []
        return out + ([(full * self.block, 1, rest, full * chunk_bytes(self.block, self.density))] if rest else [])

    def encode(self, x: torch.Tensor, tail: int = 0, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None, weight: float = 1.0, stats: Row = None,
               decoded: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        """The bytes of `weight` x the chunk, then `tail` spare bytes; what a receiver decodes goes into
        `decoded`, its statistics into `stats` (`scratch`, `stream`: unused)."""
        n = x.numel()
        if weight != 1.0:
            x = x * weight
        if not bool(torch.isfinite(x).all()):
            raise ValueError("sparse all-reduce got a non-finite value; exclude the site (weight 0) instead")
        out = torch.empty(self.nbytes(n) + tail, dtype=torch.uint8) if out is None else out
        for start, m, c, at in self._rows(n):
            rows = x[start : start + m * c].view(m, c)
            out[at : at + m * chunk_bytes(c, self.density)] = _encode_rows(rows, keep(c, self.density)).view(-1)
        if stats is not None or decoded is not None:
            self.decode(out, n, out=decoded, stats=stats)
        return out

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None, stats: Row = None,
               stream: bool = False) -> torch.Tensor:
        """The fp32 values of an encoded chunk (zeros but at the sent indices), into `out` when given;
        `stats` += their (sum of squares, non-finite count)."""
        out = torch.empty(n, dtype=torch.float32) if out is None else out
        for start, m, c, at in self._rows(n):
            size = chunk_bytes(c, self.density)
            _decode_rows(buf[at : at + m * size].view(m, size), keep(c, self.density),
                         out[start : start + m * c].view(m, c))
        if stats is not None:
            add_stats(stats, out)
        return out

    def add_decoded(self, total: torch.Tensor, buf: torch.Tensor, n: int, first: bool, scratch: torch.Tensor,
                    stats: Row = None) -> None:
        """total <- (+0 if `first` else total) + the decoded chunk; `stats` += its statistics."""
        accumulate(total, self.decode(buf, n, out=scratch[:n], stats=stats), 1.0, first)


def _encode_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """[m, bytes] uint8: each row of `rows` ([m, c] fp32, finite) as one chunk (module comment)."""
    mags, picked = torch.topk(rows.abs(), k, dim=1, sorted=True)  # largest first
    half = max(1, k // 2)
    levels = torch.stack([mags[:, k // 2 :].mean(dim=1), mags[:, :half].mean(dim=1)], dim=1).to(torch.bfloat16)
    lo, hi = levels.to(torch.float32).unbind(dim=1)
    index, _ = picked.sort(dim=1)
    values = rows.gather(1, index)
    code = (values < 0).to(torch.uint8) | ((2 * values.abs() >= (lo + hi)[:, None]).to(torch.uint8) << 1)
    code = torch.nn.functional.pad(code, (0, -k % 4)).view(len(rows), -1, 4)
    packed = code[..., 0] | (code[..., 1] << 2) | (code[..., 2] << 4) | (code[..., 3] << 6)
    pairs = torch.nn.functional.pad(index, (0, k % 2)).view(len(rows), -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    triples = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=2).to(torch.uint8).view(len(rows), -1)
    return torch.cat([levels.view(torch.uint8).view(len(rows), LEVEL_BYTES), packed, triples], dim=1)


def _decode_rows(chunks: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """out ([m, c] fp32) <- the decoded rows of `chunks` ([m, bytes] uint8)."""
    m, c = out.shape
    levels = chunks[:, :LEVEL_BYTES].reshape(-1).clone().view(torch.bfloat16).to(torch.float32).view(m, 2)  # lo, hi
    ncode = -(-k // 4)
    code = chunks[:, LEVEL_BYTES : LEVEL_BYTES + ncode].long()
    code = torch.stack([(code >> s) & 3 for s in (0, 2, 4, 6)], dim=2).view(m, -1)[:, :k]
    t = chunks[:, LEVEL_BYTES + ncode :].long().view(m, -1, 3)
    index = torch.stack([t[..., 0] | ((t[..., 1] & 0xF) << 8), (t[..., 1] >> 4) | (t[..., 2] << 4)], dim=2)
    index = index.view(m, -1)[:, :k]
    bad = (index[:, -1] >= c) | (torch.diff(index, dim=1) <= 0).any(dim=1)  # a forged chunk: NaN, never a race
    magnitude = torch.where(code & 2 == 2, levels[:, 1:], levels[:, :1])
    values = torch.where(code & 1 == 1, -magnitude, magnitude)
    out.zero_()
    out.scatter_(1, index.clamp(max=c - 1), values)
    if bool(bad.any()):
        out[bad] = math.nan


def _build(settings: Any) -> SparseCodec:
    return SparseCodec(float(settings.density))


CODEC = CodecSpec(
    name="sparse",
    build=_build,
    about="top diloco.density of each 4096 values at 2 bits + 12-bit indices: ~0.036 bytes per parameter at 0.02",
    feedback="always",
    exchange="gather",
)
