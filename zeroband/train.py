"""The training loop: one site, or one site of a DiLoCo run. Read it top to bottom.

    torchrun --nproc-per-node 2 -m zeroband.train configs/demo.toml [--section.key value ...]
"""

from __future__ import annotations

import hashlib
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from zeroband import checkpoint as ckpt
from zeroband.config import Config, ConfigError, dump_config, load_config
from zeroband.cross_site_dp import CrossSiteDataParallel
from zeroband.data.loader import PackedBatches, resolve_files
from zeroband.data.tokenizer import TextTokenizer
from zeroband.diloco import DiLoCo, SingleSite
from zeroband.elastic import ElasticDiLoCo
from zeroband.faults import maybe_inject
from zeroband.membership.auth import TrustError, flatten_fingerprint, run_secret
from zeroband.membership.resume import ResumeMismatch, agree_resume
from zeroband.membership.store import StoreUnreachable
from zeroband.mesh import Topology, admission_mark, init_topology, shutdown
from zeroband.metrics import ComputeClock, MetricsLogger, peak_flops, peak_memory_mb
from zeroband.models.hf import load_hf_state
from zeroband.models.llama import (
    Llama,
    apply_activation_checkpointing,
    cross_entropy_loss,
    flops_per_token,
    load_full_state,
    model_blocks,
    num_params,
)
from zeroband.optim import build_optimizer, build_scheduler, lr_factor
from zeroband.watchdog import Interrupted, PeerLost, PeerTimeout, request_stop
from zeroband.world import World, check_devices, world_from_env

log = logging.getLogger("zeroband")


@dataclass
class Progress:
    """Counters that a resume must restore exactly."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens = state["step"], state["tokens"]


# ---------------------------------------------------------------------------------- building


def build_model(cfg: Config, topology: Topology) -> Llama:
    """Fixed order: meta device -> activation checkpointing -> compile -> FSDP2 -> weights."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    # FSDP2 shards over the site's ranks and casts for bf16 mixed precision; a 1-rank fp32 site has
    # nothing to shard, and the wrapping would only cost hooks and DTensor dispatch (~30% per step
    # on the demo model), so like torchtitan we wrap only when there is a degree to shard over.
    shard = topology.world.world_size > 1 or cfg.train.mixed_precision == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.train.mixed_precision == "bf16" else MixedPrecisionPolicy()
    for block in model_blocks(model):
        if cfg.train.compile:
            block.compile()
        if shard:
            fully_shard(block, mesh=topology.site_mesh, mp_policy=mp)
    if shard:
        fully_shard(model, mesh=topology.site_mesh, mp_policy=mp)
    model.to_empty(device=topology.world.device)
    if cfg.model.init_from:
        model.reset_rope(topology.world.device)
        load_full_state(model, load_hf_state(cfg.model.init_from, cfg.model))
    else:
        model.init_weights(cfg.train.seed)
    return model


def check_vocab(cfg: Config, tokenizer: TextTokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"tokenizer {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens but model.vocab_size="
            f"{cfg.model.vocab_size}: token ids would overflow the embedding. Fix: set "
            f"--model.vocab_size {tokenizer.vocab_size} (or larger), or use a smaller tokenizer"
        )


def checkpoint_meta(cfg: Config) -> dict[str, Any]:
    return {"model": cfg.model.model_dump(exclude={"init_from", "preset"}), "fingerprint": cfg.fingerprint()}


# ---------------------------------------------------------------------------------- one step


def forward_backward(model: torch.nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     device: torch.device) -> float:
    """Accumulate gradients over the micro-batches; returns the mean loss on this rank."""
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        loss = cross_entropy_loss(model(inputs.to(device)), targets.to(device)) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    return total.item()


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip (0 = no clipping, norm still reported), step, zero. Returns the gradient norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item()


def inner_step(model: torch.nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
               optimizer: torch.optim.Optimizer, grad_clip: float, device: torch.device) -> tuple[float, float]:
    """One single-site optimizer step. Returns (mean loss on this rank, grad norm)."""
    loss = forward_backward(model, micro_batches, device)
    return loss, optimizer_step(model, optimizer, grad_clip)


Outer = DiLoCo | ElasticDiLoCo | CrossSiteDataParallel | SingleSite


def build_outer(cfg: Config, model: torch.nn.Module, topology: Topology, progress: Progress,
                scheduler: torch.optim.lr_scheduler.LRScheduler, vocab_size: int) -> Outer:
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    if cfg.diloco is None:
        return SingleSite()
    if cfg.diloco.mode == "data_parallel":
        return CrossSiteDataParallel(model, cfg.diloco, topology)
    if cfg.diloco.elastic:
        return ElasticDiLoCo(model, cfg.diloco, topology, cfg.name, progress, scheduler, topology.fingerprint,
                             tokens_per_step)
    return DiLoCo(model, cfg.diloco, topology, tokens_per_step,
                  lr_factor=lambda step: lr_factor(step, cfg.train.steps, cfg.optim))


