"""The small speed choices inside the wire codecs and the outer step, each against what it replaced.

    python scripts/bench_kernels.py --out benchmarks     # ~30 s on one core

Each row times one operation on --values fp32 values (Gaussian x 1e-3) on one torch thread, the
median of --repeats runs after a warm-up, and names the code comment it stands behind:
- nearest level: comm/quantized.py `_Nearest` (a 512-bin table and one compare) vs torch.bucketize
  on the codebook's midpoints (NF4);
- max abs(x): comm/kernels.py's torch fallback, amin + amax vs one aminmax;
- finite check: comm/direct.py `all_finite` (one sum) vs torch.isfinite(x).all();
- sum of squares: comm/kernels.py `ChunkStats` (fp32 norms per chunk, summed in fp64) vs one fp64 sum.
(Fresh memory against reused scratch, and the fp16 decode's product against a division, are not
here: docs/results/outer_step.md measured them inside the exchange, where they matter; a loop of
one size gets its block back from malloc without page faults.)
And two costs of the trust layer, on their own: one scrypt key derivation (trust/secret.py
`derive_key`: what each offline guess at the secret costs) and the keyed replica digest
(trust/mac.py `replica_digest`, HMAC-SHA256 over the tensors' bytes) in GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import add_out_argument, cpu_name, markdown_table, output_dir, write_outputs  # noqa: E402

from zeroband.comm.direct import all_finite  # noqa: E402
from zeroband.comm.kernels import STATS_CHUNK, ChunkStats  # noqa: E402
from zeroband.comm.quantized import _NEAREST, CODEBOOKS  # noqa: E402


def seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunk_sumsq(x: torch.Tensor) -> float:
    acc = ChunkStats()
    for s in range(0, x.numel(), STATS_CHUNK):
        acc.add(x[s:s + STATS_CHUNK])
    return acc.result([x])[0]


def rows(n: int, repeats: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).mul_(1e-3)
    y = (x / x.abs().max()).clamp_(-1, 1)  # a block's values over its absmax, as the codec quantises them
    levels = torch.tensor(CODEBOOKS["nf4"])
    mid = (levels[1:] + levels[:-1]) / 2
    cases = [
        ("nearest NF4 level", "comm/quantized.py _Nearest", lambda: _NEAREST["nf4"](y),
         "torch.bucketize on the midpoints", lambda: torch.bucketize(y, mid)),
        ("max abs(x)", "comm/kernels.py max_abs (torch)", lambda: torch.maximum(x.amin().neg_(), x.amax()),
         "one aminmax", lambda: torch.aminmax(x)),
        ("finite check", "comm/direct.py all_finite (one sum)", lambda: all_finite(x),
         "torch.isfinite(x).all()", lambda: bool(torch.isfinite(x).all())),
        ("sum of squares", "comm/kernels.py ChunkStats (fp32 per chunk)", lambda: chunk_sumsq(x),
         "one fp64 sum", lambda: float(x.double().square().sum())),
    ]
    found = []
    for what, ours, fn, theirs, other in cases:
        a, b = seconds(fn, repeats), seconds(other, repeats)
        found.append({"operation": what, "ours": ours, "ours_s": a, "instead": theirs, "instead_s": b, "speedup": b / a})
        print(found[-1], flush=True)
    return found


def trust_costs(n: int, repeats: int) -> dict[str, float]:
    from zeroband.trust.mac import replica_digest
    from zeroband.trust.secret import derive_key

    x = torch.randn(n)
    digest_s = seconds(lambda: replica_digest([x], bytes(32)), repeats)
    return {"scrypt_s": seconds(lambda: derive_key(b"a-secret-of-32-bytes-for-timing!", "bench"), repeats),
            "digest_gb_s": 4 * n / digest_s / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", type=int, default=4_000_000)
    p.add_argument("--repeats", type=int, default=7)
    add_out_argument(p, "benchmarks", "kernels.{json,md}")
    args = p.parse_args()
    out = output_dir(args.out, "kernels")
    torch.set_num_threads(1)
    found = rows(args.values, args.repeats)
    costs = trust_costs(args.values, args.repeats)
    md = "\n\n".join([
        "# Speed choices in the codecs and the outer step", "```bash\npython scripts/bench_kernels.py "
        + " ".join(sys.argv[1:]) + "\n```",
        f"Machine: {cpu_name()}, torch {torch.__version__}, 1 thread, {args.values:,} fp32 values, median of "
        f"{args.repeats}. What each row compares: the docstring of scripts/bench_kernels.py.",
        markdown_table(["operation", "ours", "ms", "instead", "ms", "x faster"],
                       [[r["operation"], r["ours"], 1e3 * r["ours_s"], r["instead"], 1e3 * r["instead_s"],
                         r["speedup"]] for r in found]),
        "## Trust layer costs",
        markdown_table(["scrypt key derivation (one guess at the secret), ms", "keyed replica digest, GB/s"],
                       [[1e3 * costs["scrypt_s"], costs["digest_gb_s"]]]),
    ])
    write_outputs(out, "kernels", {"values": args.values, "repeats": args.repeats, "rows": found, **costs}, md)


if __name__ == "__main__":
    main()
