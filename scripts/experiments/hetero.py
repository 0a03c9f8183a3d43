"""Sites of different speeds (issue 37): rounds of a time budget against the synchronous rule.

    nice -n 10 python scripts/experiments/hetero.py            # the loss rows (cached per spec), then the report
    python scripts/experiments/hetero.py --utilisation         # the real-clock part (adds to the report)
    python scripts/experiments/hetero.py --report              # the report from the rows so far
    python scripts/experiments/hetero.py --quick --out /tmp/q  # pipeline check (~1 min)

The large-H study's regime (scripts/experiments/large_h.py: its 0.5M model, corpus sample, tokenizer,
inner lr, batch and the shipped outer settings; k = 4 sites, H = 100), one of the 4 sites at half speed.

Loss, on the simulator (`zeroband.sim`) with a virtual clock (`StepClock`: a fast site's inner step
takes 1 s, the slow site's 2 s), so the numbers are the same on every run, at 3 seeds:
  equal        4 equal sites, 21 rounds of H = 100 (8,400 site-steps): the reference
  budget_half  diloco.round_seconds = 100: the fast sites run 100 steps a round, the slow one 50, the
               merge weighs each by its tokens; 24 rounds make the same 8,400 site-steps (equal tokens)
  sync_wall    the synchronous rule at the budget run's wall time: every round waits for the slow
               site's 100 steps (200 s), so 2,400 s hold 12 rounds; the arithmetic of 4 equal sites
  drop_slow    the synchronous rule that leaves the slow site out (a quorum of 3): 3 equal sites,
               24 rounds of 100 s, the slow site's compute lost
  budget_half_rda  budget_half merged by radial-directional averaging (diloco.merge = "rda")
The synchronous rule at equal tokens computes exactly what `equal` computes (it waits, then merges the
same pseudo-gradients), so its loss is `equal`'s; what it costs is time, which the utilisation part measures.

Utilisation (--utilisation), on the simulator with the wall clock: 4 sites on threads, site 3 throttled
to half speed (it sleeps as long as each of its inner steps took), back to back in one process: the
time budget, the time budget with the exchange overlapped (each average lands at the next boundary),
and the synchronous rule (H = a fast site's steps per budget round). A site's utilisation here is the share of its wall time
outside the outer loop's boundaries (between its first and last inner step): what it spent computing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import large_h as lh  # noqa: E402
from convergence import Spec, machine, shipped_default, source_commit  # noqa: E402
from exp_data import prepare_tokenizer  # noqa: E402

H, SITES, SEEDS, MODEL = 100, 4, 3, "0.5M"
SLOW = [1.0, 1.0, 1.0, 2.0]  # seconds per inner step (virtual): site 3 at half speed
# (row, sites, train.steps, round_seconds or 0, step_s or None): train.steps // H rounds each
ROWS = [("equal", 4, 2100, 0.0, None), ("budget_half", 4, 2400, 100.0, SLOW),
        ("sync_wall", 4, 1200, 0.0, None), ("drop_slow", 3, 2400, 0.0, None),
        ("budget_half_rda", 4, 2400, 100.0, SLOW)]
MERGE = {"budget_half_rda": "rda"}  # Decoupled DiLoCo's radial-directional averaging with the budget


def specs(seeds: int) -> list[Spec]:
    out = []
    for seed in range(seeds):
        for row, sites, steps, budget, step_s in ROWS:
            extra: dict[str, Any] = {"diloco": {"round_seconds": budget}} if budget else {}
            if row in MERGE:
                extra["diloco"]["merge"] = MERGE[row]
            if step_s:
                extra["sim"] = {"step_s": step_s}
            out.append(Spec(row, "diloco", sites, steps, seed, h=H, **shipped_default(), extra=extra))
    return out


def site_steps(spec: Spec) -> int:
    """Inner steps of all sites together: what the run's tokens are counted by."""
    step_s = spec.extra.get("sim", {}).get("step_s")
    if not step_s:
        return spec.sites * spec.steps
    budget = spec.extra["diloco"]["round_seconds"]
    return spec.steps // spec.h * sum(int(budget // s) for s in step_s)


def tree_for(spec: Spec, corpus: Path, tokenizer: Path, work: Path) -> dict[str, Any]:
    """The study's tree for this spec, without checkpoints: a slow site's steps are not a fast one's,
    so a run stopped halfway starts again (each lasts minutes)."""
    tree = lh.tree_for(lh.Run("hetero", MODEL, H, spec), corpus, tokenizer, work)
    tree["checkpoint"] = {"interval": 0, "resume": "none", "save_at_end": False, "keep_last": 1}
    return tree


