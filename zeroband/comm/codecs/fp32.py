"""The fp32 wire codec: raw fp32 values: 4 bytes per parameter (the format: comm/dense.py)."""

from __future__ import annotations

from zeroband.comm.codecs import CodecSpec
from zeroband.comm.dense import DenseCodec

CODEC = CodecSpec(
    name="fp32",
    build=lambda settings: DenseCodec("fp32"),
    about="raw fp32 values: 4 bytes per parameter",
)
