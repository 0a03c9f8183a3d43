"""The outer step's elementwise kernels, in two implementations that write the same bits.

`Eager` is torch, one op at a time: the definition. `Native` is zeroband/comm/kernels.c, one pass
over memory per kernel where eager takes two to four (subtract + measure, scale + convert +
widen + measure, widen + measure + add, ...): the outer step's local work is memory passes, so
this is most of its cost (docs/results/outer_step.md). Every value a native kernel writes is
bitwise the eager one (single IEEE operations, no fused multiply-add); only the statistics are
summed in another order (their consumers compare them with a tolerance).

`kernels()` picks once per process: `Native` when a C compiler builds the file and the result
passes a bitwise check against `Eager` on probe values, else `Eager` (one log line says why).
`ZEROBAND_KERNELS=eager` forces the eager path. Sites may differ in which they run: the bits agree.

The library is built once per (source, compiler, CPU) with `-march=native` into a cache directory
that this user owns and nobody else can write (`ZEROBAND_KERNEL_DIR`, default
~/.cache/zeroband/kernels): a library loaded from a directory others can write would run their code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11", "-pthread"]
ARCH_FLAGS: tuple[list[str], ...] = (["-march=native"], [])  # the host's vector units; then whatever the compiler defaults to
STREAM_BYTES = 64 << 20  # outputs larger than a last-level cache (32 MB here) gain nothing from going through it
EXACT_UNIT = 2.0**-100  # fp16 values x a power of two >= this stay exact in fp32 (finest step 2**-149)
Row = torch.Tensor | None  # float64 [sum of squares, non-finite count] that a kernel adds to
STATS_CHUNK = 1 << 20  # values per chunk: read once from memory, the second look hits cache
STATS_BLOCK = 4096  # values per fp32 partial sum of squares in `value_stats`: kernels.c's BLOCK
Measured = tuple[float, float]  # (sum of squares, NaN/inf count)


class ChunkStats:
    """`tensor_stats` one chunk at a time, so a pass that writes the chunks (the pseudo-gradient)
    can measure each while it is still in cache instead of reading everything again.

    Per chunk an fp32 2-norm, the squared norms summed in fp64: within ~1e-5 of an fp64 sum, and far
    faster (benchmarks/kernels.md, "sum of squares"). ATen's own reduction, not a BLAS dot: MKL's dot hangs in a process forked from one whose MKL threads had started. A NaN/inf
    anywhere makes the sum non-finite, and only then are the values counted. One host sync in
    `result`, so it also suits GPU tensors."""

    def __init__(self) -> None:
        self.norms: list[torch.Tensor] = []

    def add(self, chunk: torch.Tensor) -> None:
        self.norms.append(torch.linalg.vector_norm(chunk))

    def result(self, tensors: list[torch.Tensor]) -> Measured:
        """The statistics of `tensors`, which the added chunks tile (they recount NaN/inf)."""
        if not self.norms:
            return 0.0, 0.0
        sumsq = float(torch.stack(self.norms).double().square().sum())
        return sumsq, count_nonfinite(tensors, sumsq)


def count_nonfinite(tensors: list[torch.Tensor], sumsq: float) -> float:
    """NaN/inf values in `tensors`, whose sum of squares is `sumsq`: none when that is finite."""
    return 0.0 if math.isfinite(sumsq) else float(sum(int((~torch.isfinite(t)).sum()) for t in tensors))


def value_stats(values: torch.Tensor) -> tuple[float, float]:
    """(sum of squares, count of NaN/inf) of fp32 values, summed as kernels.c sums them: fp32 2-norms
    of blocks of STATS_BLOCK values, squared and added in float64 (ATen's reduction, not MKL's dot,
    which hangs in a process forked after MKL's threads started). One fp32 norm of the whole vector
    adds its squares one by one per vector lane, so its error grows with the length (2.7e-4 at 3.5M
    values); per block it is bounded by STATS_BLOCK roundings whatever the length, which is what
    comm/reduce.py's agreement check assumes (`stat_tolerance`). Overflows only past 1e19 per value,
    which is then rejected as it should be. A NaN/inf anywhere makes the sum non-finite, and only
    then are the values counted."""
    n = values.numel()
    if not n:
        return 0.0, 0.0
    flat, whole = values.reshape(-1), n - n % STATS_BLOCK
    norms = [torch.linalg.vector_norm(flat[:whole].view(-1, STATS_BLOCK), dim=1)] if whole else []
    if whole < n:
        norms.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    sumsq = float((norms[0] if len(norms) == 1 else torch.cat(norms)).double().square().sum())
    return sumsq, 0.0 if math.isfinite(sumsq) else float((~torch.isfinite(values)).sum())


def add_stats(row: torch.Tensor, values: torch.Tensor, unit: float = 1.0) -> None:
    """row += value_stats(values x unit), `unit` a power of two applied in float64 to the norm (exact)."""
    sumsq, nonfinite = value_stats(values)
    row[0] += sumsq * unit * unit
    row[1] += nonfinite


def accumulate(total: torch.Tensor, values: torch.Tensor, unit: float, first: bool) -> None:
    """total <- (0 if `first` else total) + values x unit, in one op: the bits of zeroing, decoding
    (x unit, exact: a power of two >= EXACT_UNIT) and adding one by one. Starting from an explicit
    +0 keeps the sign rule: a sum of -0s is +0, as it was from a zeroed total."""
    torch.add(_ZERO.expand(total.numel()) if first else total, values, alpha=unit, out=total)


_ZERO = torch.zeros(1)


class Kernels(Protocol):
    """The kernels; every tensor is 1-D fp32 (fp16 where named `half`), of one length per call.
    `scratch` is fp32 memory at least that long that the eager path may use; `stats` a Row.
    `stream`: the output (`out`, `decoded`) is not read again soon, e.g. it is larger than the cache:
    write it past the cache (a hint, the same bits; eager torch has no such stores)."""

    name: str

    def sub_sumsq(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, stream: bool = False) -> float: ...

    def copy(self, src: torch.Tensor, out: torch.Tensor, stream: bool = False) -> None: ...

    def max_abs(self, x: torch.Tensor) -> float: ...  # NaN if any NaN, 0.0 when empty

    def encode_f16(self, x: torch.Tensor, factor: float, half: torch.Tensor, scratch: torch.Tensor,
                   decoded: torch.Tensor | None = None, unit: float = 1.0, stats: Row = None,
                   stream: bool = False) -> None: ...

    def decode_f16(self, half: torch.Tensor, unit: float, out: torch.Tensor, stats: Row = None,
                   stream: bool = False) -> None: ...

    def add_f16(self, total: torch.Tensor, half: torch.Tensor, unit: float, first: bool, scratch: torch.Tensor,
                stats: Row = None) -> None: ...

    def add_f32(self, total: torch.Tensor, x: torch.Tensor, weight: float, first: bool, scratch: torch.Tensor,
                stats: Row = None) -> None: ...


class Eager:
    """torch, one op at a time: what each kernel means."""

    name = "eager"

    def sub_sumsq(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, stream: bool = False) -> float:
        """out = a - b chunk by chunk, each measured while it is still in cache (one host sync)."""
        acc = ChunkStats()
        for s in range(0, out.numel(), STATS_CHUNK):
            c = slice(s, s + STATS_CHUNK)
            acc.add(torch.sub(a[c], b[c], out=out[c]))
        return acc.result([out])[0]

    def copy(self, src: torch.Tensor, out: torch.Tensor, stream: bool = False) -> None:
        out.copy_(src)

    def max_abs(self, x: torch.Tensor) -> float:
        if not x.numel():
            return 0.0
        return float(torch.maximum(x.amin().neg_(), x.amax()))  # amin + amax vs one aminmax:
        # benchmarks/kernels.md, "max abs(x)"

    def encode_f16(self, x: torch.Tensor, factor: float, half: torch.Tensor, scratch: torch.Tensor,
                   decoded: torch.Tensor | None = None, unit: float = 1.0, stats: Row = None,
                   stream: bool = False) -> None:
        # fp32 product into scratch (fresh memory costs a page fault per 4 KB), then one rounding
        # (a direct fp16 `out=` is slower)
        half.copy_(torch.mul(x, factor, out=scratch[: x.numel()]))
        if decoded is not None or stats is not None:
            self.decode_f16(half, unit, scratch[: x.numel()] if decoded is None else decoded, stats)

    def decode_f16(self, half: torch.Tensor, unit: float, out: torch.Tensor, stats: Row = None,
                   stream: bool = False) -> None:
        values = out.copy_(half)
        if stats is not None:
            add_stats(stats, values, unit)
        if unit != 1.0:
            values.mul_(unit)

    def add_f16(self, total: torch.Tensor, half: torch.Tensor, unit: float, first: bool, scratch: torch.Tensor,
                stats: Row = None) -> None:
        values = scratch[: half.numel()].copy_(half)
        if stats is not None:
            add_stats(stats, values, unit)
        if unit < EXACT_UNIT:  # the product could lose bits: round it on its own, as decoding does
            values, unit = values.mul_(unit), 1.0
        accumulate(total, values, unit, first)

    def add_f32(self, total: torch.Tensor, x: torch.Tensor, weight: float, first: bool, scratch: torch.Tensor,
                stats: Row = None) -> None:
        values = x if weight == 1.0 else torch.mul(x, weight, out=scratch[: x.numel()])
        if stats is not None:
            add_stats(stats, values)
        accumulate(total, values, 1.0, first)


EAGER = Eager()


def _fits(*pairs: tuple[torch.Tensor | None, torch.dtype]) -> bool:
    """Whether the native kernels can take these: contiguous CPU tensors of the dtypes named (None: absent)."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()) for t, dtype in pairs)


F32, F16, F64 = torch.float32, torch.float16, torch.float64


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Native:
    """zeroband/comm/kernels.c through ctypes (which lets go of the GIL during each call). Inputs the
    library cannot take (GPU tensors, other dtypes, strided views) go to `Eager`."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, n, f, d, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int
        sig = {"zb_sub_sumsq": (d, [p, p, p, n, i, i]), "zb_copy": (None, [p, p, n, i, i]), "zb_max_abs": (f, [p, n, i]),
               "zb_encode_f16": (None, [p, n, f, p, p, d, p, i, i]), "zb_decode_f16": (None, [p, n, d, p, p, i, i]),
               "zb_add_f16": (None, [p, p, n, d, i, p, i]), "zb_add_f32": (None, [p, p, n, f, i, p, i])}  # each ends with its thread count
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.lib = lib
        self.threads = 1  # per call, at most (`set_threads`); one run on the calling thread at 1

    def sub_sumsq(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, stream: bool = False) -> float:
        if not _fits((a, F32), (b, F32), (out, F32)):
            return EAGER.sub_sumsq(a, b, out)
        return self.lib.zb_sub_sumsq(a.data_ptr(), b.data_ptr(), out.data_ptr(), out.numel(), stream, self.threads)

    def copy(self, src: torch.Tensor, out: torch.Tensor, stream: bool = False) -> None:
        if not _fits((src, F32), (out, F32)):
            return EAGER.copy(src, out)
        self.lib.zb_copy(src.data_ptr(), out.data_ptr(), out.numel(), stream, self.threads)

    def max_abs(self, x: torch.Tensor) -> float:
        if not _fits((x, F32)):
            return EAGER.max_abs(x)
        return self.lib.zb_max_abs(x.data_ptr(), x.numel(), self.threads)

    def encode_f16(self, x: torch.Tensor, factor: float, half: torch.Tensor, scratch: torch.Tensor,
                   decoded: torch.Tensor | None = None, unit: float = 1.0, stats: Row = None,
                   stream: bool = False) -> None:
        if not _fits((x, F32), (half, F16), (decoded, F32), (stats, F64)):
            return EAGER.encode_f16(x, factor, half, scratch, decoded, unit, stats)
        self.lib.zb_encode_f16(x.data_ptr(), x.numel(), factor, half.data_ptr(), _ptr(decoded), unit, _ptr(stats),
                               stream, self.threads)

    def decode_f16(self, half: torch.Tensor, unit: float, out: torch.Tensor, stats: Row = None,
                   stream: bool = False) -> None:
        if not _fits((half, F16), (out, F32), (stats, F64)):
            return EAGER.decode_f16(half, unit, out, stats)
        self.lib.zb_decode_f16(half.data_ptr(), half.numel(), unit, out.data_ptr(), _ptr(stats), stream, self.threads)

    def add_f16(self, total: torch.Tensor, half: torch.Tensor, unit: float, first: bool, scratch: torch.Tensor,
                stats: Row = None) -> None:
        if not _fits((total, F32), (half, F16), (stats, F64)):
            return EAGER.add_f16(total, half, unit, first, scratch, stats)
        self.lib.zb_add_f16(total.data_ptr(), half.data_ptr(), half.numel(), unit, int(first), _ptr(stats), self.threads)

    def add_f32(self, total: torch.Tensor, x: torch.Tensor, weight: float, first: bool, scratch: torch.Tensor,
                stats: Row = None) -> None:
        if not _fits((total, F32), (x, F32), (stats, F64)):
            return EAGER.add_f32(total, x, weight, first, scratch, stats)
        self.lib.zb_add_f32(total.data_ptr(), x.data_ptr(), x.numel(), weight, int(first), _ptr(stats), self.threads)


# ---------------------------------------------------------------------------------------------- loading
def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and _run([cc, "--version"]) is not None:
            return cc
    return None


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout + done.stderr if done.returncode == 0 else None


def _cpu() -> str:
    """What `-march=native` depends on: the machine and its CPU's feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}|{flags}"


def private_dir(path: Path) -> Path:
    """`path`, created if missing, owned by this user and writable by nobody else; else ValueError.
    A library is code: one loaded from a directory that others can write runs whatever they put there."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{path} is not private (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}): "
                         "set ZEROBAND_KERNEL_DIR to a directory only you can write")
    return path


def cache_dir() -> Path:
    if where := os.environ.get("ZEROBAND_KERNEL_DIR"):
        return private_dir(Path(where))
    try:
        return private_dir(Path.home() / ".cache" / "zeroband" / "kernels")
    except (OSError, ValueError):
        return private_dir(Path(tempfile.gettempdir()) / f"zeroband-kernels-{os.getuid()}")


def build(cc: str, directory: Path, arches: tuple[list[str], ...] = ARCH_FLAGS,
          source_path: Path | tuple[Path, ...] = SOURCE) -> Path:
    """The library for this source, compiler and CPU: built once (into a temporary file renamed into
    place, so processes building at once never load a half-written file), then reused. The first of
    `arches` that compiles wins. A tuple of sources is one translation unit, in that order: a later
    file (zeroband/outer/sgd.c) uses the earlier one's static helpers (`-include`)."""
    sources = source_path if isinstance(source_path, tuple) else (source_path,)
    version = _run([cc, "--version"]) or ""
    source = b"|".join(s.read_bytes() for s in sources)
    includes = [arg for s in sources[:-1] for arg in ("-include", str(s.resolve()))]
    for arch in arches:
        key = hashlib.sha256(b"|".join([source, version.encode(), " ".join(FLAGS + arch).encode(),
                                        _cpu().encode()])).hexdigest()[:20]
        lib = directory / f"zb_{sources[-1].stem}-{key}.so"
        if lib.exists():
            return lib
        # per process and thread: the simulator's sites are threads that may build at once
        tmp = directory / f".{lib.name}.{os.getpid()}.{threading.get_ident()}"
        if _run([cc, *FLAGS, *arch, *includes, "-o", str(tmp), str(sources[-1]), "-lm"]) is not None:
            os.replace(tmp, lib)
            return lib
        tmp.unlink(missing_ok=True)
    raise OSError(f"{cc} could not build {sources[-1].name}")


def open_library(lib: Path) -> ctypes.CDLL:
    """The library at `lib`, unless others can write it (a library is code)."""
    st = lib.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"{lib} is writable by others: not loaded")
    return ctypes.CDLL(str(lib))


