"""`bench_step.py --inner` (CUDA only): the trainer's inner step against a plain compiled loop.

Per preset (150M: seq 1024 x batch 16; 1B: seq 2048 x batch 8; vocab 4096 as in issue 15), on one
GPU, bf16 mixed precision with fp32 master weights, torch.compile on:
- zeroband: the trainer's own `build_model` (1-rank site: no FSDP2, bf16 autocast, whole model
  compiled), `forward_backward` and `optimizer_step` with the configured optimizer;
- zeroband-FSDP2 (1 rank): the same with FSDP2's bf16 policy on the one rank, as multi-rank sites
  run (and as 1-rank sites did before 2026-11-25);
- plain: transformers' LlamaForCausalLM with the same shapes, torch.compile'd, fused AdamW,
  bf16 autocast, loss from the model (skipped when transformers is not installed).
tokens/s over `STEPS` timed steps after `WARMUP`, MFU = 6 x params x tokens/s / the GPU's dense
bf16 peak (`--peak-tflops`, default by GPU name), peak memory = torch.cuda.max_memory_allocated.
Writes benchmarks/inner_step.{json,md}. Not run on CPU machines: there the command says so.

`--inner --quick` runs the same two loops on the CPU with the debug preset, fp32 and no compile: the
plumbing a GPU run depends on (process group, config, both models, the report), tested in CI so that
a scarce GPU session never finds a bug in the script itself.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from bench_common import markdown_table, write_outputs

PRESETS = {"150M": (1024, 16), "1B": (2048, 8)}  # seq_len, batch
QUICK_PRESETS = {"debug": (64, 2), "demo": (32, 1)}  # two: the loop over presets is tested too
VOCAB = 4096
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16


@dataclass(frozen=True)
class Setup:
    """Where and how both loops run: a CUDA GPU in bf16 with compile, or the CPU smoke test."""

    device: Any
    bf16: bool
    compile: bool
    warmup: int
    steps: int


def peak_tflops(name: str, given: float | None) -> float:
    return given or next((v for k, v in PEAK_TFLOPS.items() if k in name), float("nan"))


def timed(step: Any, setup: Setup) -> tuple[float, float]:
    """(seconds per step, peak GB; NaN off the GPU) of `step()` after the warm-up."""
    import torch

    cuda = setup.device.type == "cuda"
    for _ in range(setup.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
    t0 = time.perf_counter()
    for _ in range(setup.steps):
        step()
    if cuda:
        torch.cuda.synchronize(setup.device)
    peak = torch.cuda.max_memory_allocated(setup.device) / 1e9 if cuda else float("nan")
    return (time.perf_counter() - t0) / setup.steps, peak


def zeroband_step(preset: str, seq: int, batch: int, setup: Setup, topology: Any,
                  shard: bool | None = None) -> tuple[Any, int]:
    import torch

    from zeroband.config import load_config
    from zeroband.optim import build_optimizer
    from zeroband.step import settle_step
    from zeroband.train import build_model, forward_backward, optimizer_step

    cfg = load_config(None, ["--model.preset", preset, "--model.vocab_size", str(VOCAB), "--data.seq_len", str(seq),
                             "--train.compile", str(setup.compile).lower(),
                             "--train.mixed_precision", "bf16" if setup.bf16 else "fp32"])
    model = build_model(cfg, topology, shard)
    opt = build_optimizer(list(model.parameters()), cfg.optim, [n for n, _ in model.named_parameters()])
    x = torch.randint(0, VOCAB, (batch, seq + 1), device=setup.device)
    batch_ = [(x[:, :-1], x[:, 1:])]

    def step() -> None:  # as the trainer's loop: one host sync per step, in settle_step
        loss = forward_backward(model, batch_, setup.device)
        settle_step(loss, optimizer_step(model, opt, cfg.optim.grad_clip), topology)

    return step, sum(p.numel() for p in model.parameters())


def plain_step(preset: str, seq: int, batch: int, setup: Setup, topology: Any) -> tuple[Any, int] | None:
    import torch

    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    from zeroband.config import MODEL_PRESETS

    shape = MODEL_PRESETS[preset]
    hf = LlamaConfig(hidden_size=shape["dim"], intermediate_size=shape["ffn_dim"], num_hidden_layers=shape["n_layers"],
                     num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"], vocab_size=VOCAB,
                     max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(hf).to(setup.device)
    run = torch.compile(model) if setup.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=setup.device.type == "cuda")
    x = torch.randint(0, VOCAB, (batch, seq), device=setup.device)

    def step() -> None:
        with torch.autocast(setup.device.type, torch.bfloat16, enabled=setup.bf16):
            loss = run(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def profile(step: Any, setup: Setup, path: Any = None) -> Any:
    """3 steps under torch.profiler: the top ops by device (CPU: host) time, as a text table written
    to `path` if given; returns the profiler's per-op averages."""
    import torch
    from torch.profiler import ProfilerActivity

    cuda = setup.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.synchronize(setup.device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    if path is not None:
        path.write_text(averages.table(sort_by=key, row_limit=40, max_name_column_width=90))
    return averages


def fsdp_step(preset: str, seq: int, batch: int, setup: Setup, topology: Any) -> tuple[Any, int]:
    """The trainer's step with FSDP2 on the 1-rank site, as before 2026-11-25 (the comparison)."""
    return zeroband_step(preset, seq, batch, setup, topology, shard=True)


# (the row's name, its profile file's tag, how to build it)
LOOPS = (("zeroband", "zeroband", zeroband_step), ("zeroband-FSDP2 (1 rank)", "FSDP2", fsdp_step),
         ("plain LlamaForCausalLM", "plain", plain_step))


def measure(presets: dict[str, tuple[int, int]], setup: Setup, peak: float,
            profile_dir: Any = None) -> list[dict[str, Any]]:
    """Both loops on every preset, in one process group (a 1-rank site) that lives for all of them."""
    import torch

    from zeroband.mesh import init_topology, shutdown
    from zeroband.world import World

    backend = "nccl" if setup.device.type == "cuda" else "gloo"
    topology = init_topology(World(0, 1, 0, 0, 1, setup.device), None, "bench-inner", 600, backend)
    rows = []
    try:
        for preset, (seq, batch) in presets.items():
            for name, tag, build in LOOPS:
                built = build(preset, seq, batch, setup, topology)
                if built is None:
                    continue
                step, params = built
                seconds, mem = timed(step, setup)
                if profile_dir is not None:
                    profile(step, setup, profile_dir / f"profile_{preset}_{tag}.txt")
                tps = batch * seq / seconds
                rows.append({"preset": preset, "loop": name, "params": params, "tokens_s": tps,
                             "mfu": 6 * params * tps / (peak * 1e12), "peak_gb": mem})
                del step, built
                torch._dynamo.reset()  # compiled graphs hold the model: free it before the next one
                if setup.device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        shutdown()
    return rows


def run_inner(args: argparse.Namespace) -> None:
    import torch

    if args.quick:
        setup, presets, where = Setup(torch.device("cpu"), False, False, 1, 2), QUICK_PRESETS, "CPU (smoke test)"
    elif torch.cuda.is_available():
        setup, presets, where = Setup(torch.device("cuda", 0), True, True, 5, 20), PRESETS, torch.cuda.get_device_name(0)
    else:
        raise SystemExit("bench_step.py --inner needs a CUDA GPU; this machine has none (--quick: the CPU smoke test)")
    peak = peak_tflops(where, getattr(args, "peak_tflops", None))
    if args.profile:
        args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(presets, setup, peak, args.out if args.profile else None)
    table = markdown_table(["preset", "loop", "params", "tokens/s", "MFU", "peak GB"],
                           [[r["preset"], r["loop"], r["params"], r["tokens_s"], r["mfu"], r["peak_gb"]] for r in rows])
    flags = "bf16, torch.compile" if setup.bf16 else "fp32, eager"
    cmd = "python scripts/bench_step.py --inner" + (" --quick" if args.quick else "")
    md = f"# Inner step on {where}\n\n`{cmd}` ({flags})\n\n{table}"
    write_outputs(args.out, "inner_step", {"device": where, "peak_tflops": peak, "rows": rows}, md)


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/bench_step.py --inner [--quick] [--profile] [--out DIR]\n(scripts/bench_inner.py is the inner-step benchmark of bench_step.py; it does nothing on its own)")
