"""Compressed pseudo-gradient all-reduce (int8, NF4 4-bit) against fp16 dense, on loopback gloo.

    python scripts/bench_quantized.py                 # 16.8M params, S = 2 and 4 (a few minutes)
    python scripts/bench_quantized.py --params 4e6    # smaller payload

For each site count S, S forked processes form one global group (one site each, as rank i of
every site does in training). Each site holds its own fp32 payload (Gaussian x 1e-3, or heavy
tailed: Student t with 3 dof), all sites average it with weight 1/S, and we record:
- bytes/param: bytes this site sent, counted from the buffers handed to gloo (quantised); for
  fp16 the payload x 2(S-1)/S that a ring all-reduce sends (gloo picks its own algorithm);
- seconds: the slowest site's wall time of the call after a barrier, fastest of --repeats runs;
- rel. error: ||result - exact fp64 mean|| / ||exact mean||, computed on site 0;
- identical: whether every site's result has the same crc32.
Loopback has no bandwidth limit, so seconds measure CPU cost (encode/decode), not WAN time.
A local section compares 4-bit codebooks and what a ring that re-quantises partial sums would lose.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import add_out_argument, markdown_table, output_dir, run_forked, thread_env, write_outputs  # noqa: E402

from zeroband.comm import codecs  # noqa: E402
from zeroband.comm.dense import all_reduce_dense  # noqa: E402
from zeroband.comm.direct import chunk_bounds  # noqa: E402
from zeroband.comm.quantized import DEFAULT_BLOCK, Codec, all_reduce_quantized  # noqa: E402

METHODS = ["fp16", "int8", "int4"]
KINDS = ["gauss", "heavy"]


def shapes_for(params: int) -> list[tuple[int, ...]]:
    """A model-like mix: big matrices, a few vectors, and one odd-sized tensor."""
    side = 2048
    mats = max(1, params // (side * side))
    rest = max(1, params - mats * side * side - 8 * side)
    return [(side, side)] * mats + [(side,)] * 8 + [(rest,)]


def site_payload(kind: str, site: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * KINDS.index(kind) + site)
    out = []
    for shape in shapes:
        x = torch.randn(shape, generator=g).mul_(1e-3)
        if kind == "heavy":  # Student t, 3 dof: Gaussian over sqrt(chi2_3 / 3)
            chi2 = sum(torch.randn(shape, generator=g).square_() for _ in range(3)) / 3
            x.div_(chi2.sqrt_())
        out.append(x)
    return out


def exact_mean(kind: str, sites: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    total = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for s in range(sites):
        for t, x in zip(total, site_payload(kind, s, shapes)):
            t.add_(x.double())
    return [t.div_(sites) for t in total]


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = sum(float((g.double() - r).square().sum()) for g, r in zip(got, ref))
    return (num / sum(float(r.square().sum()) for r in ref)) ** 0.5


def _reduce(method: str, tensors: list[torch.Tensor], group: Any, weight: float) -> int:
    if method == "fp16":
        return all_reduce_dense(tensors, group, "fp16", weight)
    return all_reduce_quantized(tensors, group, 8 if method == "int8" else 4, weight)


def _site(shapes: list[tuple[int, ...]], repeats: int) -> list[dict]:
    """One site: every (kind, method) once; site 0 also measures the error."""
    from zeroband.comm.group import new_global_group
    from zeroband.store.client import open_store

    site, sites = int(os.environ["ZEROBAND_SITE_RANK"]), int(os.environ["ZEROBAND_SITE_COUNT"])
    timeout = timedelta(seconds=300)
    store = open_store(os.environ["ZEROBAND_BENCH_STORE"], site == 0, timeout)
    group = new_global_group(store, "bench/", site, sites, timeout)
    barrier = torch.zeros(1)
    rows = []
    for kind in KINDS:
        x = site_payload(kind, site, shapes)
        ref = exact_mean(kind, sites, shapes) if site == 0 else None
        for method in METHODS:
            seconds = float("inf")
            for _ in range(repeats):  # the fastest repeat: loopback timings are noisy on a shared box
                t = [v.clone() for v in x]
                group.all_reduce(barrier)
                t0 = time.perf_counter()
                sent = _reduce(method, t, group, 1.0 / sites)
                seconds = min(seconds, time.perf_counter() - t0)
            crc = 0
            for v in t:
                crc = zlib.crc32(v.numpy().tobytes(), crc)
            err = rel_err(t, ref) if ref is not None else None
            rows.append({"kind": kind, "method": method, "sent": sent, "seconds": seconds, "crc": crc, "err": err})
    return rows


def distributed(sites: int, shapes: list[tuple[int, ...]], repeats: int) -> list[dict]:
    out = run_forked(_site, sites, 1, (shapes, repeats), env=thread_env(sites), timeout=1800)
    params = sum(torch.Size(s).numel() for s in shapes)
    results = []
    for i, row in enumerate(out[(0, 0)]):
        per_site = [out[(s, 0)][i] for s in range(sites)]
        results.append({
            "sites": sites, "kind": row["kind"], "method": row["method"], "params": params,
            "bytes_per_param": max(r["sent"] for r in per_site) / params,
            "ideal_bytes_per_param": codecs.spec(row["method"]).wire_factor(sites) * codecs.spec(row["method"]).bytes_per_param(),
            "seconds": max(r["seconds"] for r in per_site),
            "rel_error": row["err"],
            "identical": len({r["crc"] for r in per_site}) == 1,
        })
    return results


def ring_requantised(xs: list[torch.Tensor], codec: Codec) -> torch.Tensor:
    """What a ring reduce-scatter that re-quantises the partial sum at every hop delivers (local model)."""
    sites, n = len(xs), xs[0].numel()
    out = torch.empty(n)
    for c, (lo, hi) in enumerate(chunk_bounds(n, sites, codec.block)):
        partial = xs[(c + 1) % sites][lo:hi].clone()
        for hop in range(2, sites + 1):  # the chunk travels c+1 -> c+2 -> ... -> c, its owner
            partial = codec.decode(codec.encode(partial), hi - lo) + xs[(c + hop) % sites][lo:hi]
        out[lo:hi] = codec.decode(codec.encode(partial), hi - lo)  # the all-gather copy
    return out


def direct(xs: list[torch.Tensor], codec: Codec) -> torch.Tensor:
    """This module's schedule: peers' slices quantised once, owner's exact, sum quantised once."""
    n, out = xs[0].numel(), torch.empty(xs[0].numel())
    for c, (lo, hi) in enumerate(chunk_bounds(n, len(xs), codec.block)):
        total = sum(x[lo:hi] if s == c else codec.decode(codec.encode(x[lo:hi]), hi - lo) for s, x in enumerate(xs))
        out[lo:hi] = codec.decode(codec.encode(total), hi - lo)
    return out