def load(lib: Path) -> Native:
    return Native(open_library(lib))


def probe(n: int = 40_000) -> dict[str, torch.Tensor]:
    """Values that exercise every rounding case: normal, tiny, subnormal, signed zeros, fp16 ties and
    overflow, and lengths that leave vector tails."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.logspace(-30, 4, n).index_select(0, torch.randperm(n, generator=gen))
    x[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-24, 3 * 2.0**-25, 65519.0, -65520.0])
    y = torch.randn(n, generator=gen)
    y[:4] = torch.tensor([-0.0, 0.0, -1e-45, 5e-39])
    return {"x": x, "y": y}


def outputs(k: Kernels, x: torch.Tensor, y: torch.Tensor, half: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every value each kernel writes, from the same inputs (`x`, `y` fp32 and `half` fp16, one length);
    streamed outputs start off a vector boundary, so the aligning lead-in runs too."""
    n, scratch, unit = x.numel(), torch.empty(x.numel()), 2.0**-3
    out: dict[str, torch.Tensor] = {}
    for stream in (False, True):
        out[f"sub_sumsq {stream}"], out[f"copy {stream}"] = _off(n, stream), _off(n, stream)
        k.sub_sumsq(x, y, out[f"sub_sumsq {stream}"], stream)
        k.copy(x, out[f"copy {stream}"], stream)
    for weight in (1.0, 0.37, 2.0**-120):  # one, a general fp32, a product that underflows
        out[f"encode_f16 {weight}"], out[f"encode_f16 decoded {weight}"] = torch.empty(n, dtype=F16), _off(n, weight != 1)
        k.encode_f16(x, weight, out[f"encode_f16 {weight}"], scratch, out[f"encode_f16 decoded {weight}"], unit,
                     stream=weight != 1.0)
        out[f"add_f32 {weight}"] = y.clone()
        k.add_f32(out[f"add_f32 {weight}"], x, weight, False, scratch)
    for u in (unit, 2.0**-127, 1.0):  # an exact decode, one below EXACT_UNIT, none
        out[f"decode_f16 {u}"] = _off(n, u != 1.0)
        k.decode_f16(half, u, out[f"decode_f16 {u}"], stream=u != 1.0)
        for first in (True, False):
            out[f"add_f16 {u} {first}"] = y.clone()
            k.add_f16(out[f"add_f16 {u} {first}"], half, u, first, scratch)
    return out


