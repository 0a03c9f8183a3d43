"""The fp16 wire codec: fp16 values behind a power-of-two scale per message: 2 bytes per parameter (the format: comm/dense.py)."""

from __future__ import annotations

from zeroband.comm.codecs import CodecSpec
from zeroband.comm.dense import DenseCodec

CODEC = CodecSpec(
    name="fp16",
    build=lambda settings: DenseCodec("fp16"),
    about="fp16 values behind a power-of-two scale per message: 2 bytes per parameter",
)
