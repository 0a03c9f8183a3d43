"""fp32, bf16 and fp16 wire formats for the pseudo-gradient all-reduce (schedule: comm/direct.py).

fp16 is made safe by a power-of-two scale per message: the sender multiplies the chunk by the
largest power of two s with s x max|chunk| <= 2**15 and puts s (4 bytes, fp32) in front of the
values. Small pseudo-gradients keep fp16's full precision, nothing overflows, and multiplying or
dividing by a power of two is exact, so the scale adds no rounding of its own. Sums are taken in
fp32 by the chunk's owner (comm/direct.py), never in fp16, so S sites cannot overflow either.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from zeroband.comm.direct import DEFAULT_PIECE_BYTES, all_reduce_direct
from zeroband.comm.group import GlobalGroup
from zeroband.comm.kernels import Row, add_stats, kernels

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_HEADROOM = 2.0**15  # half of fp16's max: rounding up the largest value cannot overflow
SCALE_HEADER = 4  # fp16 messages start with their fp32 scale
FP32_MAX = float(torch.finfo(torch.float32).max)
MAX_SCALE_EXP = 127  # the scale travels as fp32: 2**128 would be inf, and inf x 0 a NaN on the wire


def fp16_scale(max_abs: float) -> float:
    """Largest power of two s <= 2**127 with s * max_abs <= 2**15 (1.0 when there is nothing to scale).
    The cap matters only for chunks whose values are all below ~1e-34: they keep fewer fp16 bits
    instead of turning into NaN."""
    if not math.isfinite(max_abs) or max_abs <= 0:
        return 1.0
    return 2.0 ** min(MAX_SCALE_EXP, math.floor(math.log2(FP16_HEADROOM / max_abs)))


@dataclass(frozen=True)
class DenseCodec:
    """A 1-D fp32 chunk as raw fp32 / bf16 values, or as a scale header plus fp16 values."""

    wire: str
    block: int = 1

    def __post_init__(self) -> None:
        if self.wire not in WIRE_DTYPES:
            raise ValueError(f"unknown dense wire format {self.wire!r}; choose from {sorted(WIRE_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.wire]

    @property
    def header(self) -> int:
        return SCALE_HEADER if self.wire == "fp16" else 0

    def nbytes(self, n: int) -> int:
        return self.header + n * (torch.finfo(self.dtype).bits // 8)

    def encode(self, x: torch.Tensor, tail: int = 0, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None, weight: float = 1.0, stats: Row = None,
               decoded: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        """The bytes of `weight` x the chunk (bit for bit those of encoding the fp32 product), followed
        by `tail` spare bytes (room for a message tag); written into `out` (uint8, exactly that long)
        when given. `scratch` (fp32, at least as long as x) holds values on their way to the wire:
        fresh memory costs a page fault per 4 KB (docs/results/outer_step.md, "the fp16 codec without
        fresh memory").
        In the same pass, what a receiver will decode goes into `decoded` (past the cache with `stream`,
        comm/kernels.py) and its statistics into `stats`."""
        out = torch.empty(self.nbytes(x.numel()) + tail, dtype=torch.uint8) if out is None else out
        body = out[self.header : out.numel() - tail].view(self.dtype)
        room = torch.empty_like(x) if scratch is None else scratch[: x.numel()]
        if self.wire != "fp16":
            body.copy_(x if weight == 1.0 else torch.mul(x, weight, out=room))
            if stats is not None or decoded is not None:
                self.decode(out, x.numel(), room if decoded is None else decoded, stats, stream)
            return out
        w32 = as_fp32(weight)  # what torch multiplies an fp32 tensor by
        k = kernels()
        scale = fp16_scale(as_fp32(k.max_abs(x) * abs(w32)))  # max |fp32(x w)|: rounding is monotonic
        factor = w32 * scale
        if not one_product(factor, scale):
            x, factor = torch.mul(x, weight, out=room), scale  # the two roundings, one at a time
        out[:SCALE_HEADER] = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
        k.encode_f16(x, factor, body, room, decoded, 1.0 / scale, stats, stream)
        return out

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None, stats: Row = None,
               stream: bool = False) -> torch.Tensor:
        """The fp32 values of an encoded chunk, written into `out` when given (no new memory; past the
        cache with `stream`); `stats` (float64 [sum of squares, non-finite count]) += those of the values."""
        values = buf[self.header :].view(self.dtype)[:n]
        out = torch.empty(n, dtype=torch.float32) if out is None else out
        if self.wire == "fp16":  # x unit, not / scale: bit for bit the same (a power of two and its
            kernels().decode_f16(values, self._unit(buf), out, stats, stream)  # inverse are exact), and
            # faster than a division (docs/results/outer_step.md, "the fp16 codec without fresh memory")
            return out
        out.copy_(values)
        if stats is not None:
            add_stats(stats, out)
        return out

    def add_decoded(self, total: torch.Tensor, buf: torch.Tensor, n: int, first: bool, scratch: torch.Tensor,
                    stats: Row = None) -> None:
        """total <- (+0 if `first` else total) + the decoded chunk, in one pass: the bits of decoding and
        adding one by one (comm/kernels.py); `stats` += the decoded values' statistics."""
        values = buf[self.header :].view(self.dtype)[:n]
        if self.wire == "fp16":
            kernels().add_f16(total, values, self._unit(buf), first, scratch, stats)
        else:
            kernels().add_f32(total, values if self.wire == "fp32" else scratch[:n].copy_(values), 1.0, first,
                              scratch, stats)

    def _unit(self, buf: torch.Tensor) -> float:
        """1 / the message's scale: what its fp16 values are multiplied by to decode them (a forged
        scale of 0 decodes to inf/NaN, which the review rejects, rather than raising here)."""
        scale = float(buf[:SCALE_HEADER].view(torch.float32))
        return 1.0 / scale if scale else math.inf


def as_fp32(x: float) -> float:
    """x rounded to the nearest fp32 (as torch rounds a Python scalar for an fp32 tensor)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # raised exactly when the rounded value is infinite
        return math.copysign(math.inf, x)


def one_product(factor: float, scale: float) -> bool:
    """Whether x x factor (factor = fp32 weight x power-of-two scale) rounds to the same fp16 as
    fp32(x x weight) x scale. Scaling by a power of two commutes with rounding wherever both
    products are normal fp32, so the one product is exact for every x when `factor` is itself a
    normal fp32 and the scale is at most 2**100: values that are fp32-subnormal before or after
    scaling are then below 2**-26, and fp16 rounds them to the same signed zero either way."""
    return scale <= 2.0**100 and 2.0**-126 <= factor <= FP32_MAX and as_fp32(factor) == factor


def all_reduce_dense(
    tensors: list[torch.Tensor],
    group: GlobalGroup,
    wire: str,
    weight: float,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    error_feedback: dict[int, torch.Tensor] | None = None,
) -> int:
    """In place: tensors <- sum over sites of (weight_site * tensors_site), sent as `wire` values.

    `weight` is this site's share (e.g. 1/n for a plain average, 0 for an excluded site). Every
    site ends bitwise identical. Returns the bytes this site sent.
    """
    return all_reduce_direct(tensors, group, DenseCodec(wire), weight, piece_bytes, error_feedback)
