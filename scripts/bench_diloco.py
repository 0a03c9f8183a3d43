"""What DiLoCo's outer step costs: bytes per rank, time versus inner compute, and outer-state memory.

    python scripts/bench_diloco.py                      # demo preset, 2 sites x 2 ranks, H=20
    python scripts/bench_diloco.py --quick              # debug preset, H=2 (CI smoke test)

1. Bytes: one short real run (S sites x W ranks, `--outer-steps` outer steps) per comm dtype; the
   payload is OuterStats.payload_bytes from the "outer" records of metrics.jsonl, the wire estimate
   a ring all-reduce's 2(S-1)/S x payload. The baseline is per-step data parallelism over the same
   H steps: fp32 gradients of the same shard, ring all-reduced every step.
2. Time: outer_step_s of those records (loopback gloo, no network) against H x the mean inner step
   (the trainer's own compute seconds per step, warm-up step excluded). The H=500 fraction is derived
   from the same measurements, not run.
3. Memory: the CPU fp32 outer copy + outer momentum of one rank, summed tensor by tensor in a forked
   run that builds the model and DiLoCo exactly as the trainer does, versus that rank's model shard.

Ranks are forked from this process (the trainer's code, torchrun's environment), all S x W of them on
this machine's cores (OMP_NUM_THREADS = max(1, cores / (S x W))).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    REPO,
    add_out_argument,
    ensure_demo_data,
    load_average,
    load_note,
    markdown_table,
    output_dir,
    prewarm,
    run_forked,
    thread_env,
    vm_rss_mb,
    write_outputs,
)

CONFIG = "configs/demo_diloco.toml"
DTYPES = ("fp32", "bf16", "fp16")
WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PRODUCTION_H = 500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, help="model preset (default demo; debug with --quick)")
    p.add_argument("--sites", type=int, default=2, help="S")
    p.add_argument("--ranks", type=int, default=2, help="W: FSDP ranks per site")
    p.add_argument("--inner-steps", type=int, default=None, help="H (default 20; 2 with --quick)")
    p.add_argument("--outer-steps", type=int, default=2, help="outer steps per run")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comm dtypes to measure, comma separated")
    p.add_argument("--quick", action="store_true", help="debug preset, tiny H (CI smoke test)")
    add_out_argument(p, "benchmarks", "diloco.json / diloco.md")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = p.parse_args(argv)
    args.out = output_dir(args.out, "diloco", args.quick)
    args.preset = args.preset or ("debug" if args.quick else "demo")
    args.inner_steps = args.inner_steps or (2 if args.quick else 20)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in DTYPES for d in args.dtypes):
        p.error(f"--dtypes: choose from {DTYPES}")
    if min(args.sites, args.ranks, args.inner_steps, args.outer_steps) < 1 or args.sites < 2:
        p.error("--sites must be >= 2; --ranks, --inner-steps, --outer-steps >= 1")
    return args


# ---------------------------------------------------------------------------------- configs


def model_overrides(preset: str, quick: bool) -> list[str]:
    """The preset, a vocabulary large enough for the demo tokenizer, and a sequence length that fits."""
    from zeroband.config import MODEL_PRESETS
    from zeroband.data.tokenizer import TextTokenizer

    shape = MODEL_PRESETS[preset]
    vocab = max(shape["vocab_size"], TextTokenizer.load(REPO / "data/demo/tokenizer").vocab_size)
    seq_len = min(64 if quick else 256, shape["max_seq_len"])
    batch = ["--train.global_batch", "4", "--train.micro_batch", "2"] if quick else []
    return ["--model.preset", preset, "--model.vocab_size", str(vocab), "--data.seq_len", str(seq_len), *batch]


def run_overrides(args: argparse.Namespace, dtype: str, out_dir: Path) -> list[str]:
    """One train record per step, no periodic eval, no checkpoints; the store comes from the environment."""
    return [
        *model_overrides(args.preset, args.quick), "--name", f"diloco-{dtype}", "--output_dir", str(out_dir),
        "--train.steps", str(args.inner_steps * args.outer_steps), "--diloco.inner_steps", str(args.inner_steps),
        "--diloco.comm_dtype", dtype, "--sites.timeout_s", "300",
        "--log.interval", "1", "--log.progress_bar", "false", "--eval.interval", "0", "--eval.batches", "1",
        "--checkpoint.interval", "0", "--checkpoint.save_at_end", "false", "--checkpoint.resume", "none",
    ]


def load_rank_config(overrides: list[str]) -> Any:
    from zeroband.config import load_config

    os.chdir(REPO)
    return load_config(CONFIG, [*overrides, "--sites.store", os.environ["ZEROBAND_BENCH_STORE"]])


# ---------------------------------------------------------------------------------- forked ranks


def _train_rank(overrides: list[str]) -> dict[str, Any]:
    """The trainer, with the compute clock recording every inner step's seconds."""
    from zeroband.metrics import ComputeClock
    from zeroband.train import train

    steps: list[float] = []
    original = ComputeClock.add_compute

    def add_compute(self: ComputeClock, seconds: float) -> None:
        steps.append(seconds)
        original(self, seconds)

    ComputeClock.add_compute = add_compute  # this forked process only
    train(load_rank_config(overrides))
    return {"compute_s": steps}


