"""The outer step's native kernels (zeroband/comm/kernels.c): built with the machine's C compiler,
they must write the eager torch path's bits on every vector path, refuse to load from a directory
others can write, and give way to the eager path wherever they cannot be trusted."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest
import torch

from zeroband.comm import kernels as K
from zeroband.outer import sgd_kernel as S

CC = K._compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler: the native kernels cannot be built here")
CPU_FLAGS = K._cpu()
# every vector path the file has; each is built only where this CPU can run it
ARCHES = {"native": ["-march=native"], "avx2": ["-mavx2", "-mf16c", "-mfma"], "scalar": []}


def _built(tmp_path: Path, arch: list[str], source: Path = K.SOURCE) -> K.Native:
    return K.load(K.build(CC, K.private_dir(tmp_path / "lib"), (arch,), source))


@needs_cc
@pytest.mark.parametrize("arch", list(ARCHES))
def test_every_vector_path_writes_the_eager_bits(arch: str, tmp_path: Path):
    """Each build (AVX-512 or whatever -march=native gives, AVX2+F16C+FMA, plain C) against eager torch,
    on the probe values and on random data of many lengths and scales: the same bits everywhere, and
    statistics within fp32 summation error."""
    if arch == "avx2" and not all(f in CPU_FLAGS for f in (" avx2", " f16c", " fma")):
        pytest.skip("this CPU has no AVX2/F16C/FMA")
    native = _built(tmp_path, ARCHES[arch])
    assert K.check(native) is None and S.check_sgd(S.build_and_load(CC, K.private_dir(tmp_path / "sgd"), (ARCHES[arch],)))
    gen = torch.Generator().manual_seed(11)
    for n in (1, 15, 16, 17, 4095, 4097, 70_001):
        for peak in (1e-30, 1.0, 3e4):
            x = torch.randn(n, generator=gen) * peak
            y = torch.randn(n, generator=gen)
            half = (x / max(peak, 1.0)).half()
            got, want = K.outputs(native, x, y, half), K.outputs(K.EAGER, x, y, half)
            for name, g in got.items():
                bits = torch.int32 if g.dtype == torch.float32 else torch.int16
                assert torch.equal(g.view(bits), want[name].view(bits)), f"{name}, n={n}, peak={peak}"
            for k in (native, K.EAGER):  # statistics: both close to the float64 definition
                row = torch.zeros(2, dtype=torch.float64)
                k.decode_f16(half, 0.25, torch.empty(n), row)
                want_sq = float(half.double().mul(0.25).square().sum())
                assert row[0] == pytest.approx(want_sq, rel=2e-5) and row[1] == 0
            assert native.sub_sumsq(x, y, torch.empty(n)) == pytest.approx(float((x.double() - y.double()).square().sum()), rel=2e-5)


def _threaded(native: K.Native, threads: int, x: torch.Tensor, y: torch.Tensor,
              half: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Every output at `threads`, and the statistics of the kernels that keep them."""
    native.threads = threads
    try:
        out = K.outputs(native, x, y, half)
        rows = [torch.zeros(2, dtype=torch.float64) for _ in range(3)]
        native.decode_f16(half, 0.25, torch.empty(x.numel()), rows[0])
        native.encode_f16(x, 0.5, torch.empty(x.numel(), dtype=torch.float16), torch.empty(x.numel()), None, 1.0, rows[1])
        native.add_f32(torch.zeros(x.numel()), x, 0.37, True, torch.empty(0), rows[2])
        sums = [float(v) for r in rows for v in r] + [native.sub_sumsq(x, y, torch.empty(x.numel())), native.max_abs(x)]
    finally:
        native.threads = 1
    return out, sums