def key_of(spec: Spec, version: str) -> str:
    tree = tree_for(spec, Path("corpus"), Path("tokenizer"), Path("work"))
    raw = json.dumps({"tree": tree, "spec": asdict(spec), "version": version}, sort_keys=True)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- one run (child)

def run_one(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from zeroband.sim import run_sites

    torch.set_num_threads(1)
    spec = Spec(**job["spec"])
    tree = tree_for(spec, Path(job["corpus"]), Path(job["tokenizer"]), Path(job["work"]))
    start = time.perf_counter()
    result = run_sites(tree, spec.sites, eval_on=lambda s: s == 0, step_s=spec.extra.get("sim", {}).get("step_s"))
    records = lh.read_metrics(Path(result["run_dir"]) / "metrics.jsonl")
    val = [r for r in records if r["kind"] == "val"]
    tokens = site_steps(spec) * lh.BATCH * lh.SEQ_LEN
    return {**asdict(spec), "val_loss": val[-1]["val_loss"], "tokens": tokens, "site_steps": site_steps(spec),
            "outer_steps": len([r for r in records if r["kind"] == "outer"]), "wall_s": time.perf_counter() - start}


def child_main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    if job["quick"]:
        lh.MODELS[MODEL] = lh.CANARY_MODEL
    write_row(job, utilisation(job) if job["spec"]["row"] == "utilisation" else run_one(job))
    return 0


def write_row(job: dict[str, Any], out: dict[str, Any]) -> None:
    out.update(key=job["key"], version=job["version"], commit=job["commit"])
    tmp = Path(job["out"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(job["out"])  # a row file exists only complete


# ---------------------------------------------------------------------------------- utilisation (child)

class Throttled:
    """A site's outer method, seen from the loop: slowed by `factor` (it sleeps factor - 1 times each
    inner step's time) and timed: the seconds spent inside boundaries (waiting and outer steps)."""

    def __init__(self, outer: Any, factor: float) -> None:
        object.__setattr__(self, "inner", outer)
        object.__setattr__(self, "t", {"factor": factor, "last": None, "first": None, "boundary_s": 0.0,
                                       "sleep_s": 0.0, "steps": 0})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def after_inner_step(self, step: int, sync_point: bool = False) -> Any:
        t, now = self.t, time.perf_counter()
        if t["last"] is not None and t["factor"] > 1:
            nap = (now - t["last"]) * (t["factor"] - 1)
            time.sleep(nap)
            t["sleep_s"] += nap
        t["first"] = t["first"] or now
        t0 = time.perf_counter()
        out = self.inner.after_inner_step(step, sync_point)
        t["last"] = time.perf_counter()
        t["steps"] += 1
        if out is not None:
            t["boundary_s"] += t["last"] - t0
        return out


def utilisation(job: dict[str, Any]) -> dict[str, Any]:
    """The time budget, then the synchronous rule, each with site 3 at half speed, on the wall clock."""
    import torch

    from zeroband import seams
    from zeroband.sim import run_sites

    torch.set_num_threads(1)
    spec, q = Spec(**job["spec"]), job["quick"]
    rounds, budget = (2, 3.0) if q else (6, 20.0)
    out: dict[str, Any] = {"row": "utilisation", "rounds": rounds, "round_seconds": budget, "load_before": os.getloadavg()[0]}
    h_sync = 0
    for rule in ("budget", "budget_overlap", "sync"):
        sites: dict[int, Throttled] = {}

        def wrap(outer: Any, model: Any, sites: dict[int, Throttled] = sites) -> Any:
            site = outer.topology.world.site_rank
            sites[site] = Throttled(outer, 2.0 if site == SITES - 1 else 1.0)
            return sites[site]

        timed = rule != "sync"
        diloco = {"round_seconds": budget, "overlap": rule == "budget_overlap"} if timed else {"inner_steps": h_sync}
        s = Spec("utilisation", "diloco", SITES, rounds * (H if timed else h_sync), spec.seed,
                 h=H if timed else h_sync, **shipped_default(), extra={"diloco": diloco})
        tree = tree_for(s, Path(job["corpus"]), Path(job["tokenizer"]), Path(job["work"]) / rule)
        tree["eval"] = {"interval": 0, "batches": 1}
        seams.use(seams.Seams(outer=wrap))
        try:
            run_sites(tree, SITES, eval_on=lambda _: False)
        finally:
            seams.use(None)
        per_site = {}
        for site, w in sorted(sites.items()):
            total = w.t["last"] - w.t["first"]
            per_site[site] = {"steps": w.t["steps"], "wall_s": total, "boundary_s": w.t["boundary_s"],
                              "utilisation": 1 - w.t["boundary_s"] / total}
        out[rule] = per_site
        if rule == "budget":  # the synchronous rule's H: the steps a fast site ran per round of the budget
            h_sync = max(1, round(statistics.median(per_site[s]["steps"] for s in range(SITES - 1)) / rounds))
    out["h_sync"], out["load_after"] = h_sync, os.getloadavg()[0]
    return out


# ---------------------------------------------------------------------------------- driver

def run_jobs(jobs: list[tuple[str, dict[str, Any]]], ctx: dict[str, Any], workers: int, nice: int,
             script: str = __file__) -> None:
    """Each job in a child process (a torch import each: `script --one JOB`), `workers` at a time."""
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < workers:
            key, job = pending.pop(0)
            path = ctx["jobs"] / f"{key}.json"
            path.write_text(json.dumps(job))
            log = open(ctx["log"] / f"{key}.log", "ab")
            proc = subprocess.Popen([sys.executable, script, "--one", str(path)], stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda: os.nice(nice) if nice else None)
            running.append((key, job, proc, time.time()))
            print(f"{time.strftime('%H:%M:%S')} start {job['spec']['row']} seed {job['spec']['seed']} ({key})", flush=True)
        time.sleep(0.5)
        for item in list(running):
            key, job, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                how = "done" if Path(job["out"]).is_file() else f"FAILED rc {proc.returncode} (log {ctx['log'] / key}.log)"
                print(f"{time.strftime('%H:%M:%S')} {job['spec']['row']} seed {job['spec']['seed']}: {how} "
                      f"in {time.time() - t0:.0f} s", flush=True)


def job_for(spec: Spec, key: str, ctx: dict[str, Any], quick: bool) -> dict[str, Any]:
    return {"spec": asdict(spec), "key": key, "version": ctx["version"], "commit": ctx["commit"], "quick": quick,
            "corpus": str(ctx["corpus"]), "tokenizer": str(ctx["tokenizer"]), "work": str(ctx["work"] / key),
            "out": str(ctx["rows"] / f"{key}.json")}


def load(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [json.loads(p.read_text()) for p in sorted(ctx["rows"].glob("*.json"))]
    return [r for r in rows if r.get("version") == ctx["version"]]


def loss_cell(rows: list[dict[str, Any]]) -> str:
    """Mean validation loss of `rows`, ± their standard deviation where there are two or more."""
    vals = [r["val_loss"] for r in rows]
    sd = f" ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else ""
    return f"{statistics.mean(vals):.4f}{sd}"


def paired_cell(diffs: list[float]) -> str:
    """Mean of paired differences (%), ± their standard error where there are two or more; "" for none."""
    if not diffs:
        return ""
    se = f" ± {statistics.stdev(diffs) / len(diffs) ** 0.5:.2f}%" if len(diffs) > 1 else ""
    return f"{statistics.mean(diffs):+.2f}%{se}"


def report(ctx: dict[str, Any]) -> str:
    rows = load(ctx)
    loss = [r for r in rows if r["row"] != "utilisation"]
    ref = {r["seed"]: r["val_loss"] for r in loss if r["row"] == "equal"}
    lines = ["# Sites of different speeds: a time budget against the synchronous rule", "",
             f"`{ctx['command']}` (rows: `hetero.json`). Code version {ctx['version']} (the large-H study's canary), "
             f"commit {ctx['commit']}; {machine()}.", "",
             f"Validation loss, 4 sites of the {MODEL} model of the large-H study, H = {H}, one site at half speed (virtual clock), seeds as "
             "shown; `vs equal`: the paired difference to 4 equal sites at the same seed (mean ± standard error).", "",
             "| row | seeds | site-steps (tokens / 256) | val loss (mean ± sd) | vs equal |", "|---|---:|---:|---:|---:|"]
    for name, *_ in ROWS:
        rs = sorted((r for r in loss if r["row"] == name), key=lambda r: r["seed"])
        if not rs:
            lines.append(f"| {name} | 0 | | pending | |")
            continue
        diffs = [100 * (r["val_loss"] / ref[r["seed"]] - 1) for r in rs if r["seed"] in ref]
        vs = "" if name == "equal" else paired_cell(diffs)
        lines.append(f"| {name} | {len(rs)} | {rs[0]['site_steps']:,} | {loss_cell(rs)} | {vs} |")
    by = {(r["row"], r["seed"]): r["val_loss"] for r in loss}
    for a, b, what in (("budget_half", "drop_slow", "the same wall time"), ("budget_half_rda", "budget_half", "the merge rule")):
        pairs = [100 * (by[(a, k)] / by[(b, k)] - 1) for k in range(SEEDS) if (a, k) in by and (b, k) in by]
        if len(pairs) > 1:
            lines += ["", f"{a} against {b} ({what}): {statistics.mean(pairs):+.2f}% ± "
                      f"{statistics.stdev(pairs) / len(pairs) ** 0.5:.2f}% (paired, {len(pairs)} seeds)."]
    lines += ["", "Rows: `equal` 4 equal sites, 21 rounds; `budget_half` diloco.round_seconds, the slow site "
              "runs half the steps of each round, weighted by tokens, 24 rounds (the same tokens); `sync_wall` "
              "the synchronous rule at the budget's wall time (12 rounds of the slow site's pace); `drop_slow` "
              "the synchronous rule leaving the slow site out (3 sites, 24 rounds); `budget_half_rda` the budget "
              "merged by radial-directional averaging. The synchronous rule at "
              "equal tokens computes what `equal` computes, at twice its wall time."]
    util = [r for r in rows if r["row"] == "utilisation"]
    if util:
        u = util[-1]
        lines += ["", f"Utilisation on the wall clock (`--utilisation`): {u['rounds']} rounds, site 3 at half speed, load "
                  f"{u['load_before']:.1f} before / {u['load_after']:.1f} after; the synchronous rule ran with "
                  f"H = {u['h_sync']} (a fast site's steps per budget round).", "",
                  "| rule | site | inner steps | wall s | at boundaries s | utilisation |", "|---|---:|---:|---:|---:|---:|"]
        for rule in ("budget", "budget_overlap", "sync"):
            for site, s in u[rule].items():
                lines.append(f"| {rule} | {site} | {s['steps']} | {s['wall_s']:.1f} | {s['boundary_s']:.1f} | "
                             f"{100 * s['utilisation']:.1f}% |")
    return "\n".join(lines) + "\n"


def study_parser(doc: str | None, seeds: int) -> argparse.ArgumentParser:
    """The options this study and its siblings (late.py) share."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--seeds", type=int, default=seeds)
    p.add_argument("--report", action="store_true")
    p.add_argument("--quick", action="store_true", help="a tiny model and a few steps: checks the pipeline")
    p.add_argument("--out", type=Path, default=lh.RESULTS)
    p.add_argument("--cache", type=Path, default=lh.DEFAULT_CACHE / "large_h")
    p.add_argument("--shared-corpus", type=Path, default=lh.PROSE_V2_DEFAULT, help="prose-v2.jsonl.xz")
    p.add_argument("--corpus", type=Path, default=None, help="any jsonl corpus instead of the prose-v2 sample")
    p.add_argument("--one", help=argparse.SUPPRESS)
    return p


def study_context(args: argparse.Namespace, name: str, command: str) -> dict[str, Any]:
    """Corpus, tokenizer, folders and code version of study `name` (rows under OUT/name)."""
    corpus = args.corpus or lh.sample_corpus(args.cache, args.shared_corpus)
    work = args.cache / (f"{name}-quick" if args.quick else name)
    ctx: dict[str, Any] = {"corpus": corpus, "tokenizer": prepare_tokenizer(corpus, lh.VOCAB, 0.02, args.cache),
                           "commit": source_commit(), "work": work, "jobs": work / "jobs", "log": work / "logs",
                           "rows": args.out / name, "command": command}
    for d in (ctx["rows"], ctx["jobs"], ctx["log"]):
        d.mkdir(parents=True, exist_ok=True)
    ctx["version"] = lh.code_version({**ctx, "work": args.cache / "work"}, args.nice)
    print(f"code version {ctx['version']}", flush=True)
    return ctx


def main(argv: list[str] | None = None) -> int:
    p = study_parser(__doc__, SEEDS)
    p.add_argument("--utilisation", action="store_true", help="the wall-clock part instead of the loss rows")
    args = p.parse_args(argv)
    if args.one:
        return child_main(args.one)
    global ROWS, H
    if args.quick:  # the canary's model, 4-step rounds
        lh.MODELS[MODEL] = lh.CANARY_MODEL
        H, ROWS = 4, [(r, s, steps * 4 // 100, b * 4 / 100, st) for r, s, steps, b, st in ROWS]
        args.seeds = 1
    ctx = study_context(args, "hetero", "python scripts/experiments/hetero.py" + (" --utilisation" if args.utilisation else ""))
    if not args.report:
        todo = [Spec("utilisation", "diloco", SITES, 0, 0)] if args.utilisation else specs(args.seeds)
        have = {r["key"] for r in load(ctx)}
        jobs = [(k, job_for(s, k, ctx, args.quick)) for s in todo
                if (k := key_of(s, ctx["version"])) not in have or args.utilisation]
        run_jobs(jobs, ctx, 1 if args.utilisation else args.workers, args.nice)
    (args.out / "hetero.md").write_text(report(ctx))
    (args.out / "hetero.json").write_text(json.dumps({"python": platform.python_version(), "rows": load(ctx)}, indent=1))
    print(f"wrote {args.out / 'hetero.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
