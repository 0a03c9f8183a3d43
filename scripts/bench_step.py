#!/usr/bin/env python
"""Where the time of one step goes: DiLoCo's outer step by part, against one fused pass over the parameters.

    flock /tmp/zeroband-bench.lock python scripts/bench_step.py --out benchmarks  # 102M params, ~1-2 min
    python scripts/bench_step.py --quick                                  # tiny preset (CI smoke test)
    python scripts/bench_step.py --inner --out benchmarks                 # CUDA only: inner step vs a plain loop
    python scripts/bench_step.py --inner --quick                          # its plumbing on the CPU (CI smoke test)
    python scripts/bench_step.py --device cuda --width 10000 --threads 1,8  # the outer step of a 1B model on a GPU

Outer step: 2 sites x 1 rank on this host, two forked processes over loopback gloo, each
driving `DiLoCo` directly (no trainer) on `--layers` x Linear(`--width`, `--width`) (default
10 x 3200^2 = 102M fp32 parameters), fp16 wire, a shared secret (every message authenticated).
The model lives on `--device` (cpu, or cuda: both sites share GPU 0) and the fp32 outer copy where
`--outer-device` puts it (diloco.outer_device).
Before each blocking outer step every site moves its parameters by its own fixed random delta.
For each thread count in `--threads` (torch threads of the outer step; 1 is the acceptance case):
one warm-up step, then `--repeats` steps; per step the parts of OuterStats.timings (device->host,
pseudo-gradient, statistics, encode, MAC, network wait, decode, review, outer optimizer,
host->device) and the whole step. In the same process, with the same threads: the fastest of 3
`torch._foreach_add_(params, others)`, one read-modify-write pass over all parameters. Reported
per thread count (median over the repeats, site 0): whole step, network wait, local work (= whole
step - network wait) and local work / fused pass.

Inner step (`--inner`, CUDA only): the trainer's model and step (bf16, torch.compile) against a
plain compiled loop over transformers' LlamaForCausalLM with the same shapes; tokens/s, MFU, peak
memory, for the 150M and 1B presets.

Writes step.{json,md} (outer) or inner_step.{json,md} (inner) to `--out` (default: a new temporary
directory; `--out benchmarks` updates the committed results, which `--quick` never does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    CORES,
    add_out_argument,
    load_average,
    load_note,
    markdown_table,
    output_dir,
    run_forked,
    write_outputs,
)

PARTS = ("d2h", "pseudo_grad", "stats", "encode", "mac", "network_wait", "decode", "review", "optimizer", "h2d")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 x Linear(256, 256), 1 repeat (CI smoke test)")
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 10; 4 with --quick)")
    p.add_argument("--width", type=int, default=None, help="Linear width (default 3200; 256 with --quick)")
    p.add_argument("--threads", default=None, help=f"outer-step thread counts, comma separated (default 1,{CORES})")
    p.add_argument("--repeats", type=int, default=None, help="timed outer steps per thread count (default 3)")
    p.add_argument("--wire", default="fp16", choices=("fp32", "bf16", "fp16", "int8", "int4"))
    p.add_argument("--piece-mb", type=float, default=4.0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model lives")
    p.add_argument("--outer-device", default="auto", choices=("auto", "cpu", "cuda"), help="diloco.outer_device")
    p.add_argument("--retry", action="store_true",
                   help="rounds may be retried, as under elastic membership (the exchange keeps a copy of its inputs)")
    p.add_argument("--inner", action="store_true", help="CUDA: trainer's inner step vs a plain compiled loop")
    p.add_argument("--profile", action="store_true", help="--inner: also write each loop's top ops (torch.profiler)")
    p.add_argument("--peak-tflops", type=float, default=None, help="--inner: the GPU's dense bf16 peak (MFU)")
    add_out_argument(p, "benchmarks", "step.{json,md} / inner_step.{json,md}")
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    a.out = output_dir(a.out, "inner_step" if a.inner else "step", a.quick)
    a.layers = a.layers or (4 if a.quick else 10)
    a.width = a.width or (256 if a.quick else 3200)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.threads = [int(t) for t in (a.threads or f"1,{CORES}").split(",") if t]
    if min(a.layers, a.width, a.repeats, *a.threads) < 1:
        p.error("--layers, --width, --repeats and --threads must be >= 1")
    return a


# ---------------------------------------------------------------------------------- one site (forked)


def fused_pass_s(params: list[Any], others: list[Any], sync: Any = None) -> float:
    """Fastest of 3 read-modify-write passes over all parameters (the memory-bound floor). `sync()`
    runs before each pass: a barrier of both sites, so that they pass at once, as in the outer step."""
    import torch

    best = float("inf")
    for _ in range(3):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        torch._foreach_add_(params, others)
        if params and params[0].is_cuda:
            torch.cuda.synchronize(params[0].device)
        best = min(best, time.perf_counter() - t0)
    for _ in range(3):
        torch._foreach_sub_(params, others)
    return best


def pass_floors(params: list[Any], others: list[Any], group: Any, site: int) -> dict[str, float]:
    """The fused pass with both sites passing at once (they share the memory bus, as during the
    outer step's local work: the ratio's denominator) and with each site alone (the other waits)."""
    import torch

    def barrier() -> None:
        group.all_reduce(torch.zeros(1))

    both = fused_pass_s(params, others, barrier)
    alone = float("nan")
    for turn in range(2):
        barrier()
        if turn == site:
            alone = fused_pass_s(params, others)
        barrier()
    return {"fused_pass_s": both, "fused_pass_alone_s": alone}


def timed_outer_steps(outer: Any, params: list[Any], deltas: list[Any], repeats: int) -> list[dict[str, float]]:
    """`repeats` outer steps, each after the same fake inner progress (params -= deltas), with their
    wall, network and CPU times; one warm-up step first (momentum buffers, memory) is left out."""
    import torch

    steps = []
    for step in range(repeats + 1):
        torch._foreach_sub_(params, deltas)
        cpu0 = os.times()
        stats = outer.after_inner_step(step + 1, sync_point=True)
        cpu1 = os.times()
        steps.append({"outer_step_s": stats.outer_step_s, "allreduce_s": stats.allreduce_s,
                      "wire_bytes": stats.wire_bytes, "user_s": cpu1.user - cpu0.user,
                      "sys_s": cpu1.system - cpu0.system, **stats.timings})
    return steps[1:]


def kernels_used() -> str:
    """Which outer-step kernels ran (zeroband/comm/kernels.py): set ZEROBAND_KERNELS=eager to compare."""
    from zeroband.comm.kernels import kernels
    from zeroband.outer.sgd_kernel import implementation

    k = kernels()
    if k.name == "native" and implementation() != "native":
        return "native (outer optimizer: torch's SGD)"
    return k.name


def _outer_site(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from zeroband.config import DilocoConfig
    from zeroband.mesh import SECRET, fixed_global_group, init_topology, shutdown
    from zeroband.outer.diloco import DiLoCo
    from zeroband.world import World

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    store = os.environ["ZEROBAND_BENCH_STORE"]
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    world = World(0, 1, 0, site, 2, device)
    topology = init_topology(world, store, "bench-step", 120, "gloo", secret=b"bench-step-secret")
    group = fixed_global_group(topology, "bench-step", mark=SECRET)
    try:
        torch.manual_seed(0)  # the same start everywhere (site 0's broadcast makes it so anyway)
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False, device=device)
                                      for _ in range(args.layers)])
        params = [p.data for p in model.parameters()]
        gen = torch.Generator(device).manual_seed(1 + site)
        deltas = [torch.randn(p.shape, generator=gen, device=device).mul_(1e-3) for p in params]
        cfg = DilocoConfig(inner_steps=1, comm_dtype=args.wire, piece_mb=args.piece_mb,  # store, timeout: the topology's
                           outer_device=args.outer_device)
        outer = DiLoCo(model, cfg, topology, group=group)
        outer.membership.may_retry = args.retry  # what elastic membership sets; its stores are not needed here
        outer.start()
        rows = []
        for threads in args.threads:
            outer.threads = threads  # diloco.outer_threads
            torch.set_num_threads(threads)  # the fused pass below runs with the same threads
            steps = timed_outer_steps(outer, params, deltas, args.repeats)
            rows.append({"threads": threads, "steps": steps, "numel": sum(p.numel() for p in params),
                         **pass_floors(params, deltas, group, site)})
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return {"rows": rows, "gpu": name, "kernels": kernels_used()}
    finally:
        shutdown()


# ---------------------------------------------------------------------------------- report


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    """Medians over the repeats; local work = whole step - network wait."""
    steps = row["steps"]
    med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in ("outer_step_s", "user_s", "sys_s", *PARTS)}
    local = [s["outer_step_s"] - s.get("network_wait", s["allreduce_s"]) for s in steps]
    # the step's own threads' user CPU: counts every torch thread only at 1 thread (pool workers are not the caller)
    cpu = statistics.median(s.get("cpu_user", float("nan")) for s in steps) if row["threads"] == 1 else float("nan")
    out = {"threads": row["threads"], "params": row["numel"], "fused_pass_s": row["fused_pass_s"],
           "fused_pass_alone_s": row["fused_pass_alone_s"],
           "outer_step_s": med["outer_step_s"], "local_s": statistics.median(local),
           "parts": {k: med[k] for k in PARTS}, "steps": steps, "user_s": med["user_s"], "sys_s": med["sys_s"]}
    out["local_over_pass"] = out["local_s"] / row["fused_pass_s"]
    out["local_over_pass_alone"] = out["local_s"] / row["fused_pass_alone_s"]
    out["local_cpu_s"], out["local_cpu_over_pass"] = cpu, cpu / row["fused_pass_s"]
    # the whole all-reduce call (statistics exchange, encoding, MACs, review included): bits this rank sent per second
    out["allreduce_gbit_s"] = statistics.median(s["wire_bytes"] * 8 / s["allreduce_s"] / 1e9 for s in steps)
    return out


def outer_markdown(args: argparse.Namespace, rows: list[dict[str, Any]], note: str) -> str:
    head = ["threads", "outer step s", "local work s", "fused pass s", "local / pass", "pass alone s",
            "local / pass alone", "local CPU s", "local CPU / pass", "all-reduce Gbit/s", "process CPU user s",
            "process CPU sys s", *PARTS]
    table = markdown_table(head, [[r["threads"], r["outer_step_s"], r["local_s"], r["fused_pass_s"],
                                   r["local_over_pass"], r["fused_pass_alone_s"], r["local_over_pass_alone"],
                                   r["local_cpu_s"], r["local_cpu_over_pass"],
                                   r["allreduce_gbit_s"], r["user_s"], r["sys_s"], *(r["parts"][k] for k in PARTS)]
                                  for r in rows])
    cmd = "python scripts/bench_step.py" + (" --quick" if args.quick else "")
    cmd += f" --device cuda --outer-device {args.outer_device}" if args.device == "cuda" else ""
    cmd += " --retry" if args.retry else ""
    cmd += f" --width {args.width}" if args.width and args.width != (256 if args.quick else 3200) else ""
    cmd += f" --piece-mb {args.piece_mb:g}" if args.piece_mb != 4.0 else ""
    cmd = ("ZEROBAND_KERNELS=eager " if os.environ.get("ZEROBAND_KERNELS") == "eager" else "") + cmd
    return "\n".join([
        f"# Outer step by part: {rows[0]['params'] / 1e6:.1f}M fp32 params on {args.device}, 2 sites x 1 rank, "
        f"{args.wire} wire, loopback gloo, authenticated", "",
        f"`{cmd}` (medians of {args.repeats} steps, site 0; seconds). {note}", "",
        "local work = outer step - network wait; fused pass = fastest of 3 `torch._foreach_add_(params, others)` "
        "in the same process with the same threads, both sites passing at once after a barrier, as both do their "
        "local work at once in the outer step (they share the memory bus); pass alone = the same with the other "
        "site waiting. Parts are the outer step's own timers (OuterStats.timings); "
        "network_wait includes handing messages to gloo (its send may copy into the socket on the caller's thread). "
        "all-reduce Gbit/s = wire bytes this rank sent x 8 / the whole all-reduce call (one pair of ranks). "
        "local CPU = user CPU seconds of the outer step's own threads (the training loop's and the exchange's; "
        "OuterStats.timings cpu_user): the work the step does, without the time those threads sat preempted "
        "(1 thread only: at more threads torch's pool workers are not counted). "
        "process CPU user / sys s: the site process's CPU time during the step, all its threads (gloo's included; sys is "
        "mostly the socket copies): on this machine the two sites' CPU time fills both cores, so every second of "
        "CPU saved shortens the step.", "",
        table,
    ])


def run_outer(args: argparse.Namespace) -> dict[str, Any]:
    load0 = load_average()
    t0 = time.monotonic()
    result = run_forked(_outer_site, 2, 1, (args,), env={"OMP_NUM_THREADS": str(max(args.threads))},
                        timeout=args.timeout)
    rows = [summarize(r) for r in result[(0, 0)]["rows"]]
    gpu, used = result[(0, 0)].get("gpu"), result[(0, 0)]["kernels"]
    note = load_note(load0, load_average()) + (f" Model on one {gpu}, shared by both sites." if gpu else "")
    note += f" Outer-step kernels: {used} (zeroband/comm/kernels.py; ZEROBAND_KERNELS=eager for torch's ops)."
    data = {"rows": rows, "kernels": used, "retry": args.retry, "device": args.device, "gpu": gpu, "outer_device": args.outer_device, "wire": args.wire, "layers": args.layers, "width": args.width, "repeats": args.repeats,
            "cores": CORES, "load_before": load0, "load_after": load_average(), "wall_s": time.monotonic() - t0}
    write_outputs(args.out, "step", data, outer_markdown(args, rows, note))
    return data


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inner:
        from bench_inner import run_inner

        run_inner(args)
        return
    run_outer(args)


if __name__ == "__main__":
    main()
