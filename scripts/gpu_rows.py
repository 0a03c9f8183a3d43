"""The rows of scripts/gpu_suite.py: what each measures, how long it should take, and the report.

Row kinds (each runs in a worker process of gpu_suite.py):
- speed: one GPU, zeroband's inner step against the fair plain loop (transformers' LlamaForCausalLM,
  sdpa attention on the causal path with no mask built, use_cache=False, bf16 autocast, fused AdamW,
  torch.compile of the model, the same shapes, batch and gradient clipping), both timed in one process.
  "bench" rows: the bench shapes (vocab 4096, random tokens, one micro-batch per step). "shipped" rows:
  configs/150M.toml and configs/1B.toml as they ship (vocab, activation checkpointing, micro-batch,
  accumulation), with the trainer's data loader on real text inside the timed loop, for both loops.
- outer: the outer step of configs/1B.toml's model (its real parameter shapes and [diloco] settings),
  2 sites x 1 rank sharing the GPU over authenticated gloo, as scripts/bench_step.py measures it.
- conv: one run of the simulator (zeroband.sim: k sites as threads of one process, the trainer's
  loop and DiLoCo code) on prose-v2, bf16, on the GPU.
"""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_suite import PEAK_TFLOPS, REPO, Row

PROSE_V2 = "prose-v2.jsonl.xz"
PROSE_V2_SHA256 = "ffc3e6d4e34485675d72c8e6281127dedf9224a94ff69304921b906b7bf03410"
TOKENIZER_SAMPLE_MB = 20  # train-split text the BPE is trained on (a 20 MB sample: 4 s at 4k, docs/data)
CAUSAL_SDPA = "sdpa_causal"
# Where a checkout finds the shared corpus: ../shared/data beside it (or beside its worktrees' parent).
SHARED_DATA = (REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data")


@dataclass(frozen=True)
class SuiteScale:
    """Every size the suite's rows use: the GPU scale, or the tiny CPU smoke test."""

    quick: bool
    device: str
    bf16: bool
    compile: bool
    bench: dict[str, Any]  # row label -> (preset, seq, batch)
    bench_steps: tuple[int, int]  # warm-up, timed
    shipped: dict[str, str]  # row label -> config file
    shipped_overrides: tuple[str, ...]  # quick: shrink the model
    shipped_steps: tuple[int, int]  # optimizer steps (each of global_batch sequences)
    outer_config: str
    outer_repeats: int
    outer_threads: int
    conv_model: dict[str, int]
    conv_vocab: int
    conv_seq: int
    conv_batch: int  # sequences per step per site
    conv_steps: int  # T
    conv_sites: int  # k
    conv_hs: tuple[int, ...]
    conv_lr: float
    conv_dp_lrs: tuple[float, ...]
    conv_seeds: tuple[int, ...]
    conv_warmup: int
    conv_eval_interval: int
    conv_eval_batches: int
    bench_vocab: int = 4096


FULL = SuiteScale(
    quick=False, device="cuda", bf16=True, compile=True,
    bench={"150M": ("150M", 1024, 16), "1B": ("1B", 2048, 8)}, bench_steps=(5, 20),
    shipped={"150M": "configs/150M.toml", "1B": "configs/1B.toml"}, shipped_overrides=(), shipped_steps=(1, 2),
    outer_config="configs/1B.toml", outer_repeats=3, outer_threads=8,
    # ~27.8M parameters; T = 4000 steps of 12 x 256 tokens per site: 49M tokens per 4-site row (~0.75 epoch
    # of prose-v2's ~65M train tokens at vocab 4k); H = 100: 40 outer steps, H = 500: 8.
    conv_model=dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408), conv_vocab=4096, conv_seq=256,
    conv_batch=12, conv_steps=4000, conv_sites=4, conv_hs=(100, 500), conv_lr=1e-3, conv_dp_lrs=(1e-3, 2e-3, 4e-3),
    conv_seeds=(0, 1), conv_warmup=100, conv_eval_interval=500, conv_eval_batches=32,
)
QUICK = SuiteScale(
    quick=True, device="cpu", bf16=False, compile=False,
    bench={"150M": ("debug", 64, 2), "1B": ("debug", 32, 2)}, bench_steps=(1, 2),
    shipped={"150M": "configs/150M.toml", "1B": "configs/1B.toml"},
    shipped_overrides=("--model.preset", "debug", "--data.seq_len", "32", "--model.max_seq_len", "32",
                       "--train.micro_batch", "2", "--train.global_batch", "4"), shipped_steps=(1, 1),
    outer_config="configs/1B.toml", outer_repeats=1, outer_threads=1,
    conv_model=dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64), conv_vocab=384, conv_seq=32,
    conv_batch=2, conv_steps=8, conv_sites=2, conv_hs=(2, 4), conv_lr=3e-3, conv_dp_lrs=(1e-3, 3e-3, 1e-2),
    conv_seeds=(0, 1), conv_warmup=1, conv_eval_interval=4, conv_eval_batches=1, bench_vocab=512,
)

