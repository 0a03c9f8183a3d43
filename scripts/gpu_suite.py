#!/usr/bin/env python
"""The GPU evidence suite (issues 24 and 33): fair inner-step speed, the shipped 1B outer step, and DiLoCo
convergence at GPU scale, cut into calls that each fit one 15-minute GPU lend.

    python scripts/gpu_suite.py --dry-run                  # every call in order: carry, rows, estimates, done
    python scripts/gpu_suite.py --call first --out $OUT    # on the GPU: one call (see docs/gpu_runbook.md)
    python scripts/gpu_suite.py --call next --out $OUT     # the first call with rows still missing
    python scripts/gpu_suite.py --merge FILES_AT/rows.jsonl  # back here: fold a call's rows into benchmarks/<gpu>/
    python scripts/gpu_suite.py --quick --call first,conv-h100-seed0-1   # tiny CPU versions (CI smoke)
    python scripts/gpu_suite.py --prepare                  # on the CPU machine: .gpudata/ (corpus, tokenizers)

Every row has a spec: its configuration, the GPU, and a hash of the code files it depends on (the code
version; it works without a .git directory). A row's result is one line of <out>/rows.jsonl, appended
and flushed the moment the row ends, so a call killed at its limit loses only the row in progress.
A call skips every row whose spec already has a result in a results file: benchmarks/<gpu>/rows.jsonl
(committed, so it travels with the working tree) and any `--results` file.

A call has a hard deadline (its `budget_s`, or `--budget-s`): before each row the suite prints the row's
estimated device seconds and what is left, and starts it only if it fits; a worker still running at
the deadline is stopped and its row recorded as stopped. Rows run in worker processes (speed rows in
one; rows that fork site processes in another, whose CUDA was never initialised), so a crash costs
that row only: it is recorded as failed and retried by the next call, at most `MAX_FAILURES` times.

Every call rewrites <out>/gpu_suite.{json,md}: GPU, torch, CUDA, commit, every known row, the checks.
The checks are fixed here, in `checks()`, before any row runs; the report prints their source hash.

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
ROWS_NAME = "rows.jsonl"
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16, the figure named in the report
MFU_DEFINITION = ("MFU = (6 N + 12 L d s) x tokens/s / dense bf16 peak; N = parameters without the embedding "
                  "table (lm_head included), L layers, d width, s sequence length "
                  "(zeroband.models.llama.flops_per_token)")
MAX_FAILURES = 2  # a spec that failed this often (not counting deadline stops) is not tried again: fix it
GRACE_S = 10.0  # a worker still running this long after the deadline is stopped

# The code each row kind depends on: its spec's code version is a hash of these files' contents.
CODE_FILES = {
    "speed": ["zeroband/models/llama.py", "zeroband/parallelize.py", "zeroband/step.py", "zeroband/optim.py",
              "zeroband/train.py", "zeroband/config.py", "zeroband/data/loader.py", "zeroband/data/tokenizer.py",
              "scripts/bench_inner.py", "scripts/gpu_runners.py"],
    "outer": ["zeroband/outer/*.py", "zeroband/comm/*.py", "zeroband/config.py", "zeroband/models/llama.py",
              "scripts/bench_step.py", "scripts/gpu_runners.py"],
    "conv": ["zeroband/train.py", "zeroband/outer/*.py", "zeroband/step.py", "zeroband/optim.py",
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

    @property
    def forks(self) -> bool:
        """Forks processes of its own: needs a worker in which CUDA was never initialised."""
        return self.kind != "speed"


def code_hash(kind: str, root: Path = REPO) -> str:
    """sha1 over the contents (and relative paths) of the files `kind` depends on."""
    h = hashlib.sha1()
    for pattern in CODE_FILES[kind]:
        for path in sorted(root.glob(pattern)):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def spec_key(row: Row, code: str, gpu: str) -> str:
    spec = {"name": row.name, "kind": row.kind, "config": row.config, "code": code, "gpu": gpu}
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def keyed(rows: list[Row], codes: dict[str, str], gpu: str) -> dict[str, tuple[str, Row]]:
    """Row name -> (spec key, row)."""
    return {r.name: (spec_key(r, codes[r.kind], gpu), r) for r in rows}


# ---------------------------------------------------------------------------------- results files


def append_line(path: Path, entry: dict[str, Any]) -> None:
    """One JSON line, flushed to disk before the next row starts (after a torn line, on a line of its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(entry, default=float) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def read_lines(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every entry of these files; a torn last line (a kill mid-write) is skipped."""
    out = []
    for path in paths:
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


@dataclass
class Results:
    """What the results files say: done rows by spec key, and each spec's failures."""

    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: list[dict[str, Any]]) -> Results:
        res = cls()
        for e in entries:
            if e["status"] == "done":
                res.done.setdefault(e["key"], e)
            else:
                res.failures.setdefault(e["key"], []).append(e)
        return res

    def failed_out(self, key: str) -> bool:
        return sum(1 for f in self.failures.get(key, []) if f["status"] == "failed") >= MAX_FAILURES


# ---------------------------------------------------------------------------------- estimates and deadline


def calibration(rows: dict[str, tuple[str, Row]], res: Results, estimate: Callable[[Row], float]) -> dict[str, float]:
    """Per row kind, the median of measured / estimated seconds over the rows already measured. A row
    stopped at a deadline ran at least that long: it counts only where that already exceeds its estimate."""
    ratios: dict[str, list[float]] = {}
    for key, row in rows.values():
        if key in res.done:
            ratios.setdefault(row.kind, []).append(res.done[key]["wall_s"] / estimate(row))
            continue
        stops = [f["wall_s"] / estimate(row) for f in res.failures.get(key, []) if f["status"] == "stopped"]
        ratios.setdefault(row.kind, []).extend(r for r in stops[-1:] if r > 1.0)
    return {kind: statistics.median(v) for kind, v in ratios.items() if v}


def fits(now: float, est: float, deadline: float) -> bool:
    return now + est <= deadline


# ---------------------------------------------------------------------------------- running rows


def batches(chosen: list[tuple[str, Row]]) -> list[list[tuple[str, Row]]]:
    """Consecutive rows that may share a worker: speed rows (CUDA in the worker), or forking rows."""
    out: list[list[tuple[str, Row]]] = []
    for key, row in chosen:
        if not out or out[-1][-1][1].forks != row.forks:
            out.append([])
        out[-1].append((key, row))
    return out


def run_rows(chosen: list[tuple[str, Row]], out: Path, spawn: Callable[[list[tuple[str, Row]]], tuple[int, dict | None]],
             deadline: float) -> None:
    """Run the chosen rows in workers while the call has time. `spawn` returns the worker's exit code and
    the marker of the row it was inside when it ended, if any: that row is recorded (stopped at the
    deadline, or failed) and a new worker goes on with the rows after it."""
    for batch in batches(chosen):
        while batch and time.time() < deadline:
            rc, running = spawn(batch)
            if running is None:
                if rc != 0:  # died outside any row (e.g. at import): retrying would fail the same way
                    print(f"worker exited with {rc} outside its rows; stopping", flush=True)
                    return
                break
            name = next(r.name for k, r in batch if k == running["key"])
            status = "stopped" if time.time() >= deadline else "failed"
            why = "stopped at the call's deadline" if status == "stopped" else f"worker exited with {rc} in this row"
            append_line(out / ROWS_NAME, {"key": running["key"], "name": name, "status": status, "error": why,
                                          "wall_s": time.time() - running["t0"], "at": time.time()})
            print(f"    {status.upper()}: {name}: {why}", flush=True)
            batch = batch[[k for k, _ in batch].index(running["key"]) + 1:]  # the worker ran its rows in order


def marker_path(out: Path) -> Path:
    """Which row a worker is inside: beside $OUT's tree, not in it (what is in $OUT comes back)."""
    tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"gpu-suite-{tag}.running"


def spawn_worker(out: Path, ctx: dict[str, Any], seconds: Callable[[Row], float],
                 deadline: float) -> Callable[[list[tuple[str, Row]]], tuple[int, dict | None]]:
    """Runs a batch of rows in a child process (its own process group: a stopped worker takes the site
    processes it forked with it); the child starts a row only while its estimate fits the deadline."""
    marker = marker_path(out)

    def spawn(batch: list[tuple[str, Row]]) -> tuple[int, dict | None]:
        out.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as job:
            json.dump({"rows": [[k, asdict(r), seconds(r)] for k, r in batch], "ctx": ctx, "deadline": deadline,
                       "marker": str(marker)}, job, default=str)
        proc = subprocess.Popen([sys.executable, __file__, "--worker", job.name, "--out", str(out)],
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, deadline + GRACE_S - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            print(f"worker stopped {GRACE_S:.0f} s past the call's deadline", flush=True)
        os.unlink(job.name)
        running = json.loads(marker.read_text()) if marker.is_file() else None
        marker.unlink(missing_ok=True)
        return rc, running
    return spawn


def worker(job_path: Path, out: Path) -> int:
    """In a child process: run each row that fits, append its result the moment it ends."""
    import gpu_rows
    import gpu_runners

    job = json.loads(job_path.read_text())
    ctx, marker = job["ctx"], Path(job["marker"])
    env = gpu_rows.environment(ctx)
    for key, raw, est in job["rows"]:
        row = Row(**raw)
        left = job["deadline"] - time.time()
        print(f"--- {row.name}: estimated {est:.0f} s ({est / 60:.1f} device min); {left:.0f} s left in this call",
              flush=True)
        if not fits(time.time(), est, job["deadline"]):
            print("    not started: it would not end before the call's deadline (run the call again)", flush=True)
            continue
        t0 = time.time()
        marker.write_text(json.dumps({"key": key, "t0": t0}))
        try:
            result = gpu_runners.RUNNERS[row.kind](row.config, ctx)
        except Exception as e:  # one broken row must not cost the others; it is reported, not hidden
            first = " / ".join(f"{type(e).__name__}: {e}".strip().splitlines()[:2])[:400]
            append_line(out / ROWS_NAME, {"key": key, "name": row.name, "status": "failed", "error": first,
                                          "wall_s": time.time() - t0, "at": time.time()})
            marker.unlink()
            print(f"    FAILED: {first}", flush=True)
            continue
        append_line(out / ROWS_NAME, {"key": key, "name": row.name, "status": "done", "kind": row.kind,
                                      "config": row.config, "result": result, "wall_s": time.time() - t0,
                                      "env": env, "at": time.time()})
        marker.unlink()
        print(f"    done in {time.time() - t0:.1f} s: {gpu_runners.one_line(row.kind, result)}", flush=True)
    return 0


# ---------------------------------------------------------------------------------- the report's checks


def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0


def by_seed(results: dict[str, dict[str, Any]], group: str, setting: str) -> dict[int, float]:
    """Seed -> final validation loss of conv/<group>/<setting>/seed<s>."""
    prefix = f"conv/{group}/{setting}/seed"
    return {int(n.removeprefix(prefix)): e["result"]["val_loss"] for n, e in results.items() if n.startswith(prefix)}


def gap_closed(loss: float, single: float, dp: float) -> float:
    return (single - loss) / (single - dp) if single != dp else float("nan")


def paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """a - b on the seeds both have: the same initial weights and data order on both sides."""
    return [a[s] - b[s] for s in sorted(a.keys() & b.keys())]


def not_worse(diffs: list[float]) -> tuple[bool | None, str]:
    """Defaults minus the other, paired by seed: worse only if the mean difference exceeds twice its
    standard error. Needs 2+ paired seeds."""
    if len(diffs) < 2:
        return None, "-"
    m, sd = mean_std(diffs)
    se = sd / len(diffs) ** 0.5
    return m <= 2 * se, f"{m:+.4f} (2 SE {2 * se:.4f}, {len(diffs)} seeds)"


def checks(results: dict[str, dict[str, Any]], groups: Iterable[str], settings: Iterable[str]) -> list[dict[str, str]]:
    """The acceptance checks, fixed before any run. Status: met, NOT met, or pending (rows missing)."""
    out = []

    def add(what: str, measured: str, ok: bool | None) -> None:
        out.append({"check": what, "measured": measured, "status": "pending" if ok is None else "met" if ok else "NOT met"})

    for preset in ("150M", "1B"):
        r = (results.get(f"speed/bench-{preset}") or {}).get("result")
        add(f"inner step >= 1.0x the fair plain loop, {preset} bench shapes", "-" if r is None else f"{r['ratio']:.3f}x",
            None if r is None else r["ratio"] >= 1.0)
        ops = None if r is None else {loop: sorted(m.get("attention", {})) for loop, m in r["loops"].items()}
        add(f"both loops ran the same attention ops, {preset} bench shapes", "-" if ops is None else json.dumps(ops),
            None if ops is None else bool(ops["zeroband"]) and ops["zeroband"] == ops["plain"])
    r = (results.get("speed/shipped-1B") or {}).get("result")
    add(">= 40% MFU at 1B as configs/1B.toml ships", "-" if r is None else f"{100 * r['loops']['zeroband']['mfu']:.1f}%",
        None if r is None else r["loops"]["zeroband"]["mfu"] >= 0.40)
    r = (results.get("outer/1B") or {}).get("result")
    add("outer step at 1B: local work <= 3 s per rank", "-" if r is None else f"{r['local_s']:.2f} s",
        None if r is None else r["local_s"] <= 3.0)
    for g in groups:
        single, dp, d = (by_seed(results, g, s) for s in ("single", "dp", "defaults"))
        seeds = sorted(single.keys() & dp.keys() & d.keys())
        gap = gap_closed(*(mean_std([x[s] for s in seeds])[0] for x in (d, single, dp))) if seeds else None
        add(f"{g}: shipped defaults close >= 70% of the one-site -> data-parallel gap",
            "-" if gap is None else f"{100 * gap:.0f}% ({len(seeds)} seeds)", None if gap is None else gap >= 0.70)
        for other in settings:
            ok, text = not_worse(paired(d, by_seed(results, g, other)))
            add(f"{g}: shipped defaults not worse than {other} (paired seeds)", text, ok)
    return out


def checks_source_hash() -> str:
    src = "".join(inspect.getsource(f) for f in (checks, not_worse, paired, gap_closed, by_seed))
    return hashlib.sha1(src.encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------- main


def gpu_short(name: str) -> str:
    known = next((k for k in PEAK_TFLOPS if k in name), None)
    return (known or "".join(c if c.isalnum() else "-" for c in name).strip("-") or "gpu").lower()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--call", default=None, help="comma-separated call names (--dry-run lists them), or `next`")
    p.add_argument("--budget-s", type=float, default=None, help="the call's deadline in seconds (default: the call's own)")
    p.add_argument("--out", type=Path, default=None, help="where rows.jsonl and the report go (on the GPU: $OUT)")
    p.add_argument("--results", type=Path, action="append", default=[],
                   help="more rows.jsonl files whose rows are skipped (default: benchmarks/<gpu>/rows.jsonl too)")
    p.add_argument("--quick", action="store_true", help="tiny CPU versions of the rows (CI smoke test)")
    p.add_argument("--dry-run", action="store_true", help="print every call with its rows' estimates; run nothing")
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="fold these rows.jsonl into benchmarks/<gpu>/")
    p.add_argument("--gpu", default=None, help="GPU name for --dry-run on a machine without one (default H200)")
    p.add_argument("--data", type=Path, default=REPO / ".gpudata", help="prose-v2.jsonl.xz and tokenizers (--prepare)")
    p.add_argument("--corpus", type=Path, default=None, help="--quick: a jsonl corpus with a text field (its conv and shipped rows need one)")
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "zeroband-gpu-suite",
                   help="decompressed corpus and trained tokenizers")
    p.add_argument("--commit", default=None, help="the commit the rows name (default: .gpudata/COMMIT or .whl/COMMIT, else git)")
    p.add_argument("--prepare", action="store_true", help="write --data: the corpus and both tokenizers (CPU machine)")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def select_calls(names: str | None, all_calls: list[Any], rows: dict[str, tuple[str, Row]], res: Results) -> list[Any]:
    """The calls named (or `next`: the first with a row neither measured nor failed out)."""
    if names is None:
        raise SystemExit("gpu_suite.py: give --call NAME (--dry-run lists the calls in order) or --call next")
    by_name = {c.name: c for c in all_calls}
    if names == "next":
        todo = [c for c in all_calls if any(rows[r][0] not in res.done and not res.failed_out(rows[r][0]) for r in c.rows)]
        return todo[:1]
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"--call {','.join(unknown)}: no such call; choose from {', '.join(by_name)} or next")
    return [by_name[n] for n in names.split(",")]


