#!/usr/bin/env python
"""What an overlapped outer boundary (`diloco.overlap = true`) costs the training loop.

    flock /tmp/zeroband-bench.lock python scripts/experiments/overlap_boundary.py

2 sites x 1 rank forked on this host over loopback gloo, authenticated, fp16 wire; each drives
`DiLoCo` directly on 10 x Linear(3200, 3200) (102M fp32 parameters), one thread. Before each
boundary every site moves its parameters by a fixed random delta and sleeps `--gap` seconds (the
inner steps, during which the launched average arrives). Per boundary of site 0: the main thread's
wall seconds in `after_inner_step`, how long of it waited for the average, and the process's user
and system CPU seconds meanwhile (system time is mostly page faults of fresh memory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import run_forked  # noqa: E402


def site(args: argparse.Namespace) -> list[tuple[float, float, float, float]]:
    import torch

    from zeroband.config import DilocoConfig
    from zeroband.mesh import SECRET, fixed_global_group, init_topology, shutdown
    from zeroband.outer.diloco import DiLoCo
    from zeroband.world import World

    s = int(os.environ["ZEROBAND_SITE_RANK"])
    world = World(0, 1, 0, s, 2, torch.device("cpu"))
    topology = init_topology(world, os.environ["ZEROBAND_BENCH_STORE"], "overlap-boundary", 120, "gloo",
                             secret=b"overlap-boundary-secret")
    group = fixed_global_group(topology, "overlap-boundary", mark=SECRET)
    try:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = torch.nn.Sequential(*[torch.nn.Linear(3200, 3200, bias=False) for _ in range(args.layers)])
        params = [p.data for p in model.parameters()]
        gen = torch.Generator().manual_seed(1 + s)
        deltas = [torch.randn(p.shape, generator=gen).mul_(1e-3) for p in params]
        outer = DiLoCo(model, DilocoConfig(inner_steps=1, comm_dtype="fp16", overlap=True), topology, group=group)
        outer.start()
        outer.threads = 1
        rows = []
        for step in range(args.boundaries):
            torch._foreach_sub_(params, deltas)
            time.sleep(args.gap)
            c0, t0 = os.times(), time.perf_counter()
            stats = outer.after_inner_step(step + 1, sync_point=False)
            t1, c1 = time.perf_counter(), os.times()
            if stats is not None:
                rows.append((t1 - t0, stats.allreduce_s, c1.user - c0.user, c1.system - c0.system))
        outer.after_inner_step(args.boundaries + 1, sync_point=True)
        return rows
    finally:
        shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--boundaries", type=int, default=6)
    p.add_argument("--gap", type=float, default=1.5, help="seconds of 'inner steps' before each boundary")
    args = p.parse_args()
    rows = run_forked(site, 2, 1, (args,), env={"OMP_NUM_THREADS": "1"}, timeout=600)[(0, 0)]
    print("| boundary | wall s | waited s | user s | system s |\n|---:|---:|---:|---:|---:|")
    for i, row in enumerate(rows, start=2):
        print(f"| {i} | " + " | ".join(f"{v:.2f}" for v in row) + " |")


if __name__ == "__main__":
    main()
