"""Bucketed all-reduce of fp32 tensors in a chosen wire dtype (fp32, bf16, fp16).

fp16 is made safe by a shared power-of-two scale: every site knows the largest pseudo-gradient
magnitude of every site (exchanged before the payload), so all sites pick the same scale, the
worst-case sum stays below half of fp16's 65504, and small values keep their precision.
Multiplying by a power of two is exact, so the scale adds no rounding of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from zeroband.mesh import GlobalGroup

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_HEADROOM = 2.0**15  # half of fp16's max, so a sum of same-signed terms cannot overflow


def fp16_scale(max_abs: float) -> float:
    """Largest power of two s with s * max_abs <= 2**15 (1.0 when there is nothing to scale)."""
    if not math.isfinite(max_abs) or max_abs <= 0:
        return 1.0
    return 2.0 ** math.floor(math.log2(FP16_HEADROOM / max_abs))


def buckets(tensors: list[torch.Tensor], bucket_bytes: int, elem_bytes: int) -> Iterator[list[int]]:
    """Consecutive groups of tensor indices whose payload fits in a bucket (a big tensor alone)."""
    group: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * elem_bytes
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append(i)
        size += nbytes
    if group:
        yield group


def all_reduce_weighted(
    tensors: list[torch.Tensor],
    group: GlobalGroup,
    wire: str,
    weight: float,
    bucket_bytes: int,
    max_abs: float,
) -> int:
    """In place: tensors <- sum over sites of (weight_site * tensors_site), sent as `wire` dtype.

    `weight` is this site's share (e.g. 1/n for a plain average, 0 for an excluded site); `max_abs`
    must be the same on every site (the largest |value| any contributing site holds). Returns the
    payload bytes this rank put into the all-reduce.
    """
    dtype = WIRE_DTYPES[wire]
    scale = fp16_scale(max_abs) if dtype == torch.float16 else 1.0
    elem = torch.finfo(dtype).bits // 8
    payload = 0
    for idx in buckets(tensors, bucket_bytes, elem):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx]).mul_(weight * scale).to(dtype)
        group.all_reduce(flat)
        payload += flat.numel() * elem
        summed = flat.to(torch.float32).div_(scale)
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].copy_(summed[offset : offset + n].view_as(tensors[i]))
            offset += n
    return payload