def resolve_out(args: argparse.Namespace, gpu: str) -> Path:
    if args.out is None:
        return Path(tempfile.mkdtemp(prefix="gpu-suite-quick-")) if args.quick else REPO / "benchmarks" / gpu_short(gpu)
    if args.quick and any(d in args.out.resolve().parents for d in (REPO / "benchmarks", REPO / "docs")):
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
    if args.merge:
        return merge(args, gpu_rows)
    t_start = time.time()
    gpu = gpu_rows.device_name(args.quick, args.gpu or "NVIDIA H200", args.dry_run or bool(args.merge))
    out = resolve_out(args, gpu)
    scale = gpu_rows.QUICK if args.quick else gpu_rows.FULL
    rows = keyed(gpu_rows.plan_rows(scale), {kind: code_hash(kind) for kind in CODE_FILES}, gpu)
    kept = [] if args.quick else [REPO / "benchmarks" / gpu_short(gpu) / ROWS_NAME]
    res = Results.of(read_lines([*kept, *args.results, out / ROWS_NAME]))
    estimate = lambda r: gpu_rows.estimate_s(r, scale)  # noqa: E731
    factor = calibration(rows, res, estimate)
    seconds = lambda r: estimate(r) * factor.get(r.kind, 1.0)  # noqa: E731
    all_calls = gpu_rows.calls(scale)
    print(f"GPU suite for {gpu}; rows in {out / ROWS_NAME}; calibration (measured / estimated) {factor or 'none yet'}")
    if args.dry_run:
        print(gpu_rows.plan_text(all_calls, rows, set(res.done), seconds), flush=True)
        return 0
    chosen_calls = select_calls(args.call, all_calls, rows, res)
    budget = args.budget_s if args.budget_s is not None else sum(c.budget_s for c in chosen_calls)
    deadline = t_start + budget
    chosen = [rows[r] for c in chosen_calls for r in c.rows]
    todo = [(k, r) for k, r in chosen if k not in res.done and not res.failed_out(k)]
    print(f"calls {', '.join(c.name for c in chosen_calls) or '(none left)'}: {len(chosen) - len(todo)} rows already "
          f"measured, {len(todo)} to run, est {sum(seconds(r) for _, r in todo) / 60:.1f} device min; deadline in "
          f"{budget:.0f} s", flush=True)
    ctx = gpu_rows.context(args, scale, out, gpu)
    if todo:
        run_rows(todo, out, spawn_worker(out, ctx, seconds, deadline), deadline)
    res = Results.of(read_lines([*kept, *args.results, out / ROWS_NAME]))
    left = [r.name for k, r in chosen if k not in res.done]
    write_report(out, rows, res, ctx, scale)
    print(f"\n{len(chosen) - len(left)} of {len(chosen)} rows of this call measured in {time.time() - t_start:.0f} s; "
          + (f"left: {', '.join(left)} (run the same call again)" if left else "call complete")
          + f"; report: {out}/gpu_suite.md", flush=True)
    return 0


