"""One training run of the experiment (one row, one seed) on forked processes: 1 rank per site.

Each site is one forked process running the trainer's own `setup` + `train_loop` (the same code
`zeroband train` runs). Only site 0's validation is recorded: after every outer step all sites hold
the same model, so sites 1.. evaluate a single batch instead of the full set (saves CPU, changes
nothing else). Results are read back from site 0's metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import run_forked  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class RunSpec:
    """What differs between rows. method: single | dp | diloco."""

    row: str
    method: str
    sites: int
    steps: int
    seed: int
    h: int = 0
    comm: str = "fp32"
    overlap: bool = False
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    error_feedback: bool = False


def diloco_section(spec: RunSpec, report_every: int) -> dict[str, Any] | None:
    if spec.method == "single":
        return None
    if spec.method == "dp":  # inner_steps only sets how often the byte totals are reported
        return {"mode": "data_parallel", "comm_dtype": spec.comm, "inner_steps": report_every, "timeout_s": 900}
    return {"mode": "diloco", "inner_steps": spec.h, "comm_dtype": spec.comm, "overlap": spec.overlap,
            "outer_lr": spec.outer_lr, "outer_momentum": spec.outer_momentum, "nesterov": True,
            "error_feedback": spec.error_feedback, "timeout_s": 900}


def config_tree(spec: RunSpec, base: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The full config of one run: `base` (model, data, optim, batch, eval) plus the row's settings."""
    from zeroband.config import deep_merge

    tree = deep_merge(base, {
        "name": f"{spec.row}-s{spec.seed}", "output_dir": str(out_dir),
        "train": {"steps": spec.steps, "seed": spec.seed, "device": "cpu"},
        "data": {"shuffle_seed": 1000 + spec.seed},
        "checkpoint": {"interval": 0, "resume": "none", "save_at_end": False},
        "log": {"progress_bar": False},
    })
    section = diloco_section(spec, base["eval"]["interval"])
    if section is not None:
        tree["diloco"] = section
    return tree


def site_main(tree: dict[str, Any]) -> dict[str, Any]:
    """One site's process: the trainer's setup + loop; sites other than 0 evaluate one batch only."""
    start = time.perf_counter()
    from zeroband.config import validate_config
    from zeroband.mesh import init_topology, shutdown
    from zeroband.metrics import MetricsLogger
    from zeroband.train import setup, train_loop
    from zeroband.world import world_from_env

    if "diloco" in tree:
        tree = {**tree, "diloco": {**tree["diloco"], "store": os.environ["ZEROBAND_BENCH_STORE"]}}
    cfg = validate_config(tree)
    world = world_from_env(cfg)
    topology = init_topology(world, cfg.diloco.store if cfg.diloco else None, cfg.name,
                             cfg.diloco.timeout_s if cfg.diloco else 600.0, "gloo")
    try:
        run = setup(cfg, world, topology)
        if world.site_rank > 0:
            run.eval_set = run.eval_set[:1]
        run.outer.start()
        metrics = MetricsLogger(cfg, run.run_dir, world.rank == 0, cfg.train.steps, 0,
                                tag=f"site{world.site_rank}" if cfg.diloco else "")
        try:
            result = train_loop(run, metrics)
        finally:
            metrics.close()
    finally:
        shutdown()
    return {"run_dir": result["run_dir"], "wall_s": time.perf_counter() - start}


def independent_main(trees: list[dict[str, Any]]) -> dict[str, Any]:
    """Independent one-site runs side by side: forked "site" i runs trees[i] (no [diloco], no traffic)."""
    return site_main(trees[int(os.environ["ZEROBAND_SITE_RANK"])])


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(spec: RunSpec, records: list[dict[str, Any]], tokens_per_site_step: int, wall_s: float) -> dict[str, Any]:
    """Validation curve (tokens, cumulative bytes) and totals from site 0's records."""
    outer = [r for r in records if r["kind"] == "outer"]
    val = [r for r in records if r["kind"] == "val"]
    train = [r for r in records if r["kind"] == "train"]
    curve = []
    for v in val:
        done = [o for o in outer if o["step"] <= v["step"]]
        curve.append({"step": v["step"], "tokens": v["step"] * tokens_per_site_step * spec.sites,
                      "val_loss": v["val_loss"], "payload_bytes": sum(o["payload_bytes"] for o in done),
                      "wire_bytes": sum(o["wire_bytes_est"] for o in done)})
    final = val[-1]
    return {
        **asdict(spec), "val_loss": final["val_loss"], "val_ppl": final["val_ppl"], "val_bpb": final["val_bpb"],
        "tokens": spec.steps * tokens_per_site_step * spec.sites, "wall_s": wall_s,
        "payload_bytes": sum(o["payload_bytes"] for o in outer), "wire_bytes": sum(o["wire_bytes_est"] for o in outer),
        "outer_records": len(outer), "allreduce_s": sum(o["allreduce_s"] for o in outer),
        "final_train_loss": train[-1]["loss"] if train else None, "curve": curve,
    }


def collect(spec: RunSpec, base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    tokens_per_site_step = base["train"]["global_batch"] * base["data"]["seq_len"]
    result = summarise(spec, read_records(Path(child["run_dir"])), tokens_per_site_step, child["wall_s"])
    result["concurrent_processes"] = child["concurrent"]
    return result


def run_one(spec: RunSpec, base: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """A multi-site row (DP or DiLoCo): spec.sites forked processes, one per site."""
    out = run_forked(site_main, spec.sites, 1, (config_tree(spec, base, work),), env=ENV, timeout=timeout)
    return collect(spec, base, {**out[(0, 0)], "concurrent": spec.sites})


def run_side_by_side(specs: list[RunSpec], base: dict[str, Any], work: Path, timeout: float) -> list[dict[str, Any]]:
    """Independent one-site runs, len(specs) at a time (one core each), each its own process."""
    trees = [config_tree(s, base, work) for s in specs]
    out = run_forked(independent_main, len(specs), 1, (trees,), env=ENV, timeout=timeout)
    return [collect(s, base, {**out[(i, 0)], "concurrent": len(specs)}) for i, s in enumerate(specs)]
