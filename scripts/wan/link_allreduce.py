#!/usr/bin/env python
"""One site of a cross-site all-reduce over zeroband's transport, as a DiLoCo outer step runs it.

Run inside a WAN emulator namespace (`WanEmulator.wrap`), one process per site:

    python scripts/wan/link_allreduce.py SITE STORE_HOST PORT --streams auto --numel 100000000 --rounds 3

The global group is built as a run builds it (`new_global_group` with the [sites] link policy:
the probe at connect, streams "auto" or given, waits bounded by the measured link), then `rounds`
all-reduces of `numel` fp32 values go through `reduce_across_sites` (the wire format, the
statistics and the review of a real outer step). Prints one JSON line per round
({"round", "seconds", "wire_bytes", "payload_bytes", "wait_bound_s"}) and last {"link": [...]}:
the group's `link` records. Used by scripts/bench_wan.py --streams and the slow-link test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from functools import partial
from typing import Any

import torch

from zeroband.comm.group import new_global_group
from zeroband.comm.link import LinkPolicy
from zeroband.comm.reduce import SiteStats, reduce_across_sites
from zeroband.store.client import open_store
from zeroband.watchdog import Watch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("site", type=int)
    p.add_argument("host", help="site 0's address (it hosts the store)")
    p.add_argument("port", type=int)
    p.add_argument("--streams", default="auto", help='"auto" or a number (sites.streams)')
    p.add_argument("--numel", type=int, default=1_000_000, help="fp32 values of the pseudo-gradient")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--wire", default="fp16", help="diloco.comm_dtype")
    p.add_argument("--idle-s", type=float, default=0.0,
                   help="seconds the link idles before each round (the inner steps between outer steps)")
    p.add_argument("--piece-mb", type=float, default=4.0, help="diloco.piece_mb")
    p.add_argument("--probe-s", type=float, default=3.0, help="sites.probe_s")
    p.add_argument("--floor-s", type=float, default=10.0, help="sites.timeout_floor_s")
    p.add_argument("--factor", type=float, default=3.0, help="sites.wait_factor")
    p.add_argument("--timeout-s", type=float, default=600.0, help="sites.timeout_s")
    args = p.parse_args(argv)
    streams = args.streams if args.streams == "auto" else int(args.streams)
    timeout = timedelta(seconds=args.timeout_s)
    store = open_store(f"tcp://{args.host}:{args.port}", args.site == 0, timeout)
    policy = LinkPolicy(streams, args.probe_s, args.factor, args.floor_s)
    group = new_global_group(store, "link-allreduce/", args.site, 2, timeout, watch=Watch(args.timeout_s),
                             policy=policy)
    values = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.site))
    for k in range(args.rounds):
        if args.idle_s:
            group.gather_scalars([0.0])  # both sites start the idle period together
            time.sleep(args.idle_s)
        step = partial(reduce_across_sites, [values.clone()], SiteStats(1.0, 0.0), group, args.wire,
                       int(args.piece_mb * (1 << 20)))
        t0 = time.perf_counter()
        result = group.watched(step, "outer all-reduce")
        print(json.dumps({"round": k, "seconds": time.perf_counter() - t0, "wire_bytes": result.wire_bytes,
                          "payload_bytes": result.payload_bytes, "wait_bound_s": result.wait_bound_s}), flush=True)
    print(json.dumps({"link": group.link_records()}), flush=True)


def run_pair(wan: Any, args: list[str], timeout_s: float, port: int = 29511) -> list[list[dict[str, Any]]]:
    """Both sites of `wan` (a zeroband.wan.WanEmulator) run this script with `args`; each site's JSON
    lines. Raises RuntimeError with the site's output when one fails."""
    procs = [subprocess.Popen(wan.wrap(i, [sys.executable, __file__, str(i), wan.site_ip(0), str(port), *args]),
                              env={**os.environ, **wan.env(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"link_allreduce {args}: exit codes {[p.returncode for p in procs]}\n" + "\n".join(outs))
    return [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs]


if __name__ == "__main__":
    main()