def _outer_state_rank(overrides: list[str]) -> dict[str, Any]:
    """Build the model and DiLoCo as the trainer does, take one outer step, sum the outer state's bytes."""
    from zeroband.mesh import fixed_global_group, init_topology, shutdown
    from zeroband.outer.diloco import DiLoCo, local_shard
    from zeroband.parallelize import build_model
    from zeroband.world import world_from_env

    cfg = load_rank_config(overrides)
    world = world_from_env(cfg)
    topology = init_topology(world, cfg.sites.store, cfg.name, cfg.sites.timeout_s, "gloo")
    group = fixed_global_group(topology, cfg.name)
    try:
        model = build_model(cfg, topology)
        shard = [local_shard(p) for p in model.parameters()]
        rss_before = vm_rss_mb()
        outer = DiLoCo(model, cfg.diloco, topology, group=group)
        outer.start()
        # One blocking outer step: the momentum buffers exist only after the first one.
        outer.after_inner_step(cfg.diloco.inner_steps, sync_point=True)
        rss_after = vm_rss_mb()
        return {"shard_numel": sum(t.numel() for t in shard), "shard_bytes": sum(t.nbytes for t in shard),
                "outer_copy_bytes": sum(t.nbytes for t in outer.outer),
                "momentum_bytes": optimizer_state_bytes(outer.optimizer.optimizer), "rss_delta_mb": rss_after - rss_before}
    finally:
        shutdown()