# Outer settings of the convergence rows (Nesterov SGD on the pseudo-gradient).
PAPER = dict(outer_lr=0.7, outer_momentum=0.9, outer_momentum_warmup=0, outer_lr_schedule="constant")
PLAIN_AVERAGING = dict(outer_lr=1.0, outer_momentum=0.0, outer_momentum_warmup=0, outer_lr_schedule="constant")


# ---------------------------------------------------------------------------------- the plan


def shipped_defaults() -> dict[str, Any]:
    """The outer settings zeroband ships (DilocoConfig's defaults): part of the rows' specs, so a
    change of the defaults re-runs the rows that test them."""
    from zeroband.config import DilocoConfig

    d = DilocoConfig()
    return dict(outer_lr=d.outer_lr, outer_momentum=d.outer_momentum,
                outer_momentum_warmup=d.outer_momentum_warmup, outer_lr_schedule=d.outer_lr_schedule)


def plan_rows(s: SuiteScale) -> list[Row]:
    """Every row, with its priority (lower first): the speed headline, the convergence rows that
    decide the checks at seed 0, then the rest, then the second seed."""
    common = dict(device=s.device, bf16=s.bf16, compile=s.compile)
    rows = [Row(f"speed/bench-{label}", "speed", dict(mode="bench", preset=p, seq=seq, batch=b, vocab=s.bench_vocab,
                                                       warmup=s.bench_steps[0], steps=s.bench_steps[1], profile=True,
                                                       **common), 10 + i)
            for i, (label, (p, seq, b)) in enumerate(s.bench.items())]
    for label, prio in (("1B", 12), ("150M", 31)):
        rows.append(Row(f"speed/shipped-{label}", "speed", dict(
            mode="shipped", config=s.shipped[label], overrides=list(s.shipped_overrides), warmup=s.shipped_steps[0],
            steps=s.shipped_steps[1], profile=label == "1B", tokenizer_vocab=None if s.quick else 32000, **common), prio))
    outer_over = ["--model.preset", "debug", "--data.seq_len", "64"] if s.quick else []
    rows.append(Row("outer/1B", "outer", dict(config=s.outer_config, overrides=outer_over, device=s.device,
                                             repeats=s.outer_repeats, threads=s.outer_threads), 30))
    return rows + conv_rows(s)


def conv_rows(s: SuiteScale) -> list[Row]:
    base = dict(model=s.conv_model, vocab=s.conv_vocab, seq=s.conv_seq, batch=s.conv_batch, steps=s.conv_steps,
                sites=s.conv_sites, lr=s.conv_lr, warmup=s.conv_warmup, eval_interval=s.conv_eval_interval,
                eval_batches=s.conv_eval_batches, device=s.device, bf16=s.bf16)
    outer = {"defaults": shipped_defaults(), "plain_avg": PLAIN_AVERAGING, "paper": PAPER}
    rows = []
    for n, seed in enumerate(s.conv_seeds):
        prio = 20 + 20 * n
        rows.append(Row(f"conv/single/seed{seed}", "conv", dict(base, method="single", seed=seed), prio))
        rows += [Row(f"conv/dp_lr{lr:g}/seed{seed}", "conv", dict(base, method="dp", seed=seed, lr=lr), prio + 1)
                 for lr in s.conv_dp_lrs]
        for j, h in enumerate(sorted(s.conv_hs, reverse=True)):  # H = 500 first: the regime users run
            rows += [Row(f"conv/{name}_H{h}/seed{seed}", "conv", dict(base, method="diloco", seed=seed, h=h, outer=o),
                         prio + 2 + 3 * j + i) for i, (name, o) in enumerate(outer.items())]
    return rows


def estimate_s(row: Row, s: SuiteScale) -> float:
    """Seconds a row should take (start-up, compile and data set-up included). Rough, from the H100
    numbers of docs/results/gpu_h100.md; gpu_suite.py rescales them by what rows measured."""
    c = row.config
    if s.quick:
        return {"speed": 4.0, "outer": 6.0, "conv": 2.0}[row.kind]
    if row.kind == "outer":
        return 40.0 + (c["repeats"] + 7) * 2.5
    if row.kind == "speed":
        return _speed_estimate(c)
    return _conv_estimate(c)


