"""The rows of scripts/gpu_suite.py, the calls they are grouped into, and how long each should take.

Row kinds (each runs in a worker process of gpu_suite.py):
- speed: one GPU, zeroband's inner step against the fair plain loop (transformers' LlamaForCausalLM,
  sdpa attention on the causal path with no mask built, use_cache=False, bf16 autocast, fused AdamW,
  torch.compile of the model, the same shapes, batch and gradient clipping), both timed in one process,
  each profiled for 3 steps so the row records which attention op each loop ran. "bench" rows: the
  bench shapes (vocab 4096, random tokens, one micro-batch per step). "shipped" rows: configs/150M.toml
  and configs/1B.toml as they ship, with the trainer's data loader on real text inside the timed loop.
- outer: the outer step of configs/1B.toml's model (its real parameter shapes and [diloco] settings),
  2 sites x 1 rank sharing the GPU over authenticated gloo, as scripts/bench_step.py measures it.
- conv: one training run of the production trainer (`zeroband.train.train`), each site its own forked
  process sharing the GPU, the cross-site group over gloo; the design of the CPU study
  (scripts/experiments/large_h.py: one site, data parallel, four outer settings, paired seeds) at
  ~28M parameters on prose-v2, bf16.

A call is what one device `run` executes: a fixed list of rows, packed so that their estimates fit
`PACK_S`, under a hard deadline (`budget_s`) after which no row starts.
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
FIRST_BUDGET_S = 450.0  # the first lend's call: at most 8 minutes, pip install and report included
CALL_BUDGET_S = 480.0  # any other call: 8 of the 10 minutes a call may last (600 s kill)
PACK_S = 420.0  # rows of a call add up to at most this many estimated seconds: a 14% error still fits
WHEELS = (".whl",)  # pydantic, cryptography, tomli-w, datasets and their needs: ~8.4 MiB (docs/gpu_runbook.md)
DATA = (".whl", ".gpudata")  # + prose-v2 (47.5 MB) and the tokenizers: the 64 MiB limit holds


@dataclass(frozen=True)
class ConvGroup:
    """Runs that share T, B and H: their one-site and data-parallel rows are the baselines."""

    name: str
    h: int
    steps: int  # T, inner steps per site
    batch: int  # B, sequences per site per step
    eval_interval: int


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
    conv_sites: int  # k
    conv_groups: tuple[ConvGroup, ...]
    conv_lr: float  # every row's inner lr, fixed before any run: no method gets a sweep the others do not
    conv_seeds: tuple[int, ...]
    conv_eval_batches: int
    pack_s: float  # rows of a call add up to at most this many estimated seconds
    bench_vocab: int = 4096


FULL = SuiteScale(
    quick=False, device="cuda", bf16=True, compile=True,
    bench={"150M": ("150M", 1024, 16), "1B": ("1B", 2048, 8)}, bench_steps=(5, 20),
    shipped={"150M": "configs/150M.toml", "1B": "configs/1B.toml"}, shipped_overrides=(), shipped_steps=(1, 2),
    outer_config="configs/1B.toml", outer_repeats=3, outer_threads=8,
    # ~27.8M parameters. h100: 30 outer steps, 4 x 3000 x 16 x 256 = 49M tokens (0.74 epoch of prose-v2's
    # ~66M train tokens at vocab 4k); h500: 20 outer steps, 4 x 10000 x 6 x 256 = 61M tokens (0.92 epoch).
    conv_model=dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408), conv_vocab=4096, conv_seq=256,
    conv_sites=4, conv_groups=(ConvGroup("h100", 100, 3000, 16, 100), ConvGroup("h500", 500, 10000, 6, 500)),
    conv_lr=1e-3, conv_seeds=(0, 1, 2), conv_eval_batches=32, pack_s=PACK_S,
)
QUICK = SuiteScale(
    quick=True, device="cpu", bf16=False, compile=False,
    bench={"150M": ("debug", 64, 2), "1B": ("debug", 32, 2)}, bench_steps=(1, 2),
    shipped={"150M": "configs/150M.toml", "1B": "configs/1B.toml"},
    shipped_overrides=("--model.preset", "debug", "--data.seq_len", "32", "--model.max_seq_len", "32",
                       "--train.micro_batch", "2", "--train.global_batch", "4"), shipped_steps=(1, 1),
    outer_config="configs/1B.toml", outer_repeats=1, outer_threads=1,
    conv_model=dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64), conv_vocab=384, conv_seq=32,
    conv_sites=2, conv_groups=(ConvGroup("h100", 2, 8, 2, 4), ConvGroup("h500", 4, 8, 2, 4)),
    conv_lr=3e-3, conv_seeds=(0, 1, 2), conv_eval_batches=2, pack_s=10.0, bench_vocab=512,
)


@dataclass(frozen=True)
class Call:
    """One device `run`: its rows, in order, and the deadline after which none starts."""

    name: str
    rows: tuple[str, ...]
    budget_s: float
    carry: tuple[str, ...]


# ---------------------------------------------------------------------------------- the plan


def plan_rows(s: SuiteScale) -> list[Row]:
    """Every row of the suite (calls() says in which call and order each runs)."""
    common = dict(device=s.device, bf16=s.bf16, compile=s.compile)
    rows = [Row(f"speed/bench-{label}", "speed", dict(mode="bench", preset=p, seq=seq, batch=b, vocab=s.bench_vocab,
                                                       warmup=s.bench_steps[0], steps=s.bench_steps[1], profile=True,
                                                       **common))
            for label, (p, seq, b) in s.bench.items()]
    outer_over = ["--model.preset", "debug", "--data.seq_len", "64"] if s.quick else []
    rows.append(Row("outer/1B", "outer", dict(config=s.outer_config, overrides=outer_over, device=s.device,
                                             repeats=s.outer_repeats, threads=s.outer_threads)))
    rows += [Row(f"speed/shipped-{label}", "speed", dict(
        mode="shipped", config=s.shipped[label], overrides=list(s.shipped_overrides), warmup=s.shipped_steps[0],
        steps=s.shipped_steps[1], profile=label == "1B", tokenizer_vocab=None if s.quick else 32000, **common))
        for label in ("1B", "150M")]
    return rows + [r for g in s.conv_groups for seed in s.conv_seeds for r in conv_rows(s, g, seed)]


def conv_rows(s: SuiteScale, g: ConvGroup, seed: int) -> list[Row]:
    """One seed of a group: one site, data parallel, then DiLoCo at each outer setting of the CPU study.
    Data parallel at equal tokens = one site at k x the batch (the same update as k sites averaging
    their gradients every step), at the same inner lr as every other row."""
    from large_h import settings

    base = dict(model=s.conv_model, vocab=s.conv_vocab, seq=s.conv_seq, batch=g.batch, steps=g.steps,
                sites=s.conv_sites, lr=s.conv_lr, warmup=max(2, g.steps // 50), eval_interval=g.eval_interval,
                eval_batches=s.conv_eval_batches, device=s.device, bf16=s.bf16, seed=seed)
    rows = [Row(f"conv/{g.name}/single/seed{seed}", "conv", dict(base, method="single")),
            Row(f"conv/{g.name}/dp/seed{seed}", "conv", dict(base, method="dp"))]
    return rows + [Row(f"conv/{g.name}/{name}/seed{seed}", "conv", dict(base, method="diloco", h=g.h, outer=outer))
                   for name, outer in settings(s.conv_sites, g.h).items()]


def pack(rows: list[Row], seconds: Any, limit: float) -> list[list[Row]]:
    """Consecutive rows in chunks whose estimates add up to at most `limit` (a longer row: alone)."""
    chunks: list[list[Row]] = [[]]
    for row in rows:
        if chunks[-1] and sum(map(seconds, chunks[-1])) + seconds(row) > limit:
            chunks.append([])
        chunks[-1].append(row)
    return [c for c in chunks if c]


def calls(s: SuiteScale) -> list[Call]:
    """The calls in the order to run them: the decisive speed rows and the 1B outer step first, then
    the H = 100 study seed by seed, the shipped configs, and the H = 500 study."""
    rows = {r.name: r for r in plan_rows(s)}
    est = lambda r: estimate_s(r, s)  # noqa: E731  (packing uses the raw estimates: names stay fixed)
    out = [Call("first", ("speed/bench-150M", "speed/bench-1B", "outer/1B"), FIRST_BUDGET_S, WHEELS)]
    h100, h500 = s.conv_groups
    groups = [(h100, seed) for seed in s.conv_seeds] + [(None, 0)] + [(h500, seed) for seed in s.conv_seeds]
    for g, seed in groups:
        name = "shipped" if g is None else f"conv-{g.name}-seed{seed}"
        mine = [rows["speed/shipped-1B"], rows["speed/shipped-150M"]] if g is None else conv_rows(s, g, seed)
        for n, chunk in enumerate(pack(mine, est, s.pack_s), 1):
            out.append(Call(f"{name}-{n}", tuple(r.name for r in chunk), CALL_BUDGET_S, DATA))
    return out


# ---------------------------------------------------------------------------------- estimates


def estimate_s(row: Row, s: SuiteScale) -> float:
    """Seconds a row should take (worker start, compile and data set-up included). From the H100
    numbers of docs/results/gpu_h100.md where there are some; gpu_suite.py rescales them by what rows
    of the same kind measured."""
    c = row.config
    if s.quick:
        return {"speed": 3.0, "outer": 5.0, "conv": 3.0}[row.kind]
    if row.kind == "outer":
        return 45.0 + (c["repeats"] + 7) * 2.5
    if row.kind == "speed":
        return _speed_estimate(c)
    return _conv_estimate(c)


def _flops_per_token(model: dict[str, Any], seq: int) -> float:
    from zeroband.config import ModelConfig
    from zeroband.models.llama import flops_per_token

    return flops_per_token(ModelConfig(**model), seq)


def _speed_estimate(c: dict[str, Any]) -> float:
    if c["mode"] == "bench":
        model, tokens, compile_s = {"preset": c["preset"], "vocab_size": c["vocab"]}, c["seq"] * c["batch"], 50.0
        seq = c["seq"]
    else:  # the shipped config's tokens per optimizer step
        from zeroband.config import load_config

        cfg = load_config(REPO / c["config"], list(c["overrides"]))
        model, tokens, compile_s = cfg.model.model_dump(exclude={"init_from"}), cfg.train.global_batch * cfg.data.seq_len, 75.0
        seq = cfg.data.seq_len
    step_s = _flops_per_token(model, seq) * tokens / (989e12 * 0.30)
    loops = compile_s * 2 + step_s * 2 * (c["warmup"] + c["steps"])
    profiles = step_s * 3 * ((2 if c["mode"] == "bench" else 1) if c["profile"] else 0)  # 3 steps per profiled loop
    return 25.0 + loops + profiles


def _conv_estimate(c: dict[str, Any]) -> float:
    """Eager steps of a ~28M model are launch-bound: a fixed host cost per step per process, the
    sites' processes launching side by side while their kernels take turns on the one GPU."""
    flops = _flops_per_token({**c["model"], "vocab_size": c["vocab"]}, c["seq"]) * c["seq"] * c["batch"]
    gpu_s = flops / (989e12 * 0.30)  # one site-step's kernels
    width = {"single": 1, "dp": c["sites"], "diloco": c["sites"]}[c["method"]]  # site-steps of GPU work per step
    per_step = 0.012 + width * gpu_s
    outer_s = (c["steps"] // c["h"]) * 0.5 if c["method"] == "diloco" else 0.0
    evals = (c["steps"] // c["eval_interval"] + 1) * c["eval_batches"] * 0.01
    return 30.0 + c["steps"] * per_step + outer_s + evals


def plan_text(calls_: list[Call], rows: dict[str, tuple[str, Row]], done: set[str], seconds: Any) -> str:
    """Every call, in order: its carry, its rows' estimates and what is already measured."""
    lines = []
    for n, call in enumerate(calls_, 1):
        left = [rows[r] for r in call.rows if rows[r][0] not in done]
        total = sum(seconds(rows[r][1]) for r in call.rows)
        state = "done" if not left else f"{len(left)} of {len(call.rows)} rows to run"
        lines.append(f"{n:>2}. --call {call.name:<18} carry {','.join(call.carry):<15} est {total / 60:4.1f} min "
                     f"(deadline {call.budget_s / 60:.1f}): {state}")
        lines += [f"      {r:<34} {seconds(rows[r][1]):6.0f} s  {'done' if rows[r][0] in done else ''}" for r in call.rows]
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
    """The CPU machine's commit: the COMMIT marker first, since the device's copy may carry a .git of its
    own whose HEAD is a snapshot of the transferred tree, not a commit of this project."""
    if args.commit:
        return args.commit
    for marker in (Path(args.data) / "COMMIT", REPO / ".whl" / "COMMIT"):  # written on the CPU machine
        if marker.is_file():
            return f"{marker.read_text().strip()} (from {marker.parent.name}/COMMIT)"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip()[:12] + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no .git)"


def context(args: Any, scale: SuiteScale, out: Path, gpu: str) -> dict[str, Any]:
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), float("nan"))
    return {"quick": scale.quick, "out": str(out), "data": str(args.data), "cache_dir": str(args.cache_dir),
            "corpus": str(args.corpus) if args.corpus else None, "gpu": gpu, "peak_tflops": peak,
            "commit": commit(args), "scale": asdict(scale), **device_versions(scale.quick)}


