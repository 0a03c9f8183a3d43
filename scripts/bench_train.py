"""Training throughput and peak RSS of one site: 1 and 2 ranks, eager and torch.compile.

    python scripts/bench_train.py --out benchmarks  # demo preset, configs/demo.toml (several minutes)
    python scripts/bench_train.py --quick         # debug preset, a few eager steps (CI smoke test)

Every case is a real `torchrun --standalone --nproc-per-node N` job running the trainer
(`zeroband.train.main`, wrapped only to record each rank's peak RSS when it exits), with
OMP_NUM_THREADS = cores / ranks and OMP_WAIT_POLICY=PASSIVE. Timing comes from the run's
metrics.jsonl (one "train" record per step): tokens/s is the site's tokens between the end of the
warm-up steps and the last step divided by the wall time between those records, so start-up,
compilation and the final evaluation are excluded. The warm-up overhead is the warm-up steps'
wall time minus what they would cost at the steady-state step time: for compiled runs that is the
compile time (cold: a fresh TORCHINDUCTOR_CACHE_DIR per case unless --warm-cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
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
    maxrss_mb,
    output_dir,
    prewarm,
    run_forked,
    thread_env,
    vm_hwm_mb,
    write_outputs,
)

WORKER_FLAG = "--worker-rss-dir"


@dataclass(frozen=True)
class Case:
    ranks: int
    compile: bool

    @property
    def mode(self) -> str:
        return "compile" if self.compile else "eager"

    @property
    def tag(self) -> str:
        return f"{self.ranks}rank-{self.mode}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps after warm-up (default 20; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="debug preset, few steps, eager only (CI smoke test)")
    add_out_argument(p, "benchmarks", "train.json / train.md")
    p.add_argument("--warm-cache", action="store_true", help="reuse the default inductor cache (not cold compile)")
    p.add_argument("--keep-runs", action="store_true", help="keep run directories and logs under OUT/train-runs")
    p.add_argument("--launcher", choices=["torchrun", "fork"], default=None,
                   help="torchrun jobs (default) or forked ranks (default with --quick: no per-rank torch import)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per case")
    args = p.parse_args(argv)
    args.out = output_dir(args.out, "train", args.quick)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.launcher = args.launcher or ("fork" if args.quick else "torchrun")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    return args


def cases(quick: bool) -> list[Case]:
    modes = [False] if quick else [False, True]
    return [Case(ranks, mode) for mode in modes for ranks in (1, 2)]


def config_args(args: argparse.Namespace, case: Case, run_root: Path) -> list[str]:
    """Config file and overrides: one train record per step, no periodic eval, no checkpoints."""
    base = ["configs/debug.toml", "--model.vocab_size", "4096"] if args.quick else ["configs/demo.toml"]
    return [
        *base, "--name", case.tag, "--output_dir", str(run_root),
        "--train.steps", str(args.warmup + args.steps), "--train.compile", str(case.compile).lower(),
        "--log.interval", "1", "--log.progress_bar", "false", "--eval.interval", "0", "--eval.batches", "1",
        "--checkpoint.interval", "0", "--checkpoint.save_at_end", "false", "--checkpoint.resume", "none",
    ]


def case_env(args: argparse.Namespace, case: Case, work: Path) -> dict[str, str]:
    env = {**os.environ, **thread_env(case.ranks), "PYTHONUNBUFFERED": "1"}
    if case.compile and not args.warm_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{case.tag}")
    return env


def run_case(args: argparse.Namespace, case: Case, work: Path) -> dict[str, Any]:
    runner = run_torchrun if args.launcher == "torchrun" else run_fork
    records, rss = runner(args, case, work)
    return {"ranks": case.ranks, "mode": case.mode, "launcher": args.launcher, **thread_env(case.ranks),
            **timing(records, args.warmup), **rss_summary(rss)}


def run_torchrun(args: argparse.Namespace, case: Case, work: Path) -> tuple[list[dict], list[dict]]:
    """One torchrun job; each rank leaves its peak RSS in rss_dir when it exits."""
    rss_dir = work / f"rss-{case.tag}"
    rss_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.ranks}",
        str(Path(__file__).resolve()), WORKER_FLAG, str(rss_dir), *config_args(args, case, work / "runs"),
    ]
    log_path = work / f"{case.tag}.log"
    print(f"[bench_train] {case.tag}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, cwd=REPO, env=case_env(args, case, work), stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout).returncode
    if code:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{case.tag} exited with {code}; last lines of {log_path}:\n{tail}")
    rss = [json.loads(p.read_text()) for p in sorted(rss_dir.glob("rank*.json"))]
    return read_records(work, case), rss


def run_fork(args: argparse.Namespace, case: Case, work: Path) -> tuple[list[dict], list[dict]]:
    """The same trainer on forked ranks: no per-process torch import, so much faster to start."""
    prewarm()
    env = {k: v for k, v in case_env(args, case, work).items() if k.startswith(("OMP_", "TORCHINDUCTOR_"))}
    print(f"[bench_train] {case.tag}: forked ranks", file=sys.stderr, flush=True)
    out = run_forked(_fork_rank, 1, case.ranks, (config_args(args, case, work / "runs"),), env, args.timeout)
    return read_records(work, case), [out[(0, r)] for r in range(case.ranks)]


def _fork_rank(argv: list[str]) -> dict[str, Any]:
    from zeroband.config import load_config
    from zeroband.train import train

    os.chdir(REPO)
    train(load_config(argv[0], argv[1:]))
    return rank_rss()


def read_records(work: Path, case: Case) -> list[dict[str, Any]]:
    with open(work / "runs" / case.tag / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def rank_rss() -> dict[str, Any]:
    return {"rank": int(os.environ.get("RANK", "0")), "maxrss_mb": maxrss_mb(), "vmhwm_mb": vm_hwm_mb()}


def timing(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Steady-state throughput from the step records' wall-clock times, warm-up steps excluded."""
    start = next(r["time"] for r in records if r["kind"] == "run")
    train = [r for r in records if r["kind"] == "train"]
    first = next(r for r in train if r["step"] == warmup)
    last = train[-1]
    step_s = (last["time"] - first["time"]) / (last["step"] - first["step"])
    warmup_s = first["time"] - start
    timed = [r for r in train if r["step"] > warmup]
    return {
        "tokens_per_s": (last["tokens"] - first["tokens"]) / (last["time"] - first["time"]),
        "step_s": step_s,
        "tokens_per_step": last["tokens"] // last["step"],
        "timed_steps": last["step"] - first["step"],
        "warmup_steps": warmup,
        "warmup_s": warmup_s,
        "warmup_overhead_s": max(0.0, warmup_s - warmup * step_s),
        "logged_tokens_per_s_mean": sum(r["tokens_per_s"] for r in timed) / len(timed),
        "per_step_s": [round(b["time"] - a["time"], 4) for a, b in zip(train, train[1:])],
        "rank0_peak_mem_mb_logged": last["peak_mem_mb"],
        "final_loss": last["loss"],
    }


