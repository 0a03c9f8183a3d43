"""The int4 wire codec: NF4 codes, a bf16 scale per 64 values: 0.5 + 2/64 bytes per parameter (the format: comm/quantized.py)."""

from __future__ import annotations

from zeroband.comm.codecs import CodecSpec
from zeroband.comm.quantized import DEFAULT_BLOCK, Codec

CODEC = CodecSpec(
    name="int4",
    build=lambda settings: Codec(4, DEFAULT_BLOCK[4]),
    about="NF4 codes, a bf16 scale per 64 values: 0.5 + 2/64 bytes per parameter",
)
