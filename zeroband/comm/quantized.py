"""int8 and 4-bit wire formats for the pseudo-gradient all-reduce: fp32 in, bytes out, fp32 back.

The schedule (direct reduce-scatter + all-gather, pipelined, fp32 accumulation, one encoding per
value per phase, every site bitwise identical) is comm/direct.py's; this module only says how a
chunk becomes bytes.

Wire format of one chunk: per-block scales (bf16, rounded up so no code overflows), then the codes
(int8: one byte per value; 4-bit: two 4-bit codebook indices per byte). Rounding is
round-to-nearest, so the result depends only on the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroband.comm.direct import DEFAULT_PIECE_BYTES, all_reduce_direct
from zeroband.comm.group import GlobalGroup
from zeroband.comm.kernels import Row, accumulate, add_stats

SCALE_DTYPE = torch.bfloat16  # fp32's exponent range in 2 bytes: no overflow/underflow of scales
SCALE_BYTES = 2
# Smaller blocks track heavy tails better: the one-pass error on Student-t (3 dof) data at these
# blocks and at twice them is in benchmarks/quantized.md (scripts/bench_quantized.py). Scales then
# cost 2/128 and 2/64 bytes per value, inside the 1.05 / 0.55 byte budgets.
DEFAULT_BLOCK = {8: 128, 4: 64}

# 4-bit codebooks on [-1, 1] (the block's absmax maps to 1). All contain 0 exactly so zeros (an
# excluded site, padding) cost nothing. NF4 (Dettmers et al. 2023): quantiles of a normal.
CODEBOOKS: dict[str, list[float]] = {
    "nf4": [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ],
    "int4": [i / 7 for i in range(-7, 8)],  # uniform, symmetric: 15 levels
    "fp4": [v / 6 for v in (-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6)],  # e2m1, one zero
}


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> the smallest bf16 >= x (so |value| / scale never exceeds the top code)."""
    y = x.to(SCALE_DTYPE)
    low = y.to(torch.float32) < x
    if bool(low.any()):
        bits = y.view(torch.int16)
        bits[low] += 1  # for positive floats the next bit pattern is the next larger value
    return y


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` as [blocks, block] rows, zero-padding the short last block."""
    nb = -(-x.numel() // block)
    pad = nb * block - x.numel()
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(nb, block)


class _Nearest:
    """Index of the nearest codebook level, equal to torch.bucketize on the midpoints but faster
    (benchmarks/kernels.md, from scripts/bench_kernels.py).

    A 2**k-bin table maps y to the level at its bin's start; one compare with the next midpoint
    finishes the job. Bin edges are multiples of a power of two, so the bin index is exact.
    """

    BINS = 512

    def __init__(self, book: list[float]) -> None:
        levels = torch.tensor(book, dtype=torch.float32)
        self.mid = (levels[1:] + levels[:-1]) / 2
        edges = torch.arange(self.BINS, dtype=torch.float32) * (2.0 / self.BINS) - 1.0
        below = (self.mid[None, :] < edges[:, None]).sum(dim=1)  # midpoints strictly below the start
        after = torch.cat([self.mid, torch.tensor([float("inf")])])
        self.next_mid = after[below]  # the only midpoint that can fall inside the bin
        self.table = below.to(torch.uint8)
        if bool((torch.diff(self.mid) <= 2.0 / self.BINS).any()):
            raise ValueError("codebook levels too close for the lookup table")

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        half = self.BINS // 2
        k = y.mul(half).floor_().add_(half).clamp_(0, self.BINS - 1).long()
        return torch.take(self.table, k).add_(y > torch.take(self.next_mid, k))


_NEAREST = {name: _Nearest(book) for name, book in CODEBOOKS.items()}



def _pair_table(book: list[float]) -> torch.Tensor:
    """[256, 2]: the two levels a packed byte stands for (low nibble first): decode is one gather."""
    levels = torch.tensor(book + [0.0] * (16 - len(book)), dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([levels[byte & 15], levels[byte >> 4]], dim=1).contiguous()


_PAIRS = {name: _pair_table(book) for name, book in CODEBOOKS.items()}


@dataclass(frozen=True)
class Codec:
    """Encodes a 1-D fp32 chunk into one uint8 buffer and back; `bits` is 8 or 4."""

    bits: int
    block: int
    codebook: str = "nf4"
    header = 0  # per-block scales are part of the payload; no per-message framing

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {self.bits}")
        if self.block < 1:
            raise ValueError(f"block_size must be positive, got {self.block}")
        if self.bits == 4 and self.codebook not in CODEBOOKS:
            raise ValueError(f"unknown 4-bit codebook {self.codebook!r}; choose from {sorted(CODEBOOKS)}")

    def nbytes(self, n: int) -> int:
        """Exact wire size of a chunk of n values."""
        blocks = -(-n // self.block)
        codes = n if self.bits == 8 else (n + 1) // 2
        return blocks * SCALE_BYTES + codes

    def encode(self, x: torch.Tensor, tail: int = 0, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None, weight: float = 1.0, stats: Row = None,
               decoded: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        """The bytes of `weight` x the chunk, followed by `tail` spare bytes (room for a message tag);
        written into `out` (uint8, exactly that long) when given (`scratch` holds the product). What a
        receiver will decode goes into `decoded`, its statistics into `stats` (`stream`: a hint it ignores)."""
        n = x.numel()
        if weight != 1.0:
            x = torch.mul(x, weight, out=None if scratch is None else scratch[: x.numel()])
        rows = _blocks(x, self.block)
        absmax = rows.abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("quantised all-reduce got a non-finite value; exclude the site (weight 0) instead")
        scale = _round_up_bf16(absmax / (127.0 if self.bits == 8 else 1.0))
        # An all-zero block has scale 0: divide by 1 instead, its codes are exactly 0 anyway.
        divisor = torch.where(scale > 0, scale.to(torch.float32), 1.0)
        codes = self._codes((rows / divisor[:, None]).view(-1)[: x.numel()])
        out = torch.empty(self.nbytes(x.numel()) + tail, dtype=torch.uint8) if out is None else out
        out[: scale.numel() * SCALE_BYTES] = scale.view(torch.uint8)
        out[scale.numel() * SCALE_BYTES : out.numel() - tail] = codes
        if stats is not None or decoded is not None:
            self.decode(out, n, out=decoded if decoded is not None else None if scratch is None else scratch[:n],
                        stats=stats)
        return out

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return y.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        idx = _NEAREST[self.codebook](y)
        if idx.numel() % 2:
            idx = torch.cat([idx, idx.new_zeros(1)])
        return idx[0::2] | (idx[1::2] << 4)

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None,
               stats: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        """The fp32 values of an encoded chunk: level x scale, one rounding, the same on every site
        (copied into `out` when given); `stats` += their (sum of squares, non-finite count)."""
        nb = -(-n // self.block)
        scale = buf[: nb * SCALE_BYTES].view(SCALE_DTYPE).to(torch.float32)
        codes = buf[nb * SCALE_BYTES : nb * SCALE_BYTES + (n if self.bits == 8 else (n + 1) // 2)]
        if self.bits == 8:
            values = codes.view(torch.int8).to(torch.float32)
        else:
            values = _PAIRS[self.codebook].index_select(0, codes.long()).view(-1)[:n]
        values = _blocks(values, self.block).mul_(scale[:, None]).view(-1)[:n]
        values = values if out is None else out.copy_(values)
        if stats is not None:
            add_stats(stats, values)
        return values

    def add_decoded(self, total: torch.Tensor, buf: torch.Tensor, n: int, first: bool, scratch: torch.Tensor,
                    stats: Row = None) -> None:
        """total <- (+0 if `first` else total) + the decoded chunk; `stats` += its statistics."""
        accumulate(total, self.decode(buf, n, out=scratch[:n], stats=stats), 1.0, first)


def all_reduce_quantized(
    tensors: list[torch.Tensor],
    group: GlobalGroup,
    bits: int,
    weight: float,
    block_size: int | None = None,
    error_feedback: dict[int, torch.Tensor] | None = None,
    codebook: str = "nf4",
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> int:
    """In place: tensors <- sum over sites of (weight_site * tensors_site), int8 or 4-bit on the wire.

    The schedule is comm/direct.py's (every site ends bitwise identical). `block_size` values
    share one scale (default 128 for int8, 64 for 4-bit); `codebook` picks the 4-bit levels
    ("nf4", "int4", "fp4"). `error_feedback` (a dict this site keeps between calls, keyed by tensor
    index) enables error feedback. Returns the bytes this site sent.
    """
    codec = Codec(bits, block_size or DEFAULT_BLOCK[bits], codebook)
    return all_reduce_direct(tensors, group, codec, weight, piece_bytes, error_feedback)
