"""Late work (issue 37): a left-out site's round merged one round late, against dropping it.

    nice -n 10 python scripts/experiments/late.py             # the rows (cached per spec), then the report
    python scripts/experiments/late.py --report               # the report from the rows so far
    python scripts/experiments/late.py --quick --out /tmp/q   # pipeline check (~1 min)

The large-H study's regime (scripts/experiments/large_h.py: its 0.5M model, corpus sample, tokenizer,
inner lr, batch and the shipped outer settings; k = 4 sites, H = 100, 21 rounds), on the simulator
(`zeroband.sim`), 3 seeds. At each round but the last, with probability 1/2, one site (drawn among
those that were not late the round before) is late: the others merge without it, as an elastic round
does past its grace window (diloco.grace_s). What happens to that site's round is the row:
  ontime     nobody is late: the reference
  drop       the late round is dropped and the site waits out the next round as a joiner, bringing
             nothing (diloco.late_weight = 0, the elastic behaviour before late work)
  late_0.5   it brings the late round to the next merge with half a site's share (late_weight = 0.5)
  late_1     with a whole share (late_weight = 1)
The same seed draws the same schedule for every row, so rows are compared paired. In an elastic run
the late site trains nothing while it waits for the next round; here it trains (the sites step
together on one clock) and its fresh pseudo-gradient is thrown away in that round, so the merges are
those of the elastic run (zeroband/outer/diloco.py `offer`, called as the membership would).
"""

from __future__ import annotations

import json
import platform
import random
import sys
import time
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hetero as ht  # noqa: E402
import large_h as lh  # noqa: E402
from convergence import Spec, machine, shipped_default  # noqa: E402

H, SITES, SEEDS, ROUNDS, P_LATE = 100, 4, 3, 21, 0.5
ROWS = {"ontime": None, "drop": 0.0, "late_0.5": 0.5, "late_1": 1.0}  # row -> late_weight (None: nobody late)


def schedule(seed: int, rounds: int, sites: int = SITES, p: float = P_LATE) -> dict[int, int]:
    """Round (1-based) -> the site late at it; never the last round, never a site late the round before."""
    rng, out = random.Random(1000 + seed), {}
    for r in range(1, rounds):
        site = rng.randrange(sites)
        if rng.random() < p and out.get(r - 1) != site:
            out[r] = site
    return out


def specs(seeds: int) -> list[Spec]:
    out = []
    for seed in range(seeds):
        for row, weight in ROWS.items():
            extra = {} if weight is None else {"late": {"weight": weight, "p": P_LATE}}
            out.append(Spec(row, "diloco", SITES, ROUNDS * H, seed, h=H, **shipped_default(), extra=extra))
    return out


def tree_for(spec: Spec, corpus: Path, tokenizer: Path, work: Path) -> dict[str, Any]:
    return ht.tree_for(spec, corpus, tokenizer, work)


def key_of(spec: Spec, version: str) -> str:
    return ht.key_of(spec, version)  # its tree and spec (the late settings are in spec.extra)


# ---------------------------------------------------------------------------------- one run (child)