def write_report(out: Path, rows: dict[str, tuple[str, Row]], res: Results, ctx: dict[str, Any], scale: Any) -> None:
    from gpu_report import write_report as write
    from large_h import settings

    names = [n for n in settings(scale.conv_sites, 100) if n != "defaults"]
    groups = [g.name for g in scale.conv_groups]
    write(out, rows, res, ctx, lambda results: checks(results, groups, names), checks_source_hash(), MFU_DEFINITION)


def merge(args: argparse.Namespace, gpu_rows: Any) -> int:
    """Back on the CPU machine: append a call's new lines to benchmarks/<gpu>/rows.jsonl, rewrite its report."""
    entries = read_lines(args.merge)
    gpus = {e["env"]["gpu"] for e in entries if e["status"] == "done"}
    if len(gpus) != 1:
        raise SystemExit(f"--merge: the files hold rows of {len(gpus)} GPUs ({', '.join(sorted(gpus))}); merge one GPU's at a time")
    gpu = gpus.pop()
    out = args.out or REPO / "benchmarks" / gpu_short(gpu)
    have = {(e["key"], e["status"], e["at"]) for e in read_lines([out / ROWS_NAME])}
    new = [e for e in entries if (e["key"], e["status"], e["at"]) not in have]
    for e in new:
        append_line(out / ROWS_NAME, e)
    rows = keyed(gpu_rows.plan_rows(gpu_rows.FULL), {kind: code_hash(kind) for kind in CODE_FILES}, gpu)
    ctx = gpu_rows.context(args, gpu_rows.FULL, out, gpu)
    write_report(out, rows, Results.of(read_lines([out / ROWS_NAME])), ctx, gpu_rows.FULL)
    print(f"{len(new)} new lines into {out / ROWS_NAME}; report {out}/gpu_suite.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
