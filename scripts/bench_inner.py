"""`bench_step.py --inner` (CUDA only): the trainer's inner step against a plain compiled loop.

Per preset (150M: seq 1024 x batch 16; 1B: seq 2048 x batch 8; vocab 4096 as in issue 15), on one
GPU, bf16 mixed precision with fp32 master weights, torch.compile on:
- zeroband: the trainer's own `build_model` (1-rank site, FSDP2 bf16 policy), `forward_backward`
  and `optimizer_step` with the configured optimizer;
- plain: transformers' LlamaForCausalLM with the same shapes, torch.compile'd, fused AdamW,
  bf16 autocast, loss from the model (skipped when transformers is not installed).
tokens/s over `STEPS` timed steps after `WARMUP`, MFU = 6 x params x tokens/s / the GPU's dense
bf16 peak (`--peak-tflops`, default by GPU name), peak memory = torch.cuda.max_memory_allocated.
Writes benchmarks/inner_step.{json,md}. Not run on CPU machines: there the command says so.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench_common import markdown_table, write_outputs

PRESETS = {"150M": (1024, 16), "1B": (2048, 8)}  # seq_len, batch
VOCAB, WARMUP, STEPS = 4096, 5, 20
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16


def peak_tflops(name: str, given: float | None) -> float:
    return given or next((v for k, v in PEAK_TFLOPS.items() if k in name), float("nan"))


def timed(step: Any, device: Any) -> tuple[float, float]:
    """(seconds per step, peak GB) of `step()` after the warm-up."""
    import torch

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / STEPS, torch.cuda.max_memory_allocated(device) / 1e9


def zeroband_step(preset: str, seq: int, batch: int) -> tuple[Any, int]:
    import torch

    from zeroband.config import load_config
    from zeroband.mesh import init_topology
    from zeroband.optim import build_optimizer
    from zeroband.step import settle_step
    from zeroband.train import build_model, forward_backward, optimizer_step
    from zeroband.world import World

    cfg = load_config(None, ["--model.preset", preset, "--model.vocab_size", str(VOCAB), "--data.seq_len", str(seq),
                             "--train.compile", "true", "--train.mixed_precision", "bf16"])
    device = torch.device("cuda", 0)
    topology = init_topology(World(0, 1, 0, 0, 1, device), None, "bench-inner", 600, "nccl")
    model = build_model(cfg, topology)
    opt = build_optimizer(list(model.parameters()), cfg.optim, [n for n, _ in model.named_parameters()])
    x = torch.randint(0, VOCAB, (batch, seq + 1), device=device)
    batch_ = [(x[:, :-1], x[:, 1:])]

    def step() -> None:  # as the trainer's loop: one host sync per step, in settle_step
        loss = forward_backward(model, batch_, device)
        settle_step(loss, optimizer_step(model, opt, cfg.optim.grad_clip), topology)

    return step, sum(p.numel() for p in model.parameters())


def plain_step(preset: str, seq: int, batch: int) -> tuple[Any, int] | None:
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
    device = torch.device("cuda", 0)
    model = LlamaForCausalLM(hf).to(device)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    x = torch.randint(0, VOCAB, (batch, seq), device=device)

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = compiled(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def run_inner(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_step.py --inner needs a CUDA GPU; this machine has none")
    gpu = torch.cuda.get_device_name(0)
    peak = peak_tflops(gpu, getattr(args, "peak_tflops", None))
    rows = []
    for preset, (seq, batch) in PRESETS.items():
        for name, build in (("zeroband", zeroband_step), ("plain LlamaForCausalLM", plain_step)):
            built = build(preset, seq, batch)
            if built is None:
                continue
            step, params = built
            seconds, mem = timed(step, torch.device("cuda", 0))
            tps = batch * seq / seconds
            rows.append({"preset": preset, "loop": name, "params": params, "tokens_s": tps,
                         "mfu": 6 * params * tps / (peak * 1e12), "peak_gb": mem})
            del step
            torch.cuda.empty_cache()
    table = markdown_table(["preset", "loop", "params", "tokens/s", "MFU", "peak GB"],
                           [[r["preset"], r["loop"], r["params"], r["tokens_s"], r["mfu"], r["peak_gb"]] for r in rows])
    md = f"# Inner step on {gpu}\n\n`python scripts/bench_step.py --inner` (bf16, torch.compile)\n\n{table}"
    write_outputs(args.out, "inner_step", {"gpu": gpu, "peak_tflops": peak, "rows": rows}, md)
