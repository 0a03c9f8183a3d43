"""The Nesterov outer optimizer's kernel: torch's fused SGD on the outer copy, in one pass that also
writes the local shard (zeroband/outer/sgd.c, built with the wire codec's kernels:
zeroband/comm/kernels.py). Only `outer/optimizer.py`'s `NesterovSGD` uses it.

`sgd(...)` runs the native kernel when it built and writes torch's bits (`check_sgd`: where torch's
compiler fused a product into a sum is a property of its build), else torch's own fused SGD and a
copy: the definition. `ZEROBAND_KERNELS=eager` forces torch's, as it does for the codec kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
from torch.optim.sgd import sgd as torch_sgd

from zeroband.comm import kernels as K

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("sgd.c")
SOURCES = (K.SOURCE, SOURCE)  # one translation unit: sgd.c uses kernels.c's vector helpers and pool
F32 = torch.float32
# torch's CPU fused SGD rounds a tensor's last n % 8 values as scalar code (its 16-wide loop leaves the
# rest to an 8-wide one the compiler made of its tail loop): where they start is zb_sgd's `tail_from`.
# Measured on torch 2.13 with AVX-512; `check_sgd` falls back to torch's optimizer wherever it differs.
TORCH_SCALAR_TAIL = 8


def eager_sgd(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, local: torch.Tensor | None, lr: float,
              momentum: float, nesterov: bool, stream: bool = False) -> torch.Tensor | None:
    """One step of torch.optim.SGD(fused=True) on `p` (dampening 0, no weight decay), as its `step()`
    runs it: `buf` None is the first step with momentum; returns the momentum buffer. Then local <- p."""
    bufs = [buf]
    torch_sgd([p], [g], bufs, fused=True, weight_decay=0.0, momentum=momentum, lr=lr, dampening=0.0,
              nesterov=nesterov, maximize=False)
    if local is not None:
        local.copy_(p)
    return bufs[0]


class NativeSGD:
    """zb_sgd through ctypes (the GIL is let go during the call); what it cannot take goes to `eager_sgd`."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, n, f, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.zb_sgd.restype, lib.zb_sgd.argtypes = None, [p, p, p, p, n, f, f, i, i, n, i, i]
        self.lib = lib
        self.threads = 1  # per call, at most (`set_threads`)

    def sgd(self, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, local: torch.Tensor | None, lr: float,
            momentum: float, nesterov: bool, stream: bool = False) -> torch.Tensor | None:
        if not K._fits((p, F32), (g, F32), (buf, F32), (local, F32)):
            return eager_sgd(p, g, buf, local, lr, momentum, nesterov, stream)
        first = momentum != 0 and buf is None
        if first:
            buf = torch.empty_like(p)
        n = p.numel()
        self.lib.zb_sgd(p.data_ptr(), g.data_ptr(), K._ptr(buf) if momentum != 0 else None, K._ptr(local), n,
                        lr, momentum, nesterov, first, n - n % TORCH_SCALAR_TAIL, stream, self.threads)
        return buf


def build_and_load(cc: str, directory: Path, arches: tuple[list[str], ...] = K.ARCH_FLAGS,
                   source: Path = SOURCE) -> NativeSGD:
    return NativeSGD(K.open_library(K.build(cc, directory, arches, (K.SOURCE, source))))


def check_sgd(native: NativeSGD, n: int = 40_000) -> bool:
    """Whether `native.sgd` gives torch's optimizer's bits (parameters, momentum buffer, local copy)
    over steps that start without a buffer, change lr and momentum, and run with momentum 0."""
    v = K.probe(n)
    bufs: list[torch.Tensor | None]  # the momentum buffers: none before the first step
    for nesterov in (True, False):
        for k in (n, n - 1, n - 9, 5):  # no tail; an 8-wide epilogue and 7 scalar values; 7 scalar; all scalar
            p, bufs, local = [v["x"][:k].clone(), v["x"][:k].clone()], [None, None], [K._off(k, True), K._off(k, False)]
            for step, (lr, momentum) in enumerate([(0.7, 0.1), (0.5, 0.9), (0.7, 0.0), (0.3, 0.6)]):
                g = v["y"][:k] * 10.0**-step
                bufs = [native.sgd(p[0], g, bufs[0], local[0], lr, momentum, nesterov, stream=True),
                        eager_sgd(p[1], g, bufs[1], local[1], lr, momentum, nesterov)]
                if not (_same(p[0], p[1]) and _same(local[0], local[1]) and _same(bufs[0], bufs[1])):
                    return False
    return True


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None
                                         and torch.equal(a.view(torch.int32), b.view(torch.int32)))


@functools.cache
def native_sgd() -> NativeSGD | None:
    """Built, loaded and checked once per process; None (one log line why) where it cannot be trusted."""
    if K.native_or_eager().name != "native":
        return None  # the codec kernels did not build here either: kernels.py said why
    try:
        native = build_and_load(K._compiler() or "cc", K.cache_dir())
    except (OSError, ValueError) as e:
        log.warning("outer optimizer: torch's own SGD (native kernel unavailable: %s)", e)
        return None
    if not check_sgd(native):
        log.warning("outer optimizer: torch's own SGD (this torch build rounds it otherwise than zb_sgd)")
        return None
    return native


def sgd(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, local: torch.Tensor | None, lr: float,
        momentum: float, nesterov: bool, stream: bool = False) -> torch.Tensor | None:
    """One fused-SGD step (see `eager_sgd`), native where it is trusted; returns the momentum buffer."""
    native = None if os.environ.get("ZEROBAND_KERNELS", "auto") == "eager" else native_sgd()
    if native is None:
        return eager_sgd(p, g, buf, local, lr, momentum, nesterov, stream)
    return native.sgd(p, g, buf, local, lr, momentum, nesterov, stream)


def set_threads(n: int) -> int:
    """Threads per native call from now on (as comm/kernels.py `set_threads`); returns the previous count."""
    native = None if os.environ.get("ZEROBAND_KERNELS", "auto") == "eager" else native_sgd()
    if native is None:
        return n
    before, native.threads = native.threads, max(1, n)
    return before


def implementation() -> str:
    """Which SGD runs: "native" or "torch" (benchmarks report it)."""
    return "native" if os.environ.get("ZEROBAND_KERNELS", "auto") != "eager" and native_sgd() else "torch"