def _off(n: int, shifted: bool) -> torch.Tensor:
    """n fp32 values, starting 12 bytes past an allocation's (aligned) start when `shifted`."""
    return torch.empty(n + 3)[3:] if shifted else torch.empty(n)


def streams(nbytes: int) -> bool:
    """Whether output of this size should bypass the cache: only when it cannot stay there anyway."""
    return nbytes > STREAM_BYTES


def check(native: Native, n: int = 40_000) -> str | None:
    """The first output where `native` writes other bits than `Eager` on the probe values (None: none)."""
    v = probe(n)
    for k in (n, n - 1, 5):  # whole vectors, a tail, a tail only
        x, y = v["x"][:k], v["y"][:k]
        half = (x * 2.0**-4).clamp(-65504, 65504).half()
        got, want = outputs(native, x, y, half), outputs(EAGER, x, y, half)
        for name, g in got.items():
            bits = torch.int32 if g.dtype == F32 else torch.int16
            if not torch.equal(g.view(bits), want[name].view(bits)):
                return f"{name} (length {k})"
    if native.max_abs(v["x"]) != EAGER.max_abs(v["x"]) or not math.isnan(native.max_abs(torch.tensor([1.0, math.nan] * 9))):
        return "max_abs"
    return None


def kernels() -> Kernels:
    """The kernels to use: `Native` if it builds and passes `check`, else `Eager` (one log line why);
    `Eager` while ZEROBAND_KERNELS=eager (read on every call: tests run both through it)."""
    return EAGER if os.environ.get("ZEROBAND_KERNELS", "auto") == "eager" else native_or_eager()


def set_threads(n: int) -> int:
    """Threads each native kernel call may split its values over from now on (the outer step's
    `diloco.outer_threads`); returns the previous count. The bits written do not depend on it.
    No-op while the eager kernels run (those use torch's own threads)."""
    k = kernels()
    if not isinstance(k, Native):
        return n
    before, k.threads = k.threads, max(1, n)
    return before


@functools.cache
def native_or_eager() -> Kernels:
    """Built, loaded and checked once per process."""
    try:
        cc = _compiler()
        if cc is None:
            raise OSError("no C compiler (cc, gcc, clang or $CC)")
        native = load(build(cc, cache_dir()))
        if (wrong := check(native)) is not None:
            raise ValueError(f"its {wrong} differs from torch's bits")
    except (OSError, ValueError) as e:
        log.warning("outer-step kernels: eager torch ops (slower, same bits): native kernels unavailable: %s", e)
        return EAGER
    return native