# DiLoCo settings that are each site's own (where it is, how patient it is); every other one must match,
# so a setting added later is compared by default.
PER_SITE_DILOCO_KEYS = {"store", "host_store", "secret", "insecure", "site_rank", "timeout_s", "heartbeat_s",
                        "dead_after_s", "grace_s", "start_grace_s", "join_timeout_s", "max_retries", "log_checksum"}


def run_fingerprint(cfg: Config, tokenizer: TextTokenizer, ranks_per_site: int) -> dict[str, str]:
    """Every setting that must match across sites, as flat `key -> value` (a mismatch names the key).
    Batch sizes may differ (a slower site trains on less); model, optimiser, schedule, outer
    settings, wire format, rank count, tokenizer and data may not."""
    return flatten_fingerprint({
        "model": cfg.model.model_dump(exclude={"init_from", "preset"}), "optim": cfg.optim.model_dump(),
        "ranks_per_site": ranks_per_site,
        "train": cfg.train.model_dump(include={"steps", "seed", "mixed_precision"}),
        "tokenizer": {"vocab": tokenizer.vocab_size, "sha256": tree_sha256(cfg.data.tokenizer)},
        "data": cfg.data.model_dump(include={"hub_name", "text_field", "seq_len", "shuffle_seed", "val_fraction"})
        | {"files": data_identity(cfg.data.path) if not cfg.data.hub_name else []},
        "diloco": cfg.diloco.model_dump(exclude=PER_SITE_DILOCO_KEYS) if cfg.diloco else {},
    })


def tree_sha256(path: str) -> str:
    """sha256 over a file, or over a directory's files (names and contents): the tokenizer's identity."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root] if root.is_file() else []
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def data_identity(path: str | list[str]) -> list[str]:
    """`name:size` of every training file: the same corpus under another mount point still matches."""
    try:
        return [f"{Path(f).name}:{Path(f).stat().st_size}" for f in resolve_files(path)]
    except FileNotFoundError:
        return [str(path)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], topology: Topology) -> float:
    """Mean validation loss (nats/token) over the site: every rank evaluates its own share."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=topology.world.device)
    for inputs, targets in batches:
        loss = cross_entropy_loss(model(inputs.to(topology.world.device)), targets.to(topology.world.device))
        total += torch.tensor([loss.item() * targets.numel(), targets.numel()], dtype=torch.float64, device=total.device)
    model.train()
    topology.site_all_reduce(total)
    return (total[0] / total[1]).item()


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- the loop


def train(cfg: Config) -> dict[str, Any]:
    world = world_from_env(cfg)
    d = cfg.diloco
    secret = run_secret(d.secret, d.insecure, world.site_count) if d else None  # before any port opens
    topology = init_topology(world, d.store if d else None, cfg.name, d.timeout_s if d else 600.0,
                             d.backend if d else "gloo", host_store=d.host_store if d else False,
                             build_group=not (d and d.elastic), mark=admission_mark(d.secret if d else None),
                             secret=secret)
    try:
        return _train(cfg, world, topology)
    finally:
        shutdown()


@dataclass
class Run:
    """Everything the loop touches, built once by `setup`."""

    cfg: Config
    world: World
    topology: Topology
    model: Llama
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_data: PackedBatches
    eval_set: list[tuple[torch.Tensor, torch.Tensor]]
    bytes_per_token: float
    outer: Outer
    progress: Progress
    clock: ComputeClock
    run_dir: Path
    ckpt_root: Path

    @property
    def stateful(self) -> dict[str, Any]:
        """Per-rank state a checkpoint carries beside the model and inner optimizer."""
        return {"scheduler": self.scheduler, "data": self.train_data, "outer": self.outer,
                "progress": self.progress, "clock": self.clock}


