"""The codec registry (zeroband/comm/codecs/): one file per wire format, asked for its bytes and its exchange."""

import pytest
import torch

from zeroband.comm import codecs
from zeroband.comm.reduce import wire_codec
from zeroband.config import ConfigError, DilocoConfig, codec_names, load_config
from zeroband.tools.plan import DTYPE_BYTES, PlanInput, predict


def test_registry_is_the_files_and_each_names_itself():
    assert set(codecs.registry()) == set(codec_names()) >= {"fp32", "bf16", "fp16", "int8", "int4"}
    for name, spec in codecs.registry().items():
        assert spec.name == name and spec.about


def test_bytes_per_param_are_the_codecs_own():
    got = {name: codecs.spec(name).bytes_per_param() for name in ("fp32", "bf16", "fp16", "int8", "int4")}
    assert got == {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1 + 2 / 128, "int4": 0.5 + 2 / 64}
    for name, value in got.items():  # the planner's table is the registry's, and so is each codec's nbytes
        assert DTYPE_BYTES[name] == value
        codec = wire_codec(name)
        assert codec.nbytes(1 << 16) - codec.header == value * (1 << 16)


def test_plan_payload_comes_from_the_codec():
    for name, spec in codecs.registry().items():
        pred = predict(PlanInput(1e6, 1.0, 4, 1.0, 50.0, 100, name))
        assert pred.payload_bytes == pytest.approx(1e6 * spec.bytes_per_param())
        assert pred.wire_bytes == pytest.approx(spec.wire_factor(4) * pred.payload_bytes)


def test_round_trip_through_the_registry():
    x = torch.randn(1000)
    for name in codecs.names():
        codec = wire_codec(name)
        buf = codec.encode(x)
        assert buf.numel() == codec.nbytes(1000) and codec.decode(buf, 1000).shape == (1000,)


def test_unknown_codec_is_one_line_naming_the_key_the_choices_and_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--diloco.comm_dtype", "int3"])
    line = [x for x in str(e.value).splitlines() if "comm_dtype" in x]
    assert len(line) == 1 and "diloco.comm_dtype" in line[0] and "int3" in line[0]
    assert all(name in line[0] for name in codec_names()) and "Fix: --diloco.comm_dtype" in line[0]
    assert DilocoConfig(comm_dtype="int4").comm_dtype == "int4"


def test_data_parallel_refuses_a_codec_that_needs_error_feedback():
    from zeroband.outer.data_parallel import CrossSiteDataParallel

    with pytest.raises(ValueError, match="needs error feedback"):
        CrossSiteDataParallel(torch.nn.Linear(1, 1), DilocoConfig(comm_dtype="sparse", mode="data_parallel"), None, None)  # type: ignore[arg-type]


def test_plan_asks_the_sparse_codec_at_the_configured_density():
    from dataclasses import replace

    p = PlanInput(4096 * 1000, 1.0, 3, 1.0, 50.0, 100, "sparse")
    assert predict(p).payload_bytes == 148 * 1000 and predict(p).wire_bytes == 2 * 148 * 1000
    assert predict(replace(p, density=0.05)).payload_bytes == (4 + 52 + 3 * 103) * 1000  # k = 205 of 4096