@needs_cc
def test_split_runs_write_the_same_bits_at_any_thread_count(tmp_path: Path):
    """A kernel's values cut into runs over the library's worker threads: bitwise the one-thread
    outputs (each value is the same arithmetic), statistics within fp32 summation error, uneven
    lengths included."""
    native = _built(tmp_path, ARCHES["native"])
    gen = torch.Generator().manual_seed(5)
    n = 9 * 65_536 + 4_101  # ~9 runs of the minimum size, and a tail that is not a whole block
    x = torch.randn(n, generator=gen) * torch.logspace(-20, 4, n)[torch.randperm(n, generator=gen)]
    y, half = torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 100).half()
    want, want_sums = _threaded(native, 1, x, y, half)
    for threads in (2, 3, 8):
        got, sums = _threaded(native, threads, x, y, half)
        for name, g in got.items():
            bits = torch.int32 if g.dtype == torch.float32 else torch.int16
            assert torch.equal(g.view(bits), want[name].view(bits)), f"{name} at {threads} threads"
        assert sums == pytest.approx(want_sums, rel=1e-6)  # float64 sums of per-block fp32 sums, reordered


@needs_cc
def test_a_child_forked_after_the_workers_started_runs_threaded_kernels(tmp_path: Path):
    """A child forked once the kernels' worker threads run (tests fork their ranks) starts workers of
    its own and writes the same bits. (An OpenMP team here would have been torch's libgomp's: the
    child's next parallel region, torch's included, hung.)"""
    import multiprocessing as mp

    native = _built(tmp_path, ARCHES["native"])
    x = torch.randn(600_000, generator=torch.Generator().manual_seed(3))
    native.threads = 4
    want = torch.empty_like(x)
    native.copy(x, want)  # the workers start in this process
    lib = str(K.build(CC, K.private_dir(tmp_path / "lib"), (ARCHES["native"],)))
    with mp.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(_child_copy, (lib, x)).get(timeout=60)
    native.threads = 1
    assert torch.equal(got, want)


def _child_copy(lib: str, x: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(1)  # as forked ranks run
    native = K.load(Path(lib))
    native.threads = 4
    out = torch.empty_like(x)
    native.copy(x, out)
    return out


@needs_cc
def test_statistics_count_what_is_not_finite(tmp_path: Path):
    native = _built(tmp_path, ARCHES["native"])
    half = torch.tensor([1.0, float("inf"), float("nan"), -2.0] * 9, dtype=torch.float16)
    for k in (native, K.EAGER):
        row = torch.zeros(2, dtype=torch.float64)
        k.decode_f16(half, 1.0, torch.empty(36), row)
        assert math.isnan(row[0]) and row[1] == 18
    assert math.isnan(native.max_abs(torch.tensor([1.0] * 20 + [float("nan")])))
    assert native.max_abs(torch.tensor([-3.0] + [1.0] * 20)) == 3.0 and native.max_abs(torch.empty(0)) == 0.0


@needs_cc
def test_the_check_rejects_a_kernel_that_rounds_otherwise(tmp_path: Path):
    """The bitwise check is what stands between a wrong build and the model: one that rounds fp16
    toward zero, or fuses the momentum product into the sum everywhere, must be caught."""
    source = K.SOURCE.read_text()
    toward_zero = tmp_path / "toward_zero.c"
    toward_zero.write_text(source.replace("_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC",
                                          "_MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC"))
    if "avx512f" in CPU_FLAGS or " f16c" in CPU_FLAGS:  # the replaced intrinsic is on this CPU's path
        assert K.check(_built(tmp_path / "a", ARCHES["native"], toward_zero)).startswith("encode_f16")
    fused = tmp_path / "fused.c"
    fused.write_text(S.SOURCE.read_text().replace("vadd(vmul(vload(buf + i), vm), gi)", "vfma(vload(buf + i), vm, gi)")
                     .replace("buf[i] * m + gi;", "fmaf(buf[i], m, gi);"))
    assert not S.check_sgd(S.build_and_load(CC, K.private_dir(tmp_path / "b"), (ARCHES["native"],), fused))


@needs_cc
def test_the_library_is_built_once_and_reused(tmp_path: Path):
    first = K.build(CC, K.private_dir(tmp_path))
    stamp = first.stat().st_mtime_ns
    assert K.build(CC, K.private_dir(tmp_path)) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no half-written temporaries left


@needs_cc
def test_threads_of_one_process_building_at_once_all_get_the_library(tmp_path: Path):
    """The simulator's sites are threads of one process: each may build the missing library at the
    same moment, and each must get it (a temporary file named by the process alone was renamed away
    by the first thread, and the others fell back to the eager path)."""
    directory, barrier = K.private_dir(tmp_path / "lib"), threading.Barrier(4)
    got: list[Path | BaseException] = []

    def one() -> None:
        barrier.wait()
        try:
            got.append(K.build(CC, directory, (ARCHES["scalar"],)))
        except BaseException as e:  # noqa: BLE001  (the assertion below names it)
            got.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and isinstance(got[0], Path), got
    assert K.check(K.load(got[0])) is None and [p.name for p in directory.iterdir()] == [got[0].name]


def test_a_library_others_can_write_is_not_loaded(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="ZEROBAND_KERNEL_DIR"):
        K.private_dir(shared)
    lib = tmp_path / "zb_kernels-x.so"
    lib.write_bytes(b"")
    lib.chmod(0o666)
    with pytest.raises(ValueError, match="writable by others"):
        K.load(lib)


def test_without_a_compiler_the_eager_path_runs_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang on it
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("ZEROBAND_KERNEL_DIR", str(tmp_path / "kernels"))
    K.native_or_eager.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="zeroband.comm.kernels"):
            assert K.kernels() is K.EAGER
        assert "no C compiler" in caplog.text and "same bits" in caplog.text
    finally:
        K.native_or_eager.cache_clear()
    monkeypatch.setenv("ZEROBAND_KERNELS", "eager")
    assert K.kernels() is K.EAGER