def _flops_per_token(model: dict[str, Any], seq: int) -> float:
    from zeroband.config import ModelConfig
    from zeroband.models.llama import flops_per_token

    return flops_per_token(ModelConfig(**model), seq)


def _speed_estimate(c: dict[str, Any]) -> float:
    if c["mode"] == "bench":
        model, tokens, compile_s = {"preset": c["preset"], "vocab_size": c["vocab"]}, c["seq"] * c["batch"], 45.0
        seq = c["seq"]
    else:  # the shipped config's tokens per optimizer step
        from zeroband.config import load_config

        cfg = load_config(REPO / c["config"], list(c["overrides"]))
        model, tokens, compile_s = cfg.model.model_dump(exclude={"init_from"}), cfg.train.global_batch * cfg.data.seq_len, 70.0
        seq = cfg.data.seq_len
    step_s = _flops_per_token(model, seq) * tokens / (989e12 * 0.35)
    loops = compile_s * 2 + step_s * 2 * (c["warmup"] + c["steps"])
    profiles = step_s * 3 * ((2 if c["mode"] == "bench" else 1) if c["profile"] else 0)  # 3 steps per profiled loop
    return 20.0 + loops + profiles


def _conv_estimate(c: dict[str, Any]) -> float:
    flops = _flops_per_token({**c["model"], "vocab_size": c["vocab"]}, c["seq"]) * c["seq"] * c["batch"]
    per_site_step = 0.009 + flops / (989e12 * 0.25)  # eager: launch-bound at this size
    sites = c["sites"] if c["method"] == "diloco" else 1
    width = c["sites"] if c["method"] == "dp" else 1  # one site, k x the batch
    steps_s = c["steps"] * (sites * per_site_step + (width - 1) * flops / (989e12 * 0.25))
    outer_s = (c["steps"] // c["h"]) * 0.5 if c["method"] == "diloco" else 0.0
    evals = c["steps"] // c["eval_interval"] + 1
    return 30.0 + steps_s + outer_s + evals * c["eval_batches"] * 0.01


def plan_text(plan: list[tuple[str, Row]], cache: dict[str, Any], seconds: Any, chosen: set[str], out: Path,
              gpu: str, budget: float) -> str:
    lines = [f"GPU suite plan for {gpu}: {len(plan)} rows; results and cache in {out}", "",
             f"{'#':>3}  {'row':<34} {'kind':<6} {'est s':>7}  status"]
    pending_s = total_s = 0.0
    for n, (key, row) in enumerate(plan, 1):
        est = seconds(row)
        done = cache["rows"].get(key)
        total_s += done["wall_s"] if done else est
        if done:
            status = f"cached ({done['wall_s']:.0f} s measured)"
        else:
            pending_s += est
            failed = cache["failures"].get(key)
            status = ("this run" if key in chosen else "too long for --budget-s" if est > budget else "a later run")
            if failed and failed.get("count", 0) >= 2:
                status = "skipped: failed twice (fix it, or delete its entry under failures in the cache)"
            status += f" (failed before: {failed['error'][:60]})" if failed else ""
        lines.append(f"{n:>3}  {row.name:<34} {row.kind:<6} {est:>7.0f}  {status}")
    mine = sum(seconds(r) for k, r in plan if k in chosen)
    lines += ["", f"Estimated GPU time: this run {mine / 60:.1f} min (budget {budget / 60:.1f}); still missing "
              f"{pending_s / 60:.1f} min; the whole suite {total_s / 60:.1f} min (measured where cached)."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- context and data


def device_name(quick: bool, default: str, dry_run: bool) -> str:
    if quick:
        return "CPU (quick smoke test)"
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    if dry_run:
        return default
    raise SystemExit("gpu_suite.py: no CUDA GPU here; --quick runs the CPU smoke test, --dry-run prints the plan")


def commit(args: Any) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip()[:12] + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    if args.commit:
        return args.commit
    marker = Path(args.data) / "COMMIT"
    return marker.read_text().strip() + " (from .gpudata/COMMIT)" if marker.is_file() else "unknown (no .git)"


def context(args: Any, scale: SuiteScale, out: Path, gpu: str) -> dict[str, Any]:
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), float("nan"))
    return {"quick": scale.quick, "out": str(out), "data": str(args.data), "cache_dir": str(args.cache_dir),
            "corpus": str(args.corpus) if args.corpus else None, "gpu": gpu, "peak_tflops": peak,
            "commit": commit(args), "scale": asdict(scale)}