def environment(ctx: dict[str, Any]) -> dict[str, Any]:
    """What every row names: the GPU, torch, CUDA, cuDNN and the driver (read by the parent process:
    a worker must not touch CUDA before it forks sites), transformers, Python, commit."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        tf: str | None = version("transformers")
    except PackageNotFoundError:
        tf = None
    return {"gpu": ctx["gpu"], "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": ctx["cudnn"],
            "driver": ctx["driver"], "transformers": tf, "python": sys.version.split()[0], "commit": ctx["commit"]}


def device_versions(quick: bool) -> dict[str, Any]:
    """cuDNN and driver versions, in the parent (which reads the GPU's name anyway)."""
    if quick:
        return {"cudnn": None, "driver": None}
    import torch

    cuda = torch.cuda.is_available()
    return {"cudnn": torch.backends.cudnn.version() if cuda else None, "driver": _driver() if cuda else None}


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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


def train_bytes(ctx: dict[str, Any]) -> int:
    """UTF-8 bytes of the corpus' train split (for epochs): --data's if --prepare wrote it, else
    computed once into the cache dir."""
    corpus = corpus_path(ctx)
    name = f"train-bytes-{corpus.stat().st_size}.json"
    if not ctx["quick"] and (Path(ctx["data"]) / name).is_file():
        return json.loads((Path(ctx["data"]) / name).read_text())
    memo = Path(ctx["cache_dir"]) / name
    if not memo.is_file():
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(train_split_bytes(corpus, 0.02)))
    return json.loads(memo.read_text())


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
    corpus = corpus_path(ctx)
    (data / f"train-bytes-{corpus.stat().st_size}.json").write_text(json.dumps(train_bytes(ctx)))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    for d in (data, REPO / ".whl"):  # the GPU machine has no .git: the rows name the commit from here
        if d.is_dir():
            (d / "COMMIT").write_text(head[:12] + "\n")
    return {"data": str(data), "files": sorted(p.name for p in data.iterdir()), "commit": head[:12],
            "mib": round(sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) / 2**20, 1)}


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/gpu_suite.py --help\n(scripts/gpu_rows.py is gpu_suite.py's rows; it does nothing on its own)")
