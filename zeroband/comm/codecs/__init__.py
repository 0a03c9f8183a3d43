"""The wire codecs of the pseudo-gradient all-reduce, by name: one file in this folder per codec.

A file `NAME.py` here is the codec `diloco.comm_dtype = "NAME"`: it defines `CODEC`, a `CodecSpec`
that says how to build the codec for a run's settings (`build`: what `encode` / `decode` do with a
chunk, comm/direct.py's `WireCodec` shape), whether it carries error feedback (`feedback`), and
which exchange carries it (`exchange`). Its bytes per parameter are asked of the codec it builds, so
the planner (`zeroband plan`) and the benchmark scripts never keep a table of their own. The config
(zeroband/config.py, a layer below comm) validates `comm_dtype` against the file names here
(`names`), without importing any codec. Adding a codec is adding a file (CONTRIBUTING.md).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from zeroband.comm.direct import WireCodec
from zeroband.config import DilocoConfig, codec_names

Feedback = Literal["optional", "always"]
# "direct": reduce-scatter + all-gather, each owner re-encoding its sum (comm/direct.py): for codecs
# whose sums encode as well as their inputs. "gather": every site's encoded contribution goes to every
# site and each site sums them all, in site order (comm/gather.py): for codecs whose sums would not
# re-encode without losing what they carry (a sparse sum has the union of its inputs' indices).
Exchange = Literal["direct", "gather"]
PLAN_VALUES = 1 << 24  # bytes per parameter: measured on this many values (a multiple of every block)


@dataclass(frozen=True)
class CodecSpec:
    name: str
    build: Callable[[Any], WireCodec]  # (the run's [diloco], or anything with its codec fields) -> codec
    about: str
    feedback: Feedback = "optional"  # "always": error feedback is on whatever diloco.error_feedback says
    exchange: Exchange = "direct"

    def codec(self, settings: Any = None) -> WireCodec:
        """The codec for `settings` (None: DilocoConfig's defaults)."""
        codec: WireCodec = self.build(DilocoConfig() if settings is None else settings)
        return codec

    def bytes_per_param(self, settings: Any = None) -> float:
        """Payload bytes per parameter on the wire (every scale, index and code; not the per-message
        header, which one message of many megabytes amortises)."""
        codec = self.codec(settings)
        return (codec.nbytes(PLAN_VALUES) - codec.header) / PLAN_VALUES

    def wire_factor(self, sites: int) -> float:
        """Bytes one site sends per byte of its payload: 2(S-1)/S for "direct" (the same as a ring),
        S-1 for "gather" (its contribution to every peer)."""
        return 2 * (sites - 1) / sites if self.exchange == "direct" else float(sites - 1)


def names() -> list[str]:
    """Every codec's name: the files of this folder, as the config reads them (no import)."""
    return codec_names()


@functools.cache
def registry() -> dict[str, CodecSpec]:
    """Every codec, by name, from its file's `CODEC`."""
    out = {}
    for name in names():
        spec = importlib.import_module(f"{__name__}.{name}").CODEC
        if not isinstance(spec, CodecSpec) or spec.name != name:
            raise TypeError(f"zeroband/comm/codecs/{name}.py must define CODEC = CodecSpec(name={name!r}, ...)")
        out[name] = spec
    return out


def spec(name: str) -> CodecSpec:
    """The codec called `name`; ValueError naming the choices else."""
    if name not in names():
        raise ValueError(f"unknown wire codec {name!r}: choose one of {', '.join(names())}")
    return registry()[name]