def test_only_output_larger_than_the_cache_is_streamed():
    assert not K.streams(32 << 20) and K.streams(K.STREAM_BYTES + 1)


@pytest.mark.parametrize("momentum, nesterov", [(0.5, True), (0.9, False), (0.0, False)])
def test_the_outer_step_is_torchs_sgd_then_the_copy_back(momentum: float, nesterov: bool, kernel_impl: str):
    """NesterovSGD.step (SGD on the outer copy, the local shard written in the same pass) gives what
    torch.optim.SGD(fused=True) and a copy give, bit for bit, with its state in the optimizer (so a
    checkpoint reads the same), through a first step without a buffer and changes of lr and momentum
    (handed to the step as a schedule; the optimizer's param_groups keep the configured values)."""
    from zeroband.comm.timing import Parts
    from zeroband.config import DilocoConfig
    from zeroband.outer.optimizer import NesterovSGD, OuterHyper
    from zeroband.outer.placement import OuterCopy

    gen = torch.Generator().manual_seed(2)
    local = [torch.randn(333, 7, generator=gen), torch.randn(5, generator=gen), torch.randn(4099, generator=gen)]
    copy = OuterCopy(local, DilocoConfig(inner_steps=1))
    ref = [t.clone() for t in local]
    ours = NesterovSGD(torch.optim.SGD(copy.tensors, lr=0.7, momentum=momentum, nesterov=nesterov, fused=True))
    theirs = torch.optim.SGD(ref, lr=0.7, momentum=momentum, nesterov=nesterov, fused=True)
    for step in range(4):
        grads = [torch.randn(t.shape, generator=gen) * 10.0**-step for t in local]
        hyper = OuterHyper(lr_scale=1 / (step + 1), momentum_scale=min(1.0, (step + 1) / 2))
        theirs.param_groups[0].update(lr=0.7 * hyper.lr_scale, momentum=momentum * hyper.momentum_scale)
        ours.step(copy, grads, hyper, Parts(), into_local=True)
        for r, g in zip(ref, grads):
            r.grad = g
        theirs.step()
        for o, t, r in zip(copy.tensors, local, ref):
            assert torch.equal(o.view(torch.int32), r.view(torch.int32)) and torch.equal(t, o)
    mine, want = ours.state_dict(), theirs.state_dict()
    scheduled = ("lr", "momentum")
    assert [{k: v for k, v in g.items() if k not in scheduled} for g in mine["param_groups"]] == \
        [{k: v for k, v in g.items() if k not in scheduled} for g in want["param_groups"]]
    assert mine["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert state.keys() == mine["state"][i].keys()
        if "momentum_buffer" in state:
            buf = mine["state"][i]["momentum_buffer"]
            assert buf.shape == state["momentum_buffer"].shape and torch.equal(buf, state["momentum_buffer"])