def setup(cfg: Config, world: World, topology: Topology) -> Run:
    site_part = f"site{world.site_rank}" if cfg.diloco else ""
    run_dir, ckpt_root = cfg.run_dir / site_part, cfg.checkpoint_dir / site_part
    if world.rank == 0:
        dump_config(cfg, run_dir / "config.toml")
    torch.manual_seed(cfg.train.seed)
    tokenizer = TextTokenizer.load(cfg.data.tokenizer)
    check_vocab(cfg, tokenizer)
    topology.fingerprint = run_fingerprint(cfg, tokenizer, world.world_size)
    train_data = PackedBatches(cfg.data, tokenizer, world.dp_rank, world.dp_size, "train")
    # Validation is sharded over the site's ranks only, so every site scores the same documents.
    val_data = PackedBatches(cfg.data, tokenizer, world.rank, world.world_size, "val")
    eval_set = val_data.val_batches(cfg.eval.batches, cfg.train.micro_batch)
    model = build_model(cfg, topology)
    named = list(model.named_parameters())
    optimizer = build_optimizer([p for _, p in named], cfg.optim, [n for n, _ in named])
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    progress = Progress()
    outer = build_outer(cfg, model, topology, progress, scheduler, tokenizer.vocab_size)
    return Run(cfg, world, topology, model, optimizer, scheduler, train_data, eval_set, val_data.bytes_per_token,
               outer, progress, ComputeClock(), run_dir, ckpt_root)


def resume_or_start(run: Run) -> bool:
    """Load the newest valid checkpoint if there is one (True), else make the sites agree (False)."""
    found = agreed_checkpoint(run, ckpt.find_checkpoint(run.ckpt_root, run.cfg.checkpoint.resume))
    if found is not None:
        ckpt.check_compatible(found, checkpoint_meta(run.cfg), run.world.world_size)
        ckpt.load_checkpoint(found, run.model, run.optimizer, run.stateful)
        log.info("resumed from %s (step %d)", found.path, run.progress.step)
    run.outer.start(resumed=found is not None)
    return found is not None


def agreed_checkpoint(run: Run, found: ckpt.CheckpointInfo | None) -> ckpt.CheckpointInfo | None:
    """Fixed DiLoCo: every site resumes from the newest step all sites have (membership/resume.py).
    Elastic sites need no agreement (a restarted site re-joins and receives the live state)."""
    d, world, store = run.cfg.diloco, run.world, run.topology.store
    if d is None or d.elastic or store is None:
        return found
    offer = verified_steps(run.ckpt_root, run.cfg.checkpoint.resume, found)
    prefix = f"zeroband/{run.cfg.name}/shard{world.rank}/"
    step = agree_resume(store, prefix, world.site_rank, world.site_count, offer, d.timeout_s)
    if step is None or (found is not None and found.step == step):
        return found if step is not None else None
    path = ckpt.step_dir(run.ckpt_root, step)
    return ckpt.CheckpointInfo(path, step, ckpt.verify_checkpoint(path))


def verified_steps(root: Path, resume: str, found: ckpt.CheckpointInfo | None) -> list[int]:
    """The steps this site can resume from: every checkpoint under root that verifies (auto),
    the explicit one, or none."""
    if resume != "auto":
        return [found.step] if found is not None else []
    steps = []
    for path in sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")):
        try:
            steps.append(ckpt.verify_checkpoint(path)["step"])
        except ckpt.CheckpointError:
            continue  # find_checkpoint already logged why
    return steps


