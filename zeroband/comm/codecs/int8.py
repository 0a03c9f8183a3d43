"""The int8 wire codec: int8 codes, a bf16 scale per 128 values: 1 + 2/128 bytes per parameter (the format: comm/quantized.py)."""

from __future__ import annotations

from zeroband.comm.codecs import CodecSpec
from zeroband.comm.quantized import DEFAULT_BLOCK, Codec

CODEC = CodecSpec(
    name="int8",
    build=lambda settings: Codec(8, DEFAULT_BLOCK[8]),
    about="int8 codes, a bf16 scale per 128 values: 1 + 2/128 bytes per parameter",
)