def environment(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    return {"gpu": ctx["gpu"], "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": tf,
            "python": sys.version.split()[0], "commit": ctx["commit"]}


def corpus_path(ctx: dict[str, Any]) -> Path:
    """The corpus rows train on: --corpus (quick), else prose-v2 decompressed into the cache dir."""
    if ctx["corpus"]:
        return Path(ctx["corpus"])
    if ctx["quick"]:
        raise SystemExit("--quick needs --corpus PATH.jsonl (any jsonl with a text field)")
    return decompressed_v2(Path(ctx["data"]), Path(ctx["cache_dir"]))


def decompressed_v2(data: Path, cache: Path) -> Path:
    from zeroband.checkpoint import sha256_file

    out = cache / "prose-v2.jsonl"
    if out.is_file() and sha256_file(out) == PROSE_V2_SHA256:
        return out
    src = next((p for p in (data / PROSE_V2, *(d / PROSE_V2 for d in SHARED_DATA)) if p.is_file()), None)
    if src is None:
        raise SystemExit(f"{data / PROSE_V2} not found: run `python scripts/gpu_suite.py --prepare` on the CPU "
                         "machine and carry .gpudata (docs/gpu_runbook.md)")
    cache.mkdir(parents=True, exist_ok=True)
    with lzma.open(src, "rb") as f, open(out.with_suffix(".tmp"), "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)
    out.with_suffix(".tmp").replace(out)
    if sha256_file(out) != PROSE_V2_SHA256:
        raise SystemExit(f"{src}: sha256 differs from prose-v2's {PROSE_V2_SHA256}")
    return out


def tokenizer_path(ctx: dict[str, Any], vocab: int) -> Path:
    """A BPE of `vocab` trained on a sample of the corpus' train split: --data's if prepared, else trained here."""
    prepared = Path(ctx["data"]) / f"tokenizer-{vocab}"
    if not ctx["quick"] and (prepared / "tokenizer.json").is_file():
        return prepared
    corpus = corpus_path(ctx)
    out = Path(ctx["cache_dir"]) / f"tokenizer-{vocab}-{corpus.stat().st_size}"
    if not (out / "tokenizer.json").is_file():
        train_sample_tokenizer(corpus, vocab, out)
    return out


def train_sample_tokenizer(corpus: Path, vocab: int, out: Path) -> None:
    from zeroband.data.loader import is_val_document
    from zeroband.data.tokenizer import train_tokenizer

    sample, size = out.with_name(out.name + ".sample.jsonl"), 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(corpus, encoding="utf-8") as src, open(sample, "w", encoding="utf-8") as dst:
        for n, line in enumerate(src):
            text = json.loads(line).get("text") if line.strip() else None
            if text and n % 5 == 0 and not is_val_document(text, 0.02):  # every 5th: all sources, not the first ones
                dst.write(json.dumps({"text": text}) + "\n")
                size += len(text)
                if size > TOKENIZER_SAMPLE_MB * 2**20:
                    break
    train_tokenizer([sample], vocab, out)
    sample.unlink()


def train_split_bytes(corpus: Path, val_fraction: float) -> int:
    from zeroband.data.loader import is_val_document

    total = 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line).get("text") if line.strip() else None
            if text and not is_val_document(text, val_fraction):
                total += len(text.encode("utf-8"))
    return total


def prepare(data: Path) -> dict[str, Any]:
    """On the CPU machine: .gpudata/ with the corpus, both tokenizers and the commit (the GPU has no .git)."""
    data.mkdir(parents=True, exist_ok=True)
    shared = next((d / PROSE_V2 for d in SHARED_DATA if (d / PROSE_V2).is_file()), None)
    if not (data / PROSE_V2).is_file():
        if shared is None:
            raise SystemExit(f"{PROSE_V2} not found in {', '.join(map(str, SHARED_DATA))}: copy it into {data}")
        shutil.copy(shared, data / PROSE_V2)
    ctx = {"quick": False, "data": str(data), "cache_dir": str(Path(tempfile.gettempdir()) / "zeroband-gpu-suite"),
           "corpus": None}
    for vocab in (4096, 32000):
        if not (data / f"tokenizer-{vocab}" / "tokenizer.json").is_file():
            train_sample_tokenizer(corpus_path(ctx), vocab, data / f"tokenizer-{vocab}")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    (data / "COMMIT").write_text(head[:12] + "\n")
    return {"data": str(data), "files": sorted(p.name for p in data.iterdir()), "commit": head[:12],
            "mib": round(sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) / 2**20, 1)}


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/gpu_suite.py --help\n(scripts/gpu_rows.py is gpu_suite.py's rows; it does nothing on its own)")
