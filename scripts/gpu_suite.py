#!/usr/bin/env python
"""The GPU evidence suite (issue 24): fair inner-step speed, the shipped 1B outer step, and DiLoCo
convergence at GPU scale, run over as many short GPU windows as it takes.

    python scripts/gpu_suite.py --dry-run                 # the plan: rows, order, estimated GPU seconds
    python scripts/gpu_suite.py --budget-s 480            # on the GPU: run the rows still missing
    python scripts/gpu_suite.py --quick                   # tiny CPU versions of every row kind (CI smoke)
    python scripts/gpu_suite.py --prepare                 # on the CPU machine: .gpudata/ (corpus, tokenizers)

Every row has a spec: its configuration plus a hash of the code files it depends on (the code
version; it works without a .git directory). Results are cached per spec in <out>/gpu_suite_cache.json,
so an invocation runs only the rows whose spec is not cached yet; a row whose code or configuration
changed runs again. `--budget-s` bounds one invocation: rows run in value order, a row starts only
when its estimated seconds fit in what is left, and the next invocation goes on from there.
Rows run in worker processes (one per batch of rows; the outer-step row, which forks its sites, in a
fresh one), so a crash costs that row only: it is recorded as failed and retried next time.

Every invocation rewrites <out>/gpu_suite.{json,md} from the cache: GPU, torch, CUDA, commit, the rows,
and the checks. The checks are fixed here, in `checks()`, before any row runs; the report prints
their source hash, so a changed check is visible, and a failing check is printed as failing.

MFU (one definition, for every loop): training FLOPs per token = 6 N + 12 L d s (N = parameters
without the embedding table, lm_head included; L layers, d width, s sequence length: the attention
scores and their weighted sum, forward and backward), times tokens/s, over the GPU's dense bf16 peak
(H100 SXM and H200: 989 TFLOP/s). This is `zeroband.models.llama.flops_per_token`, the trainer's own.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "experiments"))
CACHE_NAME = "gpu_suite_cache.json"
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16, the figure named in the report
MFU_DEFINITION = ("MFU = (6 N + 12 L d s) x tokens/s / dense bf16 peak; N = parameters without the embedding "
                  "table (lm_head included), L layers, d width, s sequence length "
                  "(zeroband.models.llama.flops_per_token)")

# The code each row kind depends on: its spec's code version is a hash of these files' contents.
CODE_FILES = {
    "speed": ["zeroband/models/llama.py", "zeroband/parallelize.py", "zeroband/step.py", "zeroband/optim.py",
              "zeroband/train.py", "zeroband/config.py", "zeroband/data/loader.py", "zeroband/data/tokenizer.py",
              "scripts/bench_inner.py", "scripts/gpu_runners.py"],
    "outer": ["zeroband/outer/*.py", "zeroband/comm/*.py", "zeroband/config.py", "zeroband/models/llama.py",
              "scripts/bench_step.py", "scripts/gpu_runners.py"],
    "conv": ["zeroband/sim.py", "zeroband/train.py", "zeroband/outer/*.py", "zeroband/step.py", "zeroband/optim.py",
             "zeroband/models/llama.py", "zeroband/parallelize.py", "zeroband/data/loader.py", "zeroband/config.py",
             "zeroband/comm/*.py", "scripts/experiments/convergence.py", "scripts/gpu_runners.py"],
}


# ---------------------------------------------------------------------------------- rows and specs


@dataclass(frozen=True)
class Row:
    """One unit of work: `name` is unique in a plan, `config` is everything that sets its result."""

    name: str
    kind: str  # speed | outer | conv
    config: dict[str, Any] = field(hash=False)
    priority: int = 0  # lower runs first

    @property
    def isolated(self) -> bool:
        """Forks processes of its own: needs a worker in which CUDA was never initialised."""
        return self.kind == "outer"


def code_hash(kind: str, root: Path = REPO) -> str:
    """sha1 over the contents (and relative paths) of the files `kind` depends on."""
    h = hashlib.sha1()
    for pattern in CODE_FILES[kind]:
        for path in sorted(root.glob(pattern)):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def spec_of(row: Row, code: str) -> dict[str, Any]:
    return {"name": row.name, "kind": row.kind, "config": row.config, "code": code}


def spec_key(spec: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def keyed(rows: list[Row], codes: dict[str, str]) -> list[tuple[str, Row]]:
    return [(spec_key(spec_of(r, codes[r.kind])), r) for r in rows]


# ---------------------------------------------------------------------------------- the cache


def load_cache(out: Path) -> dict[str, Any]:
    path = out / CACHE_NAME
    if not path.is_file():
        return {"rows": {}, "failures": {}}
    return json.loads(path.read_text())


def save_cache(out: Path, cache: dict[str, Any]) -> None:
    """Atomic: a worker killed mid-write must not lose the rows already measured."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (CACHE_NAME + ".tmp")
    tmp.write_text(json.dumps(cache, indent=1, default=float) + "\n")
    tmp.replace(out / CACHE_NAME)


