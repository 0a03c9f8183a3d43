"""How each row kind of scripts/gpu_suite.py is measured (runs inside a worker process)."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_rows import CAUSAL_SDPA, corpus_path, tokenizer_path, train_bytes
from gpu_suite import REPO

Step = Callable[[], None]


# ---------------------------------------------------------------------------------- speed


def _setup(c: dict[str, Any]) -> Any:
    import torch
    from bench_inner import Setup

    device = torch.device("cuda", 0) if c["device"] == "cuda" else torch.device("cpu")
    return Setup(device, c["bf16"], c["compile"], c["warmup"], c["steps"])


def one_rank_topology(device: Any) -> Any:
    from zeroband.mesh import init_topology
    from zeroband.world import World

    backend = "nccl" if device.type == "cuda" else "gloo"
    return init_topology(World(0, 1, 0, 0, 1, device), None, "gpu-suite", 600, backend)


def register_causal_sdpa() -> None:
    """transformers' own sdpa attention under a name whose mask function builds no mask, so SDPA
    runs with is_causal=True. With "sdpa" itself, transformers builds a full [seq x seq] mask under
    torch.compile on torch < 2.14 (masking_utils._ignore_causal_mask_sdpa), which is what made the
    plain loop's attention 2-2.5x slower in the committed profiles (issue 24)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, lambda *args, **kwargs: None)