def lateness(late_at: dict[int, int], weight: float, events: list[dict[str, Any]]) -> Any:
    """An `outer` seam: each site's DiLoCo, late where `late_at` says. At its late round a site brings
    nothing (the others merge without it; it takes their merge, as a left-out site takes the run's
    state) and keeps its pseudo-gradient; at the next round it brings that, weighted by `weight` (0:
    nothing), in place of the round it would not have trained."""
    def wrap(outer: Any, model: Any) -> Any:
        site, original = outer.topology.world.site_rank, outer.sync
        kept: dict[str, Any] = {}

        def sync(self: Any, grads: Any, tokens: float = 0.0, t0: float | None = None, waited: float = 0.0) -> Any:
            r = self.clock.rounds  # this boundary's round (counted by the tick before it)
            if grads is not None and late_at.get(r) == site:
                kept["work"] = ([g.clone() for g in grads], tokens)
                events.append({"round": r, "site": site})
                return original(None, 0.0, t0, waited)
            if "work" in kept:
                work = kept.pop("work")
                if weight == 0:
                    return original(None, 0.0, t0, waited)
                self.offer = lambda g, attempt, age: (g, weight)  # what `offer` returns for late work
                try:
                    return original(work[0], work[1], t0, waited)
                finally:
                    del self.offer
            return original(grads, tokens, t0, waited)

        outer.sync = types.MethodType(sync, outer)
        return outer
    return wrap


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from zeroband import seams
    from zeroband.sim import run_sites

    torch.set_num_threads(1)
    spec = Spec(**job["spec"])
    tree = tree_for(spec, Path(job["corpus"]), Path(job["tokenizer"]), Path(job["work"]))
    late = spec.extra.get("late")
    late_at = schedule(spec.seed, spec.steps // spec.h) if late else {}
    events: list[dict[str, Any]] = []
    start = time.perf_counter()
    seams.use(seams.Seams(outer=lateness(late_at, late["weight"] if late else 0.0, events)))
    try:
        result = run_sites(tree, spec.sites, eval_on=lambda s: s == 0)
    finally:
        seams.use(None)
    records = lh.read_metrics(Path(result["run_dir"]) / "metrics.jsonl")
    val = [r for r in records if r["kind"] == "val"]
    outer = [r for r in records if r["kind"] == "outer"]
    return {**asdict(spec), "val_loss": val[-1]["val_loss"], "late_rounds": len(late_at),
            "late_events": len(events), "sites_used": [r["sites_used"] for r in outer],
            "outer_steps": len(outer), "wall_s": time.perf_counter() - start}


def child_main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    if job["quick"]:
        lh.MODELS[ht.MODEL] = lh.CANARY_MODEL
    ht.write_row(job, run_one(job))
    return 0


# ---------------------------------------------------------------------------------- report

def report(ctx: dict[str, Any]) -> str:
    rows = ht.load(ctx)
    by = {(r["row"], r["seed"]): r for r in rows}
    lines = ["# Late work: merged one round late, or dropped", "",
             f"`{ctx['command']}` (rows: `late.json`). Code version {ctx['version']} (the large-H study's canary); rows "
             f"run at {', '.join(sorted({r['commit'] for r in rows})) or '-'}, report at {ctx['commit']}; {machine()}.", "",
             f"Validation loss, {SITES} sites of the {ht.MODEL} model of the large-H study, H = {H}, {ROUNDS} rounds; at "
             f"each round but the last, with probability {P_LATE}, one site is late (the same schedule for every row of a "
             "seed). `vs ontime` and `vs drop`: paired differences at the same seed (mean ± standard error).", "",
             "| row | late_weight | seeds | late rounds | val loss (mean ± sd) | vs ontime | vs drop |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def paired(a: str, b: str) -> str:
        d = [100 * (by[(a, k)]["val_loss"] / by[(b, k)]["val_loss"] - 1) for k in range(SEEDS) if (a, k) in by and (b, k) in by]
        return "" if a == b else ht.paired_cell(d)

    for name, weight in ROWS.items():
        rs = sorted((r for r in rows if r["row"] == name), key=lambda r: r["seed"])
        if not rs:
            lines.append(f"| {name} | {weight if weight is not None else ''} | 0 | | pending | | |")
            continue
        late = "/".join(str(r["late_rounds"]) for r in rs)
        lines.append(f"| {name} | {'' if weight is None else weight} | {len(rs)} | {late} | {ht.loss_cell(rs)} | "
                     f"{paired(name, 'ontime')} | {'' if weight is None else paired(name, 'drop')} |")
    lines += ["", "Rows: `ontime` nobody late; `drop` the late round dropped and the site a joiner the next round "
              "(late_weight = 0); `late_0.5` and `late_1` the late round merged at the next round with that share. "
              "`late rounds`: per seed, rounds at which a site was late."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = ht.study_parser(__doc__, SEEDS).parse_args(argv)
    if args.one:
        return child_main(args.one)
    global H
    if args.quick:  # the canary's model, 4-step rounds
        lh.MODELS[ht.MODEL] = lh.CANARY_MODEL
        H = ht.H = 4
        args.seeds = 1
    ctx = ht.study_context(args, "late", "python scripts/experiments/late.py")
    if not args.report:
        have = {r["key"] for r in ht.load(ctx)}
        jobs = [(k, ht.job_for(s, k, ctx, args.quick)) for s in specs(args.seeds)
                if (k := key_of(s, ctx["version"])) not in have]
        ht.run_jobs(jobs, ctx, args.workers, args.nice, script=__file__)
    (args.out / "late.md").write_text(report(ctx))
    (args.out / "late.json").write_text(json.dumps({"python": platform.python_version(), "rows": ht.load(ctx)}, indent=1))
    print(f"wrote {args.out / 'late.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
