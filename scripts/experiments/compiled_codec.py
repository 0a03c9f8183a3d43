#!/usr/bin/env python
"""How much would compiled kernels buy the outer step's fp16 codec? (docs/results/outer_step.md)

    python scripts/experiments/compiled_codec.py

On one 2 MB fp32 slice (the exchange's), one thread: the sender's encode + measure and the owner's
decode + norm + sum, eager as comm/dense.py and comm/direct.py run them, against the same arithmetic
compiled by Inductor (CPU) into one function each. Checks that the compiled values are bitwise the
eager ones and prints milliseconds per slice. An experiment: nothing in zeroband compiles these.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

N = 1 << 19  # values per slice: a 4 MB piece split between 2 sites
FACTOR, UNIT = 2.0**20, 2.0**-20


def per_slice_ms(fn: Callable[[], object], reps: int = 300) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, total = torch.randn(N, generator=gen) * 1e-3, torch.randn(N, generator=gen)
    scratch, wire, widened = torch.empty(N), torch.empty(N, dtype=torch.float16), torch.empty(N)

    def eager_encode() -> torch.Tensor:  # scale into scratch, round to fp16, widen and measure what went out
        wire.copy_(torch.mul(x, FACTOR, out=scratch))
        return torch.linalg.vector_norm(widened.copy_(wire))

    def eager_decode() -> torch.Tensor:  # widen, measure, add x unit into the total
        norm = torch.linalg.vector_norm(widened.copy_(wire))
        torch.add(total, widened, alpha=UNIT, out=total)
        return norm

    @torch.compile(dynamic=False)
    def encode(x: torch.Tensor, factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = (x * factor).to(torch.float16)
        return h, torch.sqrt((h.float() * h.float()).sum())

    @torch.compile(dynamic=False)
    def decode(total: torch.Tensor, h: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = h.float()
        return total + v * unit, torch.sqrt((v * v).sum())

    factor, unit = torch.tensor(FACTOR), torch.tensor(UNIT)
    t0 = time.perf_counter()
    h, _ = encode(x, factor)
    print(f"first compile: {time.perf_counter() - t0:.1f} s")
    eager_encode()
    print("encode bitwise the eager one:", torch.equal(h.view(torch.int16), wire.view(torch.int16)))
    summed, _ = decode(total, wire, unit)
    print("decode + sum bitwise the eager one:",
          torch.equal(summed.view(torch.int32), torch.add(total, wire.float(), alpha=UNIT).view(torch.int32)))
    for name, fn in (("eager encode + measure", eager_encode), ("compiled encode + measure", lambda: encode(x, factor)),
                     ("eager decode + norm + sum", eager_decode),
                     ("compiled decode + norm + sum (new output)", lambda: decode(total, wire, unit))):
        print(f"{name:42s} {per_slice_ms(fn):.3f} ms per slice")


if __name__ == "__main__":
    # No options; parsing still answers --help (and refuses typos) before minutes of compiling.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