def fair_llama(model_cfg: Any, device: Any, checkpointing: bool) -> Any:
    """LlamaForCausalLM with zeroband's shapes, the causal sdpa path and no KV cache."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    register_causal_sdpa()
    hf = LlamaConfig(hidden_size=model_cfg.dim, intermediate_size=model_cfg.ffn_dim, num_hidden_layers=model_cfg.n_layers,
                     num_attention_heads=model_cfg.n_heads, num_key_value_heads=model_cfg.n_kv_heads,
                     vocab_size=model_cfg.vocab_size, max_position_embeddings=model_cfg.max_seq_len,
                     rms_norm_eps=model_cfg.norm_eps, rope_theta=model_cfg.rope_theta,
                     tie_word_embeddings=model_cfg.tie_embeddings, use_cache=False, attn_implementation=CAUSAL_SDPA)
    with torch.device(device):  # built where it runs: a 1B model initialised on the host takes a while
        model = LlamaForCausalLM(hf)
    if checkpointing:  # transformers 5.x renamed it; the GPU image may have either name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def mask_reaching_attention(model: Any, seq: int, device: Any) -> bool:
    """Whether a mask reaches the first attention layer (eager, one short forward): the fair loop
    must pass none, or the row fails instead of reporting an unfair number."""
    import torch

    if model.config._attn_implementation != CAUSAL_SDPA:
        return True
    seen: list[Any] = []
    attn = model.model.layers[0].self_attn
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, min(seq, 16), dtype=torch.long, device=device), use_cache=False)
    finally:
        hook.remove()
    return seen[0] is not None


def plain_loop(model_cfg: Any, setup: Any, optim: Any, checkpointing: bool, batches: Callable[[], list[Any]]) -> Step:
    """What a good user writes: compiled model, bf16 autocast, fused AdamW, loss from the model, clipping."""
    import torch

    model = fair_llama(model_cfg, setup.device, checkpointing)
    if mask_reaching_attention(model, 16, setup.device):
        raise RuntimeError("the plain loop's attention received a mask: not the causal path")
    run = torch.compile(model) if setup.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                            weight_decay=optim.weight_decay, fused=setup.device.type == "cuda")

    def step() -> None:
        micro = batches()
        for x in micro:
            with torch.autocast(setup.device.type, torch.bfloat16, enabled=setup.bf16):
                loss = run(input_ids=x, labels=x, use_cache=False).loss / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.params = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    return step


def bench_loops(c: dict[str, Any], setup: Any, topology: Any, ctx: dict[str, Any]) -> dict[str, Any]:
    """Bench shapes: random tokens, one micro-batch per step (scripts/bench_inner.py's zeroband loop)."""
    import bench_inner
    import torch

    from zeroband.config import ModelConfig, OptimConfig

    assert bench_inner.VOCAB == c["vocab"] or ctx["quick"], "bench_inner's vocabulary changed"
    model_cfg = ModelConfig(preset=c["preset"], vocab_size=bench_inner.VOCAB, max_seq_len=c["seq"])
    x = torch.randint(0, model_cfg.vocab_size, (c["batch"], c["seq"]), device=setup.device)
    return {"model": model_cfg, "seq": c["seq"], "tokens_per_step": c["batch"] * c["seq"],
            "zeroband": lambda: bench_inner.zeroband_step(c["preset"], c["seq"], c["batch"], setup, topology)[0],
            "plain": lambda: plain_loop(model_cfg, setup, OptimConfig(), False, lambda: [x])}


def shipped_config(c: dict[str, Any], ctx: dict[str, Any], out_dir: Path) -> Any:
    from zeroband.config import load_config

    vocab = c["tokenizer_vocab"] or ctx["scale"]["conv_vocab"]
    over = ["--diloco", "none", "--data.path", str(corpus_path(ctx)), "--data.tokenizer", str(tokenizer_path(ctx, vocab)),
            "--train.device", c["device"], "--train.compile", str(c["compile"]).lower(),
            "--train.mixed_precision", "bf16" if c["bf16"] else "fp32", "--output_dir", str(out_dir),
            "--checkpoint.interval", "0", "--checkpoint.save_at_end", "false", "--log.wandb_mode", "disabled",
            "--eval.batches", "1", *c["overrides"]]
    if ctx["quick"]:
        over += ["--model.vocab_size", str(vocab)]
    return load_config(REPO / c["config"], over)


def shipped_loops(c: dict[str, Any], setup: Any, topology: Any, ctx: dict[str, Any]) -> dict[str, Any]:
    """As the config ships: its vocabulary, checkpointing, micro-batch and accumulation, and the
    trainer's data loader (PackedBatches on prose-v2) inside the timed step, for both loops."""
    from zeroband.data.loader import PackedBatches
    from zeroband.data.tokenizer import TextTokenizer
    from zeroband.step import forward_backward, optimizer_step, settle_step
    from zeroband.train import build_run

    cfg = shipped_config(c, ctx, Path(tempfile.mkdtemp(prefix="gpu-suite-")))
    accum, micro = cfg.grad_accum_steps(1), cfg.train.micro_batch

    def zeroband() -> Step:
        run = build_run(cfg, topology.world, topology)

        def step() -> None:  # the body of zeroband.train.train_loop for a one-site run
            batches = [run.train_data.next_batch(micro) for _ in range(accum)]
            loss = forward_backward(run.model, batches, setup.device)
            norm = optimizer_step(run.model, run.optimizer, cfg.optim.grad_clip)
            run.scheduler.step()
            settle_step(loss, norm, run.topology)
        return step

    def plain() -> Step:
        data = PackedBatches(cfg.data, TextTokenizer.load(cfg.data.tokenizer), 0, 1, "train")

        def batches() -> list[Any]:
            return [data.next_batch(micro)[0].pin_memory().to(setup.device, non_blocking=True)
                    if setup.device.type == "cuda" else data.next_batch(micro)[0] for _ in range(accum)]
        return plain_loop(cfg.model, setup, cfg.optim, cfg.train.activation_checkpointing, batches)

    return {"model": cfg.model, "seq": cfg.data.seq_len, "tokens_per_step": cfg.train.global_batch * cfg.data.seq_len,
            "zeroband": zeroband, "plain": plain, "accumulation": accum, "micro_batch": micro,
            "activation_checkpointing": cfg.train.activation_checkpointing, "vocab": cfg.model.vocab_size}


ATTENTION_OP = "aten::_scaled_dot_product"  # the fused attention ops (flash, cuDNN, efficient; CPU: flash_for_cpu)


def attention_ops(averages: Any, cuda: bool) -> dict[str, float]:
    """Attention op -> its milliseconds over the profiled steps (device time on a GPU, host time on a
    CPU), summed over every call: which kernel family each loop really ran, and for how long."""
    out: dict[str, float] = {}
    for e in averages:
        if e.key.startswith(ATTENTION_OP) and "backward" not in e.key:
            out[e.key] = out.get(e.key, 0.0) + (e.device_time_total if cuda else e.cpu_time_total) / 1e3
    return out


def run_speed(c: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    import torch
    from bench_inner import profile, timed

    from zeroband.mesh import shutdown
    from zeroband.models.llama import flops_per_token, num_params

    setup = _setup(c)
    topology = one_rank_topology(setup.device)
    peak = ctx["peak_tflops"]
    try:
        spec = (bench_loops if c["mode"] == "bench" else shipped_loops)(c, setup, topology, ctx)
        fpt = flops_per_token(spec["model"], spec["seq"])
        loops = {}
        for name in ("zeroband", "plain"):
            step = spec[name]()
            seconds, mem = timed(step, setup)
            tps = spec["tokens_per_step"] / seconds
            loops[name] = {"tokens_s": tps, "step_s": seconds, "mfu": fpt * tps / (peak * 1e12), "peak_gb": mem}
            if c["profile"] and (c["mode"] == "bench" or name == "zeroband"):
                loops[name]["attention"] = attention_ops(profile(step, setup), setup.device.type == "cuda")
            del step
            torch._dynamo.reset()  # compiled graphs hold the model: free it before the next loop
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutdown()
    extra = {k: spec[k] for k in ("accumulation", "micro_batch", "activation_checkpointing", "vocab") if k in spec}
    return {"loops": loops, "ratio": loops["zeroband"]["tokens_s"] / loops["plain"]["tokens_s"],
            "params": num_params(spec["model"]), "flops_per_token": fpt, "seq": spec["seq"],
            "tokens_per_step": spec["tokens_per_step"], "peak_tflops": peak, **extra}


# ---------------------------------------------------------------------------------- outer step


def _outer_site(c: dict[str, Any]) -> dict[str, Any]:
    """One of 2 forked sites: configs/1B.toml's model and [diloco], the outer step timed by part."""
    import torch
    from bench_step import kernels_used, pass_floors, timed_outer_steps

    from zeroband.config import load_config
    from zeroband.mesh import SECRET, fixed_global_group, init_topology, shutdown
    from zeroband.models.llama import Llama
    from zeroband.outer.diloco import DiLoCo
    from zeroband.world import World

    site, store = int(os.environ["ZEROBAND_SITE_RANK"]), os.environ["ZEROBAND_BENCH_STORE"]
    device = torch.device("cuda", 0) if c["device"] == "cuda" else torch.device("cpu")
    cfg = load_config(REPO / c["config"], list(c["overrides"]))
    topology = init_topology(World(0, 1, 0, site, 2, device), store, "gpu-suite-outer", 300, "gloo",
                             secret=b"gpu-suite-outer-secret")
    group = fixed_global_group(topology, "gpu-suite-outer", mark=SECRET)
    try:
        with torch.device("meta"):
            model = Llama(cfg.model)
        model.to_empty(device=device)
        model.init_weights(0)  # the same start on both sites
        params = [p.data for p in model.parameters()]
        gen = torch.Generator(device).manual_seed(1 + site)
        deltas = [torch.randn(p.shape, generator=gen, device=device).mul_(1e-3) for p in params]
        outer = DiLoCo(model, cfg.diloco.model_copy(update={"inner_steps": 1}), topology, group=group)
        outer.start()
        outer.threads = c["threads"]
        torch.set_num_threads(c["threads"])
        row = {"threads": c["threads"], "steps": timed_outer_steps(outer, params, deltas, c["repeats"]),
               "numel": sum(p.numel() for p in params),
               **pass_floors(params, deltas, group, site)}
        return {"row": row, "kernels": kernels_used(), "comm_dtype": cfg.diloco.comm_dtype, "piece_mb": cfg.diloco.piece_mb,
                "outer_device": cfg.diloco.outer_device}
    finally:
        shutdown()


def run_outer(c: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    from bench_common import run_forked
    from bench_step import summarize

    result = run_forked(_outer_site, 2, 1, (c,), env={"OMP_NUM_THREADS": str(c["threads"])}, timeout=400)
    site0 = result[(0, 0)]
    summary = summarize(site0["row"])
    summary.pop("steps", None)
    return {**summary, **{k: site0[k] for k in ("kernels", "comm_dtype", "piece_mb", "outer_device")}}


# ---------------------------------------------------------------------------------- convergence


def conv_tree(c: dict[str, Any], ctx: dict[str, Any], out_dir: Path) -> tuple[dict[str, Any], int]:
    """The run's config tree (scripts/experiments/convergence.py's, at this scale) and how many sites run.
    Data parallel at equal tokens = one site at k x the batch: the same update as k sites averaging
    their gradients every step."""
    from convergence import Scale, Spec, base_tree, config_tree

    from zeroband.config import deep_merge

    scale = Scale(model=c["model"], vocab=c["vocab"], seq_len=c["seq"], batch=c["batch"], steps=c["steps"],
                  sites=c["sites"], sweep_sites=(), seeds=1, lr=c["lr"], warmup=c["warmup"],
                  eval_interval=c["eval_interval"], eval_batches=c["eval_batches"], device=c["device"])
    base = base_tree(scale, corpus_path(ctx), tokenizer_path(ctx, c["vocab"]))
    diloco = c["method"] == "diloco"
    spec = Spec(f"suite-{c['method']}", "diloco" if diloco else "single", c["sites"] if diloco else 1, c["steps"],
                c["seed"], h=c.get("h", 0), **(c["outer"] if diloco else {}))
    tree = config_tree(spec, base, out_dir)
    tree = deep_merge(tree, {"train": {"mixed_precision": "bf16" if c["bf16"] else "fp32"}, "log": {"wandb_mode": "disabled"}})
    if c["method"] == "dp":  # k x the batch; k times fewer validation batches of it: the same rows, in order
        big, (evals, rest) = c["sites"] * c["batch"], divmod(c["eval_batches"], c["sites"])
        assert rest == 0, f"eval_batches {c['eval_batches']} must be a multiple of the sites {c['sites']}"
        tree = deep_merge(tree, {"train": {"global_batch": big, "micro_batch": big}, "eval": {"batches": evals}})
    return tree, spec.sites


def _conv_site(tree: dict[str, Any], sites: int) -> str:
    """One site of a conv row, in a process of its own: the production trainer from its config tree
    (as `zeroband launch` runs each site), the cross-site group over gloo. Returns its run directory."""
    from zeroband.config import deep_merge, validate_config
    from zeroband.train import site_dirs, train
    from zeroband.world import world_from_env

    if "diloco" in tree:
        tree = deep_merge(tree, {"sites": {"site_rank": int(os.environ["ZEROBAND_SITE_RANK"]), "site_count": sites,
                                           "store": os.environ["ZEROBAND_BENCH_STORE"]}})
    cfg = validate_config(tree)
    train(cfg)
    return str(site_dirs(cfg, world_from_env(cfg))[0])


def run_conv(c: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """k sites as k forked processes sharing the device (one process for single and dp). The parent
    loads the corpus once first, so the sites find the datasets cache built instead of racing to build it."""
    from bench_common import CORES, prewarm, run_forked

    from zeroband.config import validate_config
    from zeroband.data.loader import load_documents

    out_dir = Path(tempfile.mkdtemp(prefix="gpu-suite-conv-"))
    try:
        tree, sites = conv_tree(c, ctx, out_dir)
        prewarm()
        load_documents(validate_config(tree).data)
        try:  # the trainer's end-of-run loss plot: its import paid once here, not in every site
            import matplotlib.pyplot  # noqa: F401
        except ImportError:
            pass
        threads = 1 if ctx["quick"] else max(1, CORES // sites)
        t0 = time.perf_counter()
        done = run_forked(_conv_site, sites, 1, (tree, sites), env={"OMP_NUM_THREADS": str(threads)},
                          timeout=3600)  # the call's deadline stops it sooner
        wall_s = time.perf_counter() - t0
        records = [json.loads(x) for x in open(Path(done[(0, 0)]) / "metrics.jsonl") if x.strip()]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    tokens_per_step = tree["train"]["global_batch"] * c["seq"] * sites
    return summarise_conv(records, tokens_per_step, wall_s, train_bytes(ctx))


def summarise_conv(records: list[dict[str, Any]], tokens_per_step: int, wall_s: float, split_bytes: int) -> dict[str, Any]:
    val = [r for r in records if r["kind"] == "val"]
    outer = [r for r in records if r["kind"] == "outer"]
    bytes_per_token = val[-1]["val_loss"] / (math.log(2) * val[-1]["val_bpb"])
    epoch_tokens = split_bytes / bytes_per_token
    curve = [{"step": v["step"], "tokens": v["step"] * tokens_per_step, "epochs": v["step"] * tokens_per_step / epoch_tokens,
              "val_loss": v["val_loss"]} for v in val]
    return {"val_loss": val[-1]["val_loss"], "val_bpb": val[-1]["val_bpb"], "tokens": curve[-1]["tokens"],
            "epochs": curve[-1]["epochs"], "outer_steps": len(outer), "wall_s": wall_s, "curve": curve,
            "wire_bytes": sum(o.get("wire_bytes", 0) for o in outer)}


RUNNERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "speed": run_speed, "outer": run_outer, "conv": run_conv}


def one_line(kind: str, r: dict[str, Any]) -> str:
    if kind == "speed":
        z, p = r["loops"]["zeroband"], r["loops"]["plain"]
        return (f"zeroband {z['tokens_s']:,.0f} tok/s (MFU {100 * z['mfu']:.1f}%), plain {p['tokens_s']:,.0f} tok/s, "
                f"ratio {r['ratio']:.3f}x")
    if kind == "outer":
        return f"outer step {r['outer_step_s']:.2f} s, local work {r['local_s']:.2f} s"
    return f"val loss {r['val_loss']:.4f}, {r['epochs']:.2f} epochs, {r['outer_steps']} outer steps, {r['wall_s']:.0f} s"


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/gpu_suite.py --help\n(scripts/gpu_runners.py is how gpu_suite.py measures its rows; it does nothing on its own)")
