"""Convergence evidence: one site vs cross-site data parallel vs DiLoCo (the shape of DiLoCo's Table 2).

    flock /tmp/zeroband-bench.lock python scripts/experiments/diloco_vs_dp.py            # full, ~40-60 min
    python scripts/experiments/diloco_vs_dp.py --quick --out /tmp/q                      # pipeline check, <5 min

Token accounting (DiLoCo paper, Table 2): every row runs T inner steps of batch B per site.
baseline = 1 site (T*B sequences); data parallel = k sites averaging fp32 gradients every step
(global batch k*B, T steps); DiLoCo = k sites, each batch B for T steps, syncing every H steps.
DP and DiLoCo rows therefore see the same k*T*B sequences; "baseline, k x tokens" is one site run
for k*T steps at batch B (same tokens as DP/DiLoCo, k x the sequential steps; --equal-token-baseline).
Writes diloco_vs_dp.md / .json and val_loss_vs_tokens.png / val_loss_vs_bytes.png into --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exp_data import DEFAULT_CACHE, prepare_tokenizer, shared_corpus  # noqa: E402
from exp_report import write_report  # noqa: E402
from exp_runner import RunSpec, run_one, run_side_by_side  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUTER_LRS = (0.5, 0.7, 1.0)


@dataclass(frozen=True)
class Scale:
    model: dict[str, int]
    vocab: int
    seq_len: int
    batch: int
    steps: int
    sites: int
    h_main: int
    h_alt: int
    seeds: int
    lr: float
    warmup: int
    eval_interval: int
    eval_batches: int
    tune_steps: int


FULL = Scale(model=dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352), vocab=2048, seq_len=128,
             batch=4, steps=120, sites=4, h_main=20, h_alt=60, seeds=3, lr=3e-3, warmup=8,
             eval_interval=40, eval_batches=32, tune_steps=60)
QUICK = Scale(model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176), vocab=512, seq_len=64,
              batch=4, steps=24, sites=2, h_main=6, h_alt=12, seeds=1, lr=3e-3, warmup=2,
              eval_interval=12, eval_batches=4, tune_steps=12)


def base_tree(scale: Scale, corpus: Path, tokenizer: Path) -> dict[str, Any]:
    """Everything the rows share: model, data, inner optimizer, batch, evaluation."""
    return {
        "model": {**scale.model, "vocab_size": scale.vocab, "max_seq_len": scale.seq_len},
        "data": {"path": str(corpus), "tokenizer": str(tokenizer), "seq_len": scale.seq_len, "val_fraction": 0.02},
        "optim": {"lr": scale.lr, "warmup_steps": scale.warmup, "schedule": "cosine", "min_lr_ratio": 0.1,
                  "weight_decay": 0.1, "grad_clip": 1.0},
        "train": {"global_batch": scale.batch, "micro_batch": scale.batch},
        "eval": {"interval": scale.eval_interval, "batches": scale.eval_batches},
        "log": {"interval": scale.eval_interval},
    }


def seeds(n: int) -> list[int]:
    return list(range(n))


def baseline_specs(scale: Scale, equal_tokens: bool) -> list[RunSpec]:
    specs = [RunSpec("baseline", "single", 1, scale.steps, s) for s in seeds(scale.seeds)]
    if equal_tokens:
        specs.append(RunSpec("baseline_kx_tokens", "single", 1, scale.steps * scale.sites, 0))
    return specs


def multisite_specs(scale: Scale, outer_lr: float) -> list[RunSpec]:
    k, t, h = scale.sites, scale.steps, scale.h_main
    dl = RunSpec("", "diloco", k, t, 0, h=h, outer_lr=outer_lr)
    specs = [RunSpec("data_parallel", "dp", k, t, s) for s in seeds(scale.seeds)]
    specs += [replace(dl, row=f"diloco_H{h}_fp32", seed=s) for s in seeds(scale.seeds)]
    specs += [replace(dl, row=f"diloco_H{h}_fp16", seed=s, comm="fp16") for s in seeds(scale.seeds)]
    specs += [replace(dl, row=f"diloco_H{scale.h_alt}_fp32", h=scale.h_alt)]
    specs += [replace(dl, row=f"diloco_H{h}_int8_ef", comm="int8", error_feedback=True),
              replace(dl, row=f"diloco_H{h}_int4_ef", comm="int4", error_feedback=True),
              replace(dl, row=f"diloco_H{h}_fp16_overlap", comm="fp16", overlap=True)]
    return specs


def tune_outer_lr(scale: Scale, base: dict[str, Any], work: Path, log: list[dict[str, Any]]) -> float:
    """DiLoCo fp32 at H_main, seed 100, tune_steps steps: the outer lr with the lowest final val loss."""
    results = []
    for lr in OUTER_LRS:
        spec = RunSpec(f"tune_outer_lr_{lr}", "diloco", scale.sites, scale.tune_steps, 100, h=scale.h_main, outer_lr=lr)
        results.append(timed(run_one, spec, base, work, log))
    best = min(results, key=lambda r: r["val_loss"])
    return float(best["outer_lr"])


def timed(fn: Any, spec: RunSpec, base: dict[str, Any], work: Path, log: list[dict[str, Any]]) -> dict[str, Any]:
    result = fn(spec, base, work, 3600.0)
    log.append(result)
    print(f"  {spec.row} seed {spec.seed}: val_loss {result['val_loss']:.4f} ppl {result['val_ppl']:.2f} "
          f"wall {result['wall_s']:.0f}s", flush=True)
    return result


def run_baselines(specs: list[RunSpec], base: dict[str, Any], work: Path, log: list[dict[str, Any]]) -> None:
    """One-site runs two at a time (one process per core); the longest is paired with the shortest."""
    specs = sorted(specs, key=lambda s: s.steps)
    while specs:
        pair = [specs.pop(0)] + ([specs.pop()] if specs else [])
        for result in run_side_by_side(pair, base, work, 3600.0):
            log.append(result)
            print(f"  {result['row']} seed {result['seed']}: val_loss {result['val_loss']:.4f} "
                  f"wall {result['wall_s']:.0f}s", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, k=2, 1 seed: checks the pipeline (< 5 min)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results", help="where the md/json/png go")
    p.add_argument("--corpus", type=Path, default=None, help="jsonl corpus (default: the shared prose-v1)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="decompressed corpus + tokenizers")
    p.add_argument("--steps", type=int, default=None, help="override T (inner steps per row)")
    p.add_argument("--equal-token-baseline", action="store_true",
                   help="also run one site for k x T steps (the DP/DiLoCo token count; costs ~2 DiLoCo rows)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = QUICK if args.quick else FULL
    if args.steps:
        scale = replace(scale, steps=args.steps, tune_steps=args.steps // 2)
    start = time.time()
    corpus = args.corpus or shared_corpus(args.cache)
    tokenizer = prepare_tokenizer(corpus, scale.vocab, 0.02, args.cache)
    base = base_tree(scale, corpus, tokenizer)
    from bench_common import load_average, prewarm

    prewarm()
    load_before = load_average()
    log: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zb-exp-") as tmp:
        work = Path(tmp)
        print(f"tuning outer lr over {OUTER_LRS}", flush=True)
        outer_lr = tune_outer_lr(scale, base, work, log)
        print(f"chosen outer lr {outer_lr}; baselines", flush=True)
        run_baselines(baseline_specs(scale, args.equal_token_baseline), base, work, log)
        for spec in multisite_specs(scale, outer_lr):
            timed(run_one, spec, base, work, log)
    meta = {"command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]]),
            "scale": scale.__dict__, "outer_lr": outer_lr, "corpus": str(corpus), "tokenizer": str(tokenizer),
            "base_config": base, "total_wall_s": time.time() - start, "load_before": load_before,
            "load_after": load_average(), "quick": args.quick}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diloco_vs_dp.json").write_text(json.dumps({"meta": meta, "runs": log}, indent=1) + "\n")
    write_report(args.out, meta, log)
    print(f"done in {meta['total_wall_s'] / 60:.1f} min -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