def rss_summary(rss: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = [max(r["vmhwm_mb"], r["maxrss_mb"]) for r in rss]
    return {"peak_rss_mb": max(per_rank), "peak_rss_mb_per_rank": per_rank}


def render(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = [
        [r["ranks"], r["mode"], r["OMP_NUM_THREADS"], f"{r['tokens_per_s']:,.0f}", f"{r['step_s']:.3f}",
         f"{r['peak_rss_mb']:,.0f}", f"{r['warmup_overhead_s']:.1f}"]
        for r in results
    ]
    headers = ["ranks", "mode", "threads/rank", "tokens/s", "s/step", "peak RSS MB (max over ranks)",
               "compile warm-up s"]
    note = (
        f"{meta['config']} ({meta['preset']} preset), {meta['tokens_per_step']} tokens/step per site, "
        f"{meta['warmup']} warm-up + {meta['steps']} timed steps, {meta['cores']} cores. tokens/s is the site's "
        "throughput over the timed steps; warm-up s = warm-up wall time minus warm-up steps x steady s/step "
        f"(for eager rows: first-step overhead only); compile cache: {meta['compile_cache']}."
    )
    load = load_note(meta["loadavg_start"], meta["loadavg_end"])
    return f"## Training throughput\n\n{markdown_table(headers, rows)}\n\n{note} {load}"


def worker_main(argv: list[str]) -> int:
    """Inside torchrun: train, then record this rank's peak RSS."""
    rss_dir, rest = Path(argv[0]), argv[1:]
    from zeroband.train import main as train_main

    code = train_main(rest)
    rss = rank_rss()
    (rss_dir / f"rank{rss['rank']}.json").write_text(json.dumps(rss))
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_demo_data()
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
        work = args.out / "train-runs" if args.keep_runs else Path(tmp)
        results = [run_case(args, case, work) for case in cases(args.quick)]
    meta = {
        "config": "configs/debug.toml" if args.quick else "configs/demo.toml", "preset": "debug" if args.quick else "demo",
        "tokens_per_step": results[0]["tokens_per_step"], "warmup": args.warmup, "steps": args.steps,
        "cores": os.cpu_count(), "compile_cache": "warm (default dir)" if args.warm_cache else "cold (fresh dir per case)",
        "quick": args.quick, "launcher": args.launcher,
        "loadavg_start": load_start, "loadavg_end": load_average(),
    }
    write_outputs(args.out, "train", {"meta": meta, "runs": results}, render(results, meta))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        raise SystemExit(worker_main(sys.argv[2:]))
    raise SystemExit(main())
