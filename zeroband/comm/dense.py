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

from zeroband.comm.direct import DEFAULT_PIECE_BYTES, add_stats, all_reduce_direct
from zeroband.comm.group import GlobalGroup

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_HEADROOM = 2.0**15  # half of fp16's max: rounding up the largest value cannot overflow
SCALE_HEADER = 4  # fp16 messages start with their fp32 scale
# fp16 values are multiples of 2**-24: times a power of two >= 2**-100 they stay exact in fp32 (finest step 2**-149)
EXACT_UNIT = 2.0**-100
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
               scratch: torch.Tensor | None = None, weight: float = 1.0) -> torch.Tensor:
        """The bytes of `weight` x the chunk (bit for bit those of encoding the fp32 product), followed
        by `tail` spare bytes (room for a message tag); written into `out` (uint8, exactly that long)
        when given. `scratch` (fp32, at least as long as x) holds values on their way to the wire:
        fresh memory costs a page fault per 4 KB, which made the product ~6x slower than the arithmetic."""
        out = torch.empty(self.nbytes(x.numel()) + tail, dtype=torch.uint8) if out is None else out
        body = out[self.header : out.numel() - tail].view(self.dtype)
        if self.wire != "fp16" and weight == 1.0:
            body.copy_(x)
            return out
        room = torch.empty_like(x) if scratch is None else scratch[: x.numel()]
        if self.wire != "fp16":
            body.copy_(torch.mul(x, weight, out=room))
            return out
        w32 = as_fp32(weight)  # what torch multiplies an fp32 tensor by
        scale = fp16_scale(as_fp32(max_abs(x) * abs(w32)))  # max |fp32(x w)|: rounding is monotonic
        factor = w32 * scale
        if not one_product(factor, scale):
            x, factor = torch.mul(x, weight, out=room), scale  # the two roundings, one at a time
        out[:SCALE_HEADER] = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
        body.copy_(torch.mul(x, factor, out=room))  # fp32 product, then one rounding (a direct fp16 `out=` is slower)
        return out

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None,
               stats: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values of an encoded chunk, written into `out` when given (no new memory);
        `stats` (float64 [sum of squares, non-finite count]) += those of the values (see `measure`)."""
        values, unit = self.wire_values(buf, n, out, stats)
        # x unit = / scale, bit for bit: both are one rounding of the same exact product (a power of
        # two and its inverse are exact in fp32); the division is ~3x slower on CPU
        return values if unit == 1.0 else values.mul_(unit)

    def wire_values(self, buf: torch.Tensor, n: int, out: torch.Tensor | None,
                    stats: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """`decode` in two factors: fp32 values (into `out`) and a power of two, whose product is the
        decoded values exactly, so an owner can scale and sum in one op (comm/direct.py `accumulate`);
        `stats` += the decoded values' statistics. A factor so small that the product could fall
        below fp32's finest step is applied here instead (the values then come back decoded)."""
        values = self._widen(buf, n, out)
        unit = 1.0 / self._scale(buf)
        if stats is not None:
            add_stats(stats, values, unit)
        if unit < EXACT_UNIT:
            return values.mul_(unit), 1.0
        return values, unit

    def measure(self, buf: torch.Tensor, n: int, scratch: torch.Tensor, stats: torch.Tensor) -> None:
        """`stats` += (sum of squares, non-finite count) of the decoded values, without decoding them:
        the wire values' norm over the power-of-two scale (the same number, free of fp32 underflow).
        `decode(stats=...)` measures the same way, so sender and receiver agree on the same bytes."""
        add_stats(stats, self._widen(buf, n, scratch[:n]), 1.0 / self._scale(buf))

    def _widen(self, buf: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
        values = buf[self.header :].view(self.dtype)[:n]
        return values.to(torch.float32) if out is None else out.copy_(values)

    def _scale(self, buf: torch.Tensor) -> float:
        return float(buf[:SCALE_HEADER].view(torch.float32)) if self.wire == "fp16" else 1.0


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


def max_abs(x: torch.Tensor) -> float:
    """max |x| in one read pass without a temporary (NaN if x has one; 0.0 when empty)."""
    if not x.numel():
        return 0.0
    return float(torch.maximum(x.amin().neg_(), x.amax()))  # amin + amax: ~1.5x faster than one aminmax on CPU


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