def local_study(n: int = 2_000_000, sites: int = 4) -> list[dict]:
    rows = []
    for kind in KINDS:
        xs = [site_payload(kind, s, [(n,)])[0] / sites for s in range(sites)]
        exact = sum(x.double() for x in xs)
        # the shipped block sizes, and twice them for int8 and NF4 (why the smaller ones: comm/quantized.py)
        for bits, book, block in [(8, "nf4", DEFAULT_BLOCK[8]), (8, "nf4", 2 * DEFAULT_BLOCK[8]),
                                  (4, "nf4", DEFAULT_BLOCK[4]), (4, "nf4", 2 * DEFAULT_BLOCK[4]),
                                  (4, "int4", DEFAULT_BLOCK[4]), (4, "fp4", DEFAULT_BLOCK[4])]:
            codec = Codec(bits, block, book)
            one = codec.decode(codec.encode(xs[0]), n)
            rows.append({
                "kind": kind, "codec": "int8" if bits == 8 else book, "block": codec.block, "values": n,
                "one_pass_error": rel_err([one], [xs[0].double()]),
                "direct_allreduce_error": rel_err([direct(xs, codec)], [exact]),
                "ring_requantised_error": rel_err([ring_requantised(xs, codec)], [exact]),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=16.8e6)
    parser.add_argument("--sites", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    add_out_argument(parser, "benchmarks", "quantized.{json,md}")
    parser.add_argument("--quick", action="store_true", help="200k params, S = 2, 1 repeat (smoke test)")
    args = parser.parse_args()
    args.out = output_dir(args.out, "quantized", args.quick)
    if args.quick:
        args.params, args.sites, args.repeats = 2e5, [2], 1
    shapes = shapes_for(int(args.params))
    results = [r for s in args.sites for r in distributed(s, shapes, args.repeats)]
    study = local_study(n=50_000 if args.quick else 2_000_000)
    headers = ["S", "data", "wire", "bytes/param", "ideal", "seconds", "rel. error", "identical"]
    rows = [[r["sites"], r["kind"], r["method"], r["bytes_per_param"], r["ideal_bytes_per_param"], r["seconds"],
             r["rel_error"], r["identical"]] for r in results]
    study_rows = [[r["kind"], r["codec"], r["block"], r["one_pass_error"], r["direct_allreduce_error"],
                   r["ring_requantised_error"]] for r in study]
    md = "\n\n".join([
        f"# Quantised all-reduce, {results[0]['params']:,} fp32 params per site, loopback gloo\n\n"
        f"Command: `python scripts/bench_quantized.py {' '.join(sys.argv[1:])}`. fp16 bytes are the ring estimate 2(S-1)/S x payload; "
        "int8/int4 bytes are counted from the buffers sent. Seconds are CPU cost on loopback.",
        markdown_table(headers, rows),
        f"## Codecs and schedules (local model, S = 4, {study[0]['values']:,} values)",
        markdown_table(["data", "codec", "block", "one pass", "direct all-reduce", "ring re-quantising"], study_rows),
    ])
    write_outputs(args.out, "quantized", {"allreduce": results, "local_study": study}, md)


if __name__ == "__main__":
    main()
