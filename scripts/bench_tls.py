#!/usr/bin/env python
"""Two checkouts side by side: the outer step and a WAN all-reduce, alternating A and B in one run.

    flock /tmp/zeroband-bench.lock python scripts/bench_tls.py --a /work/main --b . --out benchmarks  # ~30 min, root

Made for issue 35 item 1 (TLS 1.3 on the cross-site transport): A is the code before, B after, and
the machine is shared, so only ratios measured side by side mean anything. Per repetition, in the
order A, B (then B, A on the next, so neither always runs second):
- `step`: `scripts/bench_step.py --threads 1 --repeats 3` of that checkout (102M fp32 parameters,
  2 sites x 1 rank forked on this host over loopback, fp16 wire, a shared secret): the median
  outer step and its network wait, site 0;
- `wan`: an all-reduce of `--numel` fp32 values as fp16 on the wire (300 MB at the default) between
  2 sites in the WAN emulator (zeroband/wan/emulator.py, `--rate-mbit` per uplink, `--delay-ms` each
  way, MTU 9000), with a shared secret and admission as a run has them, `--rounds` rounds after one
  warm-up; per round the faster site's seconds (both enter together).
Writes tls.{json,md} to `--out`: every measurement, and per metric the mean and spread of A, of B,
and of the ratios B / A of neighbouring runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import load_average, load_note, markdown_table, output_dir, write_outputs  # noqa: E402

SECRET = "bench-tls-shared-secret-0123456789"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, required=True, help="checkout A (before)")
    p.add_argument("--b", type=Path, required=True, help="checkout B (after)")
    p.add_argument("--what", default="step,wan", help="comma separated: step, wan")
    p.add_argument("--repeats", type=int, default=3, help="A/B pairs per benchmark")
    p.add_argument("--numel", type=int, default=150_000_000, help="wan: fp32 values (fp16 wire: 2 bytes each)")
    p.add_argument("--rate-mbit", type=float, default=500.0)
    p.add_argument("--delay-ms", type=float, default=100.0, help="one way")
    p.add_argument("--rounds", type=int, default=3, help="wan: timed rounds after one warm-up")
    p.add_argument("--out", type=Path, default=None, help="directory for tls.{json,md} (default: a new temporary one)")
    p.add_argument("--site", type=int, default=None, help=argparse.SUPPRESS)  # internal: one wan site
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.out = output_dir(a.out, "tls", False)
    return a


def step_once(tree: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, str(tree / "scripts/bench_step.py"), "--threads", "1", "--repeats", "3",
                        "--out", out], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                       stdout=subprocess.DEVNULL)
        row = json.loads((Path(out) / "step.json").read_text())["rows"][0]
    return {"outer_step_s": row["outer_step_s"], "network_wait_s": row["parts"]["network_wait"], "mac_s": row["parts"]["mac"]}


def wan_site(args: argparse.Namespace) -> None:
    """One site of the wan benchmark, inside its namespace, with the checkout on PYTHONPATH."""
    import torch

    from zeroband.comm.group import new_global_group
    from zeroband.comm.link import LinkPolicy
    from zeroband.comm.reduce import SiteStats, reduce_across_sites
    from zeroband.membership.base import admit_group
    from zeroband.store.client import open_store
    from zeroband.trust.mac import WireAuth
    from zeroband.watchdog import Watch

    timeout = timedelta(seconds=600)
    store = open_store(args.store, args.site == 0, timeout)
    secret = SECRET.encode()
    group = new_global_group(store, "bench-tls/", args.site, 2, timeout, watch=Watch(600),
                             auth=WireAuth.from_secret(secret, "bench-tls"), policy=LinkPolicy("auto", 3.0))
    admit_group(group, store, secret, {}, 600)
    values = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.site))
    for k in range(args.rounds + 1):
        group.gather_scalars([0.0])  # both sites enter together
        t0 = time.perf_counter()
        reduce_across_sites([values.clone()], SiteStats(1.0, 0.0), group, "fp16", 4 << 20)
        print(json.dumps({"round": k, "seconds": time.perf_counter() - t0}), flush=True)
    group.gather_scalars([0.0])


def wan_once(args: argparse.Namespace, tree: Path) -> dict[str, float]:
    from zeroband.wan import WanEmulator

    with WanEmulator(2, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms, mtu=9000, backend="tun") as wan:
        cmd = [sys.executable, __file__, "--a", str(args.a), "--b", str(args.b), "--numel", str(args.numel),
               "--rounds", str(args.rounds), "--store", f"tcp://{wan.site_ip(0)}:29517"]
        procs = [subprocess.Popen(wan.wrap(i, [*cmd, "--site", str(i)]), cwd=tree, text=True,
                                  env={**os.environ, **wan.env(i), "PYTHONPATH": str(tree)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
        outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(outs))
    per_site = [[json.loads(line)["seconds"] for line in out.splitlines() if line.startswith("{")] for out in outs]
    rounds = [min(site[k] for site in per_site) for k in range(1, args.rounds + 1)]
    return {"allreduce_s": statistics.fmean(rounds), "allreduce_best_s": min(rounds)}


def spread(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    return {"mean": mean, "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric: A's and B's spread, and the ratio B / A of each repetition's pair."""
    out: dict[str, Any] = {}
    for metric in [m for m in runs[0] if m not in ("side", "rep", "load")]:
        a = [r[metric] for r in runs if r["side"] == "A"]
        b = [r[metric] for r in runs if r["side"] == "B"]
        ratios = [y / x for x, y in zip(a, b) if x]
        out[metric] = {"A": spread(a), "B": spread(b), "B/A": spread(ratios) if ratios else None}
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.site is not None:
        return wan_site(args)
    results: dict[str, Any] = {"command": " ".join(["python", "scripts/bench_tls.py", *(argv or sys.argv[1:])]),
                               "a": str(args.a.resolve()), "b": str(args.b.resolve()), "load_start": load_average(),
                               "runs": {}, "summary": {}}
    for what in args.what.split(","):
        runs = []
        for rep in range(args.repeats):
            for side in ("AB" if rep % 2 == 0 else "BA"):
                tree = (args.a if side == "A" else args.b).resolve()
                load = load_average()
                row = step_once(tree) if what == "step" else wan_once(args, tree)
                runs.append({"side": side, "rep": rep, "load": load, **row})
                print(f"{what} {side} rep {rep}: {row} (load {load:.1f})", flush=True)
        results["runs"][what], results["summary"][what] = runs, summarize(runs)
    results["load_end"] = load_average()
    rows = [[what, metric, f"{s['A']['mean']:.3f} ± {s['A']['stdev']:.3f}", f"{s['B']['mean']:.3f} ± {s['B']['stdev']:.3f}",
             f"{s['B/A']['mean']:.3f} ({s['B/A']['min']:.3f}-{s['B/A']['max']:.3f})"]
            for what, summary in results["summary"].items() for metric, s in summary.items()]
    md = "\n".join([
        "## TLS 1.3 on the cross-site transport: before (A) and after (B), side by side", "",
        f"`{results['command']}`: A = {results['a']}, B = {results['b']}; {args.repeats} A/B pairs per benchmark, "
        "alternating which runs first. step: scripts/bench_step.py --threads 1 --repeats 3 (102M fp32 parameters, "
        "2 sites x 1 rank on loopback, fp16 wire, a shared secret; median of 3 outer steps, site 0). wan: "
        f"{args.numel:,} fp32 values as fp16 ({2 * args.numel / 1e6:.0f} MB) all-reduced between 2 emulated sites at "
        f"{args.rate_mbit:g} Mbit/s, {2 * args.delay_ms:g} ms RTT, with a secret (mean of {args.rounds} rounds after a "
        "warm-up, the faster site's seconds). Seconds: mean ± standard deviation over the runs; B/A: mean (min-max) of "
        "each pair's ratio.", "",
        markdown_table(["benchmark", "metric", "A s", "B s", "B / A"], rows), "",
        load_note(results["load_start"], results["load_end"]), ""])
    write_outputs(args.out, "tls", results, md)
    return None


if __name__ == "__main__":
    main()