class StepWindow:
    """Loss and throughput over the steps since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start, self.tokens, self.losses = time.perf_counter(), 0, []

    def add(self, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens

    def record(self, run: Run, grad_norm: float) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tok_s = self.tokens / elapsed
        rec = {
            "loss": site_mean(sum(self.losses) / len(self.losses), run.topology), "grad_norm": grad_norm,
            "lr": run.scheduler.get_last_lr()[0], "tokens": run.progress.tokens, "tokens_per_s": tok_s,
            "compute_utilisation": run.clock.utilisation, "peak_mem_mb": peak_memory_mb(run.world.device),
            "eta_s": (run.cfg.train.steps - run.progress.step) * elapsed / len(self.losses),
        }
        peak = peak_flops(run.world.device)
        if peak:
            rec["mfu"] = flops_per_token(run.cfg.model, run.cfg.data.seq_len) * tok_s / (peak * run.world.world_size)
        self.reset()
        return rec


def train_loop(run: Run, metrics: MetricsLogger) -> dict[str, Any]:
    cfg, world, progress = run.cfg, run.world, run.progress
    accum = cfg.grad_accum_steps(world.world_size)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    losses: list[float] = []
    val: dict[str, float] = {}
    window = StepWindow()
    stop = GracefulStop.install()
    while not run.outer.finished(progress.step, cfg.train.steps):
        batches = [run.train_data.next_batch(cfg.train.micro_batch) for _ in range(accum)]
        t0 = time.perf_counter()
        loss = forward_backward(run.model, batches, world.device)
        device_sync(world.device)
        t1 = time.perf_counter()
        run.outer.sync_gradients()  # per-step cross-site data parallel only; a no-op otherwise
        t2 = time.perf_counter()
        grad_norm = optimizer_step(run.model, run.optimizer, cfg.optim.grad_clip)
        run.scheduler.step()
        device_sync(world.device)
        run.clock.add_compute((t1 - t0) + (time.perf_counter() - t2))
        progress.step += 1
        progress.tokens += tokens_per_step
        losses.append(loss)
        window.add(loss, tokens_per_step)
        maybe_inject("inner", progress.step, world.site_rank, world.rank)

        sync_point = should_save(cfg, progress.step, False) or progress.step == cfg.train.steps
        outer_stats = run.outer.after_inner_step(progress.step - 1, sync_point=sync_point)
        last = run.outer.finished(progress.step, cfg.train.steps)
        if outer_stats is not None:
            metrics.log(progress.step, {**outer_stats.as_dict(), "compute_utilisation": run.clock.utilisation}, "outer")
        if progress.step % cfg.log.interval == 0 or last:
            record = window.record(run, grad_norm)
            metrics.log(progress.step, record)
            metrics.progress(progress.step, record["loss"], record["tokens_per_s"], record["lr"], record["eta_s"])
        if (cfg.eval.interval and progress.step % cfg.eval.interval == 0) or last:
            val = validation_metrics(evaluate(run.model, run.eval_set, run.topology), run.bytes_per_token)
            metrics.log(progress.step, val, "val")
        if should_save(cfg, progress.step, last):
            save(run)
        if stop.agreed(run.topology):  # SIGTERM on any rank of the site: leave cleanly
            log.info("SIGTERM: leaving at step %d after a checkpoint", progress.step)
            run.outer.leave()
            if not should_save(cfg, progress.step, last):
                save(run)
            break
    stop.uninstall()
    if not losses and cfg.checkpoint.save_at_end:  # a site that joined at the very last boundary
        save(run)
    run.outer.leave()  # finished: nobody should wait for this site any more
    return {"losses": losses, "val": val, "steps": progress.step, "tokens": progress.tokens,
            "compute_utilisation": run.clock.utilisation, "run_dir": str(run.run_dir)}


def _train(cfg: Config, world: World, topology: Topology) -> dict[str, Any]:
    run = setup(cfg, world, topology)
    resumed = resume_or_start(run)
    tag = f"site{world.site_rank}" if cfg.diloco else ""
    metrics = MetricsLogger(cfg, run.run_dir, world.rank == 0, cfg.train.steps, run.progress.step, tag=tag)
    if not resumed:
        metrics.log(0, {"params": num_params(cfg.model), "ranks": world.world_size, "sites": world.site_count}, "run")
    try:
        return train_loop(run, metrics)
    finally:
        metrics.close()


def save(run: Run) -> None:
    ckpt.save_checkpoint(run.ckpt_root, run.progress.step, run.model, run.optimizer, run.stateful,
                         checkpoint_meta(run.cfg), run.cfg.checkpoint.keep_last, site=run.world.site_rank)


class GracefulStop:
    """SIGTERM sets a flag; the site's ranks agree on it after every step, so they stop together."""

    def __init__(self) -> None:
        self.requested = False
        self.previous: Any = None

    @classmethod
    def install(cls) -> GracefulStop:
        stop = cls()
        if threading.current_thread() is threading.main_thread():
            stop.previous = signal.signal(signal.SIGTERM, stop._handle)
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        request_stop()  # a wait blocked on a frozen peer gives up within seconds (watchdog.py)

    def agreed(self, topology: Topology) -> bool:
        flag = torch.tensor([float(self.requested)], device=topology.world.device)
        topology.site_all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def uninstall(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def site_mean(value: float, topology: Topology) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=topology.world.device)
    topology.site_all_reduce(t)
    return t.item() / topology.world.world_size


def validation_metrics(loss: float, bytes_per_token: float) -> dict[str, float]:
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_bpb": loss / math.log(2) / bytes_per_token}


def should_save(cfg: Config, step: int, last: bool) -> bool:
    if last:
        return cfg.checkpoint.save_at_end
    return bool(cfg.checkpoint.interval) and step % cfg.checkpoint.interval == 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = argv.pop(0) if argv and not argv[0].startswith("--") else None
    try:
        cfg = load_config(path, argv)
        check_devices(cfg)
        train(cfg)
    except (ConfigError, ckpt.CheckpointError, FileNotFoundError, TrustError, ResumeMismatch) as e:
        print(f"zeroband: error: {e}", file=sys.stderr)
        return 2
    except (PeerTimeout, PeerLost, Interrupted, StoreUnreachable) as e:  # a peer or the store failed: not our config
        print(f"zeroband: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