def optimizer_state_bytes(optimizer: Any) -> int:
    import torch

    return sum(v.nbytes for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------- measurements


def measure_dtype(args: argparse.Namespace, dtype: str, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    env = thread_env(args.sites * args.ranks)
    ranks = run_forked(_train_rank, args.sites, args.ranks, (run_overrides(args, dtype, work),), env, args.timeout)
    outer = [r for s in range(args.sites) for r in read_records(work / f"diloco-{dtype}" / f"site{s}") if r["kind"] == "outer"]
    inner = [s for r in ranks.values() for s in r["compute_s"][1:]]  # each rank's first step is warm-up
    print(f"[bench_diloco] {dtype}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return summarise(args, dtype, outer, statistics.fmean(inner))


def read_records(site_dir: Path) -> list[dict[str, Any]]:
    with open(site_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(args: argparse.Namespace, dtype: str, outer: list[dict[str, Any]], inner_s: float) -> dict[str, Any]:
    s, h = args.sites, args.inner_steps
    payload = outer[-1]["payload_bytes"]
    ring = 2 * (s - 1) / s
    shard_numel = payload // WIRE_BYTES[dtype]
    dp_bytes = h * ring * 4 * shard_numel
    outer_s = statistics.fmean(r["outer_step_s"] for r in outer)
    by_step: dict[int, list[float]] = {}
    for r in outer:
        by_step.setdefault(r["step"], []).append(r["outer_step_s"])
    # The last site to arrive waits least: the minimum over sites is closest to the outer step's own work.
    outer_min_s = statistics.fmean(min(v) for v in by_step.values())
    return {
        "payload_bytes": payload, "wire_bytes_ring_est": ring * payload, "wire_bytes_logged": outer[-1]["wire_bytes"],
        "shard_numel_from_payload": shard_numel, "dp_fp32_ring_bytes_over_h": dp_bytes,
        "reduction_factor": dp_bytes / (ring * payload),
        "outer_step_s_mean": outer_s, "outer_step_s_max": max(r["outer_step_s"] for r in outer),
        "outer_step_s_all": [r["outer_step_s"] for r in outer],
        "outer_step_s_min_over_sites_mean": outer_min_s,
        "allreduce_s_mean": statistics.fmean(r["allreduce_s"] for r in outer),
        "inner_step_s_mean": inner_s,
        "outer_fraction_measured_h": outer_s / (h * inner_s),
        "outer_fraction_h500_derived": outer_s / (PRODUCTION_H * inner_s),
        "outer_fraction_measured_h_min_over_sites": outer_min_s / (h * inner_s),
        "outer_records": len(outer),
    }


def measure_memory(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = thread_env(args.sites * args.ranks)
    out = run_forked(_outer_state_rank, args.sites, args.ranks, (run_overrides(args, "fp32", work),), env, args.timeout)
    per_rank = [out[(0, r)] for r in range(args.ranks)]
    mine = per_rank[0]
    state = mine["outer_copy_bytes"] + mine["momentum_bytes"]
    return {**mine, "outer_state_bytes": state, "outer_state_over_shard": state / mine["shard_bytes"],
            "expected_outer_state_bytes": 2 * 4 * mine["shard_numel"],
            "outer_state_bytes_per_rank": [r["outer_copy_bytes"] + r["momentum_bytes"] for r in per_rank]}


# ---------------------------------------------------------------------------------- report


def render(data: dict[str, Any]) -> str:
    meta, comm, mem = data["meta"], data["comm"], data["memory"]
    h, s = meta["inner_steps"], meta["sites"]
    bytes_rows = [[d, f"{c['payload_bytes']:,}", f"{c['wire_bytes_ring_est']:,.0f}", f"{c['dp_fp32_ring_bytes_over_h']:,.0f}",
                   f"{c['reduction_factor']:,.0f}x"] for d, c in comm.items()]
    time_rows = [[d, f"{c['outer_step_s_mean'] * 1e3:.1f}", f"{c['outer_step_s_min_over_sites_mean'] * 1e3:.1f}",
                  f"{c['allreduce_s_mean'] * 1e3:.1f}",
                  f"{c['inner_step_s_mean']:.3f}", f"{100 * c['outer_fraction_measured_h']:.3f}%",
                  f"{100 * c['outer_fraction_h500_derived']:.4f}%"] for d, c in comm.items()]
    mb = 2**20
    mem_row = [[f"{mem['shard_bytes'] / mb:.2f}", f"{mem['outer_copy_bytes'] / mb:.2f}", f"{mem['momentum_bytes'] / mb:.2f}",
                f"{mem['outer_state_bytes'] / mb:.2f}", f"{mem['outer_state_over_shard']:.2f}x", f"{mem['rss_delta_mb']:.1f}"]]
    return "\n\n".join([
        f"## DiLoCo outer step: {meta['preset']} preset, {s} sites x {meta['ranks']} ranks, H={h}, "
        f"{meta['outer_steps']} outer steps per comm dtype, {meta['cores']} cores",
        "### Bytes per outer step per rank (rank 0's shard)",
        markdown_table(["comm dtype", "payload B (measured)", "ring wire B = 2(S-1)/S x payload",
                        f"per-step DP, fp32 ring B over H={h} steps", "reduction"], bytes_rows),
        f"### Outer step time on loopback vs H x inner step (H={h} measured; H={PRODUCTION_H} derived)",
        markdown_table(["comm dtype", "outer step ms (mean)", "outer step ms (min over sites)", "all-reduce ms", "inner step s",
                        f"outer / ({h} x inner) measured", f"outer / ({PRODUCTION_H} x inner) derived"], time_rows),
        "### Outer state memory per rank (rank 0)",
        markdown_table(["local shard MB", "outer fp32 copy MB", "momentum MB", "outer state MB", "state / shard",
                        "RSS delta MB"], mem_row),
        NOTES.format(cores=meta["cores"], ranks=s * meta["ranks"]),
        load_note(meta["loadavg_start"], meta["loadavg_end"]),
    ])


NOTES = (
    "Payload and outer step times are from the runs' \"outer\" records (OuterStats); the inner step is the "
    "trainer's compute seconds per step averaged over all ranks and steps except each rank's first. All "
    "{ranks} ranks share {cores} cores, so inner and outer steps both run oversubscribed. The outer step "
    "includes the site-statistics exchange, the pseudo-gradient, the all-reduce and the CPU Nesterov update. "
    "The min over sites of each outer step excludes most of the wait for the slowest site; the fractions "
    "use the mean (what OuterStats logs), so they are upper bounds. Outer state = summed nbytes of DiLoCo.outer and its SGD momentum buffers; RSS delta is VmRSS after vs "
    "before building DiLoCo and one outer step (allocator-dependent, informational)."
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Measured as users run it: authenticated, so the tags' cost is in the numbers. One secret per
    # benchmark, set before the ranks fork so every site holds the same one.
    os.environ.setdefault("ZEROBAND_SECRET", secrets.token_hex(16))
    ensure_demo_data()
    prewarm()
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="bench_diloco-") as tmp:
        work = Path(tmp)
        memory = measure_memory(args, work / "memory")
        comm = {dtype: measure_dtype(args, dtype, work) for dtype in args.dtypes}
    meta = {"preset": args.preset, "sites": args.sites, "ranks": args.ranks, "inner_steps": args.inner_steps,
            "outer_steps": args.outer_steps, "cores": os.cpu_count(), "quick": args.quick, "config": CONFIG,
            **thread_env(args.sites * args.ranks), "loadavg_start": load_start, "loadavg_end": load_average()}
    data = {"meta": meta, "comm": comm, "memory": memory}
    write_outputs(args.out, "diloco", data, render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
