"""The bf16 wire codec: raw bf16 values: 2 bytes per parameter (the format: comm/dense.py)."""

from __future__ import annotations

from zeroband.comm.codecs import CodecSpec
from zeroband.comm.dense import DenseCodec

CODEC = CodecSpec(
    name="bf16",
    build=lambda settings: DenseCodec("bf16"),
    about="raw bf16 values: 2 bytes per parameter",
)