def pending(plan: list[tuple[str, Row]], cache: dict[str, Any]) -> list[tuple[str, Row]]:
    """The planned rows whose spec has no result yet (a failure is not a result: it is retried)."""
    return [(k, r) for k, r in plan if k not in cache["rows"]]


MAX_FAILURES = 2  # a spec that failed this often is not tried again (GPU time is scarce): fix it, or clear its entry


def retryable(todo: list[tuple[str, Row]], cache: dict[str, Any]) -> list[tuple[str, Row]]:
    return [(k, r) for k, r in todo if cache["failures"].get(k, {}).get("count", 0) < MAX_FAILURES]


def record_failure(cache: dict[str, Any], key: str, name: str, error: str) -> None:
    count = cache["failures"].get(key, {}).get("count", 0) + 1
    cache["failures"][key] = {"row": name, "error": error, "count": count, "at": time.time()}


# ---------------------------------------------------------------------------------- estimates and budget


def calibration(plan: list[tuple[str, Row]], cache: dict[str, Any], estimate: Callable[[Row], float]) -> dict[str, float]:
    """Per row kind, the median of measured / estimated seconds over the rows already measured."""
    ratios: dict[str, list[float]] = {}
    for key, row in plan:
        done = cache["rows"].get(key)
        if done and estimate(row) > 0:
            ratios.setdefault(row.kind, []).append(done["wall_s"] / estimate(row))
    return {kind: statistics.median(v) for kind, v in ratios.items()}


def choose(todo: list[tuple[str, Row]], seconds: Callable[[Row], float], budget_s: float) -> list[tuple[str, Row]]:
    """The rows one invocation tries, in order: each whose estimate fits in what is left of the
    budget (a row that does not fit is passed over; smaller rows after it may still fit)."""
    chosen, left = [], budget_s
    for key, row in todo:
        if seconds(row) <= left:
            chosen.append((key, row))
            left -= seconds(row)
    return chosen


# ---------------------------------------------------------------------------------- running rows


def run_rows(chosen: list[tuple[str, Row]], out: Path, spawn: Callable[[list[tuple[str, Row]]], int]) -> None:
    """Run the chosen rows in workers: consecutive rows of one kind share a worker (one torch import,
    one CUDA context), an isolated row gets its own. A worker that dies takes only the row it was
    running (recorded as failed); a new worker goes on with the rows after it."""
    batches: list[list[tuple[str, Row]]] = []
    for key, row in chosen:
        last = batches[-1][-1][1] if batches else None
        if row.isolated or last is None or last.isolated or last.kind != row.kind:
            batches.append([])
        batches[-1].append((key, row))
    for batch in batches:
        while batch:
            rc = spawn(batch)
            cache = load_cache(out)
            running = cache.pop("running", None)
            if running is not None:  # the worker died (or was stopped) inside this row
                name = next(r.name for k, r in batch if k == running)
                record_failure(cache, running, name, f"worker exited with {rc} in this row")
                save_cache(out, cache)
                print(f"    FAILED: {name}: worker exited with {rc}", flush=True)
                batch = batch[[k for k, _ in batch].index(running) + 1:]  # the worker ran its rows in order
            elif rc != 0:  # died outside any row (e.g. at import): retrying would fail the same way
                print(f"worker exited with {rc} outside its rows; stopping", flush=True)
                return
            else:
                batch = []


def spawn_worker(out: Path, ctx: dict[str, Any], seconds: Callable[[Row], float],
                 deadline: float) -> Callable[[list[tuple[str, Row]]], int]:
    """Runs a batch of rows in a child process; the child starts a row only while its estimate fits
    before `deadline` (wall clock), and is stopped a minute after it."""
    def spawn(batch: list[tuple[str, Row]]) -> int:
        out.mkdir(parents=True, exist_ok=True)
        job = out / ".worker.json"
        job.write_text(json.dumps({"rows": [[k, asdict(r), seconds(r)] for k, r in batch], "ctx": ctx,
                                   "deadline": deadline}, default=str))
        timeout = max(10.0, deadline - time.time() + 60)
        # Its own process group: a stopped worker takes the site processes it forked with it.
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(job), "--out", str(out)],
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"worker stopped after {timeout:.0f} s (past the budget)", flush=True)
            return 124
    return spawn


def worker(job_path: Path, out: Path) -> int:
    """In a child process: run each row, record its result in the cache as soon as it ends."""
    import gpu_rows
    import gpu_runners

    job = json.loads(job_path.read_text())
    ctx = job["ctx"]
    env = gpu_rows.environment(ctx)
    for key, raw, est in job["rows"]:
        row = Row(**raw)
        if time.time() + est > job["deadline"]:
            print(f"--- {row.name}: left for the next invocation (estimate {est:.0f} s, budget spent)", flush=True)
            continue
        cache = load_cache(out)
        cache["running"] = key
        save_cache(out, cache)
        print(f"--- {row.name}", flush=True)
        t0 = time.monotonic()
        try:
            result = gpu_runners.RUNNERS[row.kind](row.config, ctx)
        except Exception as e:  # one broken row must not cost the others; it is reported, not hidden
            cache = load_cache(out)
            cache.pop("running", None)
            first = f"{type(e).__name__}: {e}".strip().splitlines()[:2]  # the report keeps the first lines
            record_failure(cache, key, row.name, " / ".join(first)[:400])
            save_cache(out, cache)
            print(f"    FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        cache = load_cache(out)
        cache.pop("running", None)
        cache["failures"].pop(key, None)
        cache["rows"][key] = {"name": row.name, "kind": row.kind, "config": row.config, "result": result,
                              "wall_s": time.monotonic() - t0, "env": env, "at": time.time()}
        save_cache(out, cache)
        print(f"    done in {time.monotonic() - t0:.1f} s: {gpu_runners.one_line(row.kind, result)}", flush=True)
    return 0


# ---------------------------------------------------------------------------------- the report's checks


def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def conv_losses(results: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Convergence row group (its name without the seed) -> final validation losses over seeds."""
    groups: dict[str, list[float]] = {}
    for name, res in results.items():
        if name.startswith("conv/"):
            groups.setdefault(name.rsplit("/seed", 1)[0], []).append(res["result"]["val_loss"])
    return groups


def tuned_dp(groups: dict[str, list[float]]) -> tuple[str, list[float]] | None:
    """The data-parallel lr with the lowest mean loss (only lrs measured at every seed of the others)."""
    dps = {g: v for g, v in groups.items() if g.startswith("conv/dp_lr")}
    if not dps:
        return None
    most = max(len(v) for v in dps.values())
    best = min((g for g, v in dps.items() if len(v) == most), key=lambda g: mean_std(dps[g])[0])
    return best, dps[best]


def gap_closed(loss: float, single: float, dp: float) -> float:
    return (single - loss) / (single - dp) if single != dp else float("nan")


def checks(results: dict[str, dict[str, Any]], hs: Iterable[int]) -> list[dict[str, str]]:
    """The acceptance checks of issue 24, fixed before any run. Status: met, NOT met, or pending
    (rows missing); nothing else can turn a NOT met into met."""
    out = []

    def add(what: str, measured: str, ok: bool | None) -> None:
        out.append({"check": what, "measured": measured, "status": "pending" if ok is None else "met" if ok else "NOT met"})

    for preset in ("150M", "1B"):
        r = results.get(f"speed/bench-{preset}")
        ratio = r["result"]["ratio"] if r else None
        add(f"inner step >= 1.0x the fair plain loop, {preset} bench shapes", "-" if r is None else f"{ratio:.3f}x",
            None if r is None else ratio >= 1.0)
    r = results.get("speed/shipped-1B")
    mfu = r["result"]["loops"]["zeroband"]["mfu"] if r else None
    add(">= 40% MFU at 1B as configs/1B.toml ships", "-" if r is None else f"{100 * mfu:.1f}%",
        None if r is None else mfu >= 0.40)
    groups = conv_losses(results)
    single, dp = groups.get("conv/single"), tuned_dp(groups)
    for h in hs:
        d, plain, paper = (groups.get(f"conv/{s}_H{h}") for s in ("defaults", "plain_avg", "paper"))
        ready = single and dp and d
        gap = gap_closed(mean_std(d)[0], mean_std(single)[0], mean_std(dp[1])[0]) if ready else None
        add(f"H={h}: shipped defaults close >= 70% of the one-site -> tuned-DP gap",
            "-" if gap is None else f"{100 * gap:.0f}% (DP: {dp[0]})", None if gap is None else gap >= 0.70)
        for other, vals in (("plain averaging", plain), ("paper 0.7/0.9", paper)):
            ok, text = not_worse(d, vals)
            add(f"H={h}: shipped defaults not worse than {other} beyond the seed spread", text, ok)
    return out


def not_worse(d: list[float] | None, other: list[float] | None) -> tuple[bool | None, str]:
    """Defaults' mean minus the other's <= the larger seed std of the two; needs 2+ seeds of each."""
    if not d or not other or len(d) < 2 or len(other) < 2:
        return None, "-"
    (md, sd), (mo, so) = mean_std(d), mean_std(other)
    return md - mo <= max(sd, so), f"{md:.4f} vs {mo:.4f} (diff {md - mo:+.4f}, spread {max(sd, so):.4f})"


def checks_source_hash() -> str:
    src = "".join(inspect.getsource(f) for f in (checks, not_worse, tuned_dp, gap_closed, conv_losses))
    return hashlib.sha1(src.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------- main


def default_out(gpu: str) -> Path:
    return REPO / "benchmarks" / gpu_short(gpu)


def gpu_short(name: str) -> str:
    known = next((k for k in PEAK_TFLOPS if k in name), None)
    return (known or "".join(c if c.isalnum() else "-" for c in name).strip("-") or "gpu").lower()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds of rows one invocation may start (default 480)")
    p.add_argument("--out", type=Path, default=None, help="results and cache (default benchmarks/<gpu>/; --quick: a temp dir)")
    p.add_argument("--quick", action="store_true", help="tiny CPU versions of every row kind (CI smoke test)")
    p.add_argument("--dry-run", action="store_true", help="print the plan with each row's estimate; run nothing")
    p.add_argument("--rows", default="", help="comma-separated row-name prefixes to keep (default: all)")
    p.add_argument("--gpu", default=None, help="GPU name for --dry-run on a machine without one (default H100)")
    p.add_argument("--data", type=Path, default=REPO / ".gpudata", help="prose-v2.jsonl.xz and tokenizers (--prepare)")
    p.add_argument("--corpus", type=Path, default=None, help="--quick: a jsonl corpus (default: a generated one)")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "zeroband-gpu-suite",
                   help="decompressed corpus and trained tokenizers")
    p.add_argument("--commit", default=None, help="the commit to name where the checkout has no .git")
    p.add_argument("--tar", type=Path, default=None, help="after the run, tar the output directory to this file")
    p.add_argument("--prepare", action="store_true", help="write --data: the corpus and both tokenizers (CPU machine)")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def resolve_out(args: argparse.Namespace, gpu: str) -> Path:
    if not args.quick:
        return args.out or default_out(gpu)
    if args.out is None:
        return Path(tempfile.mkdtemp(prefix="gpu-suite-quick-"))
    if (REPO / "benchmarks") in args.out.resolve().parents or (REPO / "docs") in args.out.resolve().parents:
        raise SystemExit(f"--quick writes CPU smoke numbers: --out {args.out} must be outside benchmarks/ and docs/")
    return args.out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)
    import gpu_rows

    if args.prepare:
        print(json.dumps(gpu_rows.prepare(args.data), indent=1))
        return 0
    gpu = gpu_rows.device_name(args.quick, args.gpu or "NVIDIA H100 80GB HBM3", args.dry_run)
    out = resolve_out(args, gpu)
    scale = gpu_rows.QUICK if args.quick else gpu_rows.FULL
    rows = [r for r in gpu_rows.plan_rows(scale) if not args.rows or r.name.startswith(tuple(args.rows.split(",")))]
    codes = {kind: code_hash(kind) for kind in CODE_FILES}
    plan = sorted(keyed(rows, codes), key=lambda kr: kr[1].priority)
    cache = load_cache(out)
    estimate = lambda r: gpu_rows.estimate_s(r, scale)  # noqa: E731
    factor = calibration(plan, cache, estimate)
    seconds = lambda r: estimate(r) * factor.get(r.kind, 1.0)  # noqa: E731
    todo = pending(plan, cache)
    chosen = choose(retryable(todo, cache), seconds, args.budget_s)
    print(gpu_rows.plan_text(plan, cache, seconds, {k for k, _ in chosen}, out, gpu, args.budget_s), flush=True)
    if args.dry_run:
        return 0
    ctx = gpu_rows.context(args, scale, out, gpu)
    if chosen:
        run_rows(chosen, out, spawn_worker(out, ctx, seconds, time.time() + args.budget_s))
    cache = load_cache(out)
    left = len(pending(plan, cache))
    from gpu_report import write_report

    write_report(out, plan, cache, ctx, checks, checks_source_hash(), MFU_DEFINITION)
    print(f"\n{len(plan) - left} of {len(plan)} rows measured, {left} left "
          f"({'run the same command again' if left else 'suite complete'}); report: {out}/gpu_suite.md", flush=True)
    if args.tar:
        subprocess.run(["tar", "czf", str(args.tar), "--exclude=.worker.json", "-C", str(out.parent), out.name], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
