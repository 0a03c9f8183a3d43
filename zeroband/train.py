"""The training loop: one site, or one site of a DiLoCo run. Read it top to bottom.

    torchrun --nproc-per-node 2 -m zeroband.train configs/demo.toml [--section.key value ...]
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroband import checkpoint as ckpt
from zeroband import seams
from zeroband.checkpointer import Checkpointer, checkpoint_meta, sync_due
from zeroband.comm.link import LinkPolicy
from zeroband.config import Config, ConfigError, dump_config, load_config, warn_allow_unsigned
from zeroband.data.ledger import Ledger
from zeroband.data.loader import PackedBatches, SiteShare
from zeroband.data.tokenizer import TextTokenizer
from zeroband.fingerprint import run_fingerprint
from zeroband.membership.data import SharedData
from zeroband.membership.elastic import ElasticMembership
from zeroband.membership.resume import ResumeMismatch, agree_resume
from zeroband.membership.rounds import RunComplete
from zeroband.mesh import GlobalGroup, Topology, admission_mark, fixed_global_group, init_topology, shutdown
from zeroband.metrics import ComputeClock, MetricsLogger, insecure_choices, peak_flops, peak_memory_mb
from zeroband.models.llama import Llama, flops_per_token, num_params
from zeroband.optim import build_optimizer, build_scheduler, follow_schedule, hyperparameters_kept, lr_factor
from zeroband.outer.base import NoOuter, Outer
from zeroband.outer.data_parallel import CrossSiteDataParallel
from zeroband.outer.diloco import DiLoCo
from zeroband.outer.fragments import Fragments
from zeroband.outer.lanes import reshard_rank_state
from zeroband.parallelize import build_model
from zeroband.resume_rules import ConfigChange, config_changes, refusal
from zeroband.rundir import retire_previous_run, run_dir_lock
from zeroband.step import (
    ComputeTimer,
    evaluate,
    forward_backward,
    optimizer_step,
    settle_step,
    validation_metrics,
)
from zeroband.store.client import StoreUnreachable, etcd_access
from zeroband.store.guard import die_with_parent
from zeroband.trust.auth import TrustError
from zeroband.trust.secret import RunSecret, resolve_secret
from zeroband.trust.signed import stop_keepers
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


def check_vocab(cfg: Config, tokenizer: TextTokenizer) -> None:
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"tokenizer {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens but model.vocab_size="
            f"{cfg.model.vocab_size}: token ids would overflow the embedding. Fix: set "
            f"--model.vocab_size {tokenizer.vocab_size} (or larger), or use a smaller tokenizer"
        )


class Schedule:
    """The inner schedule as a joining site takes it from a peer: the scheduler's state, and the
    learning rates it set on the optimizer (load_state_dict alone leaves those as they were)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


def build_outer(cfg: Config, model: torch.nn.Module, topology: Topology, group: GlobalGroup | None,
                progress: Progress, scheduler: torch.optim.lr_scheduler.LRScheduler) -> Outer:
    """The outer method of `cfg`; `group`: the fixed global group (None: one site, or elastic)."""
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    if cfg.diloco is None:
        return NoOuter()
    if cfg.diloco.mode == "data_parallel":
        if topology.lanes:
            raise ConfigError(f"diloco.mode='data_parallel' needs every site to start the same number of ranks "
                              f"(they have {topology.site_ranks}); use diloco.mode='diloco' to mix site shapes")
        assert group is not None, "cross-site data parallel runs on the fixed global group (open_topology)"
        return CrossSiteDataParallel(model, cfg.diloco, topology, group)

    def factor(step: int) -> float:  # the inner schedule's multiplier at inner step `step` (0-based)
        return lr_factor(step, cfg.train.steps, cfg.optim)

    diloco = cfg.diloco

    def fragments(lr: Callable[[int], float], **on: Any) -> Fragments:
        try:
            return Fragments(model, diloco, topology, tokens_per_step, lr, cfg.train.steps, **on)
        except ValueError as e:  # more fragments than parameter tensors: one line naming the key
            raise ConfigError(str(e)) from None

    if not cfg.diloco.elastic:
        fixed = fragments(factor, group=group) if cfg.diloco.fragments > 1 else \
            DiLoCo(model, cfg.diloco, topology, tokens_per_step, lr_factor=factor, group=group)
        # under a time budget, which boundaries block: read at the run step (train.steps and checkpoint
        # intervals are multiples of inner_steps, so both fall on boundaries); with fragments, the last
        # fragment's boundary is the run's
        clock = fixed.fragments[-1].clock if isinstance(fixed, Fragments) else fixed.clock
        clock.sync_at = lambda run_step: sync_due(cfg.checkpoint, run_step, cfg.train.steps)
        return fixed
    # A joiner takes the outer state, progress and schedule from a peer, in the round it applies:
    # the run's step is then `progress`, which every member of a round holds alike (rounds of
    # diloco.round_seconds refuse outer_lr_schedule = "inner"), so they take the same outer lr.
    def run_end() -> int | None:  # after a commit: the step the run ended at (the loop's own rule), or None
        return progress.step if outer.finished(progress.step, cfg.train.steps) else None

    membership = ElasticMembership(cfg.diloco, cfg.sites, topology, cfg.name, topology.fingerprint,
                                   cfg.train.steps, run_end)
    for key, state in (("progress", progress), ("scheduler", Schedule(scheduler))):
        membership.register_state_dict_fn(key, state.load_state_dict, state.state_dict)
    outer: Outer
    if cfg.diloco.fragments > 1:
        outer = fragments(lambda _: factor(progress.step - 1), membership=membership)
    else:
        outer = DiLoCo(model, cfg.diloco, topology, tokens_per_step, membership=membership,
                       lr_factor=lambda _: factor(progress.step - 1))
    return outer


# ---------------------------------------------------------------------------------- the loop


def train(cfg: Config) -> dict[str, Any]:
    world = world_from_env(cfg)
    # the run's secret, resolved once (before any port opens) and handed down: groups, store, checkpoints
    secret = resolve_secret(cfg.sites.secret, cfg.sites.insecure, world.site_count if cfg.diloco else 1)
    if world.rank == 0:
        warn_allow_unsigned(cfg)  # the opt-out's one loud line; recorded in metrics.jsonl too
    with run_dir_lock(site_dirs(cfg, world)[0], world.rank == 0):  # a second run of this name stops here
        topology, group = open_topology(cfg, world, secret)
        try:
            return run_training(build_run(cfg, world, topology, group))
        finally:
            shutdown(topology, group)  # in order, while the interpreter is alive (mesh.py)


def open_topology(cfg: Config, world: World, secret: RunSecret | None) -> tuple[Topology, GlobalGroup | None]:
    """The site mesh; for DiLoCo also the store and (unless elastic: built per generation) the global group."""
    if cfg.diloco is None:  # one site: no store, nothing crosses sites
        return init_topology(world, None, cfg.name, 600.0, "gloo", secret=secret), None
    s = cfg.sites
    topology = init_topology(world, s.store, cfg.name, s.timeout_s, s.backend, host_store=s.host_store, secret=secret,
                             access=etcd_access(s))
    if cfg.diloco.elastic:
        return topology, None
    return topology, fixed_global_group(topology, cfg.name, s.backend, admission_mark(secret), LinkPolicy.of(s),
                                        shapes=lambda: param_shapes(cfg))


def param_shapes(cfg: Config) -> list[tuple[int, ...]]:
    """The model's parameter shapes, in `parameters()` order (built on meta: no memory, no init)."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in Llama(cfg.model).parameters()]


@dataclass
class Run:
    """Everything the loop touches, built once by `build_run`."""

    cfg: Config
    world: World
    topology: Topology
    model: Llama
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # build_scheduler's
    train_data: PackedBatches
    eval_set: list[tuple[torch.Tensor, torch.Tensor]]
    bytes_per_token: float
    outer: Outer
    progress: Progress
    clock: ComputeClock
    run_dir: Path
    ckpt_root: Path
    checkpointer: Checkpointer
    group: GlobalGroup | None = None  # the fixed global group (None: one site, or elastic)
    run_id: str = ""  # set by resume_or_start: new at a fresh start, the checkpoint's on a resume
    changes: list[ConfigChange] = field(default_factory=list)  # settings a resume changed (resume_rules.py)
    ledger: SharedData | None = None  # an elastic run's data ledger (zeroband/data/ledger.py)

    @property
    def stateful(self) -> dict[str, Any]:
        """Per-rank state a checkpoint carries beside the model and inner optimizer."""
        return self.checkpointer.stateful


def site_dirs(cfg: Config, world: World) -> tuple[Path, Path]:
    """This site's run directory and checkpoint directory (each DiLoCo site has its own)."""
    site_part = f"site{world.site_rank}" if cfg.diloco else ""
    return cfg.run_dir / site_part, cfg.checkpoint_dir / site_part


def build_run(cfg: Config, world: World, topology: Topology, group: GlobalGroup | None = None) -> Run:
    """The one way to build a run (train, sim, scripts, tests): model, data, inner and outer
    optimizers, checkpointer, each outer object through the seams (zeroband/seams.py)."""
    run_dir, ckpt_root = site_dirs(cfg, world)
    torch.manual_seed(cfg.train.seed)
    tokenizer = TextTokenizer.load(cfg.data.tokenizer)
    check_vocab(cfg, tokenizer)
    topology.fingerprint = run_fingerprint(cfg, tokenizer, world.ranks_per_site)
    train_data = (SiteShare(cfg.data, tokenizer, world.site_rank, world.site_count, world.ranks_per_site, world.rank)
                  if topology.lanes else PackedBatches(cfg.data, tokenizer, world.dp_rank, world.dp_size, "train"))
    # Validation is sharded over the site's ranks only, so every site scores the same documents.
    val_data = PackedBatches(cfg.data, tokenizer, world.rank, world.ranks_per_site, "val")
    eval_set = val_data.val_batches(cfg.eval.batches, cfg.train.micro_batch)
    model = build_model(cfg, topology)
    named = list(model.named_parameters())
    optimizer = build_optimizer([p for _, p in named], cfg.optim, [n for n, _ in named])
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    progress = Progress()
    wrap = seams.current()  # what production builds is what the loop gets, unless a test wraps it
    built = build_outer(cfg, model, topology, group, progress, scheduler)
    ledger = shared_data(cfg, topology, train_data, built)
    outer = wrap.outer(built, model)
    clock = ComputeClock()
    stateful: dict[str, ckpt.Stateful] = {"scheduler": scheduler, "data": train_data, "outer": outer, "progress": progress, "clock": clock}
    if ledger is not None:
        stateful["ledger"] = ledger
    checkpointer = wrap.checkpointer(Checkpointer(cfg, ckpt_root, model, optimizer, stateful, topology.secret,
                                                world.site_rank))
    return Run(cfg, world, topology, model, optimizer, scheduler, train_data, eval_set, val_data.bytes_per_token,
               outer, progress, clock, run_dir, ckpt_root, checkpointer, group, ledger=ledger)


def shared_data(cfg: Config, topology: Topology, loader: PackedBatches, outer: Outer) -> SharedData | None:
    """An elastic DiLoCo run's data ledger (zeroband/data/ledger.py), a participant of its rounds and
    part of the state a joiner receives; None for any other run (fixed slots of the order)."""
    if not isinstance(outer, DiLoCo | Fragments) or not isinstance(outer.membership, ElasticMembership):
        return None
    membership = outer.membership
    ledger = Ledger(loader.train_documents, topology.world.ranks_per_site, target=4 * cfg.data.span_docs,
                    hold_late=outer.cfg.late_weight > 0)
    shared = SharedData(loader, ledger, topology, membership.signed, membership.prefix, lambda: outer.last_reduce)
    membership.add_participant(shared)
    membership.register_state_dict_fn("ledger", shared.load_state_dict, shared.state_dict, shared.checksum)
    return shared


def resume_or_start(run: Run) -> ckpt.CheckpointInfo | None:
    """Load the newest valid checkpoint if there is one (returned), else make the sites agree."""
    found = agreed_checkpoint(run, ckpt.resume_checkpoint(run.ckpt_root, run.cfg.checkpoint.resume,
                                                          run.topology.secret, run.cfg.checkpoint.allow_unsigned,
                                                          run.checkpointer.owner))
    if found is not None:
        run.changes = resume_changes(run, found)
        ckpt.check_compatible(found, checkpoint_meta(run.cfg), run.world.ranks_per_site, reshardable(run.cfg))
        load_state(run, found, run.stateful)
        log.info("resumed from %s (step %d)", found.path, run.progress.step)
    run.run_id = (found and found.manifest.get("run_id")) or site_agreed(ckpt.new_run_id())
    run.checkpointer.run_id = run.run_id
    if found is not None and run_complete(run):
        return found  # nothing left to train: no outer start, no collective with the other sites
    run.outer.start(resumed=found is not None)
    stop_keepers()  # every site took part in the start's collectives: all read our values of its waits
    return found


def resume_changes(run: Run, found: ckpt.CheckpointInfo) -> list[ConfigChange]:
    """The settings this resume changes from the checkpoint's config (they apply from here on);
    ConfigError naming the first one a resume may not change."""
    old = found.manifest.get("config")
    if old is None:  # written before manifests carried the config: nothing to compare with
        return []
    changes = config_changes(old, run.cfg.model_dump(mode="json"))
    if (refused := refusal(changes, str(found.path))) is not None:
        raise ConfigError(refused)
    return changes


def load_state(run: Run, found: ckpt.CheckpointInfo, stateful: dict[str, Any]) -> None:
    """A checkpoint's state under this run's optimizer settings and schedule (optim.hyperparameters_kept)."""
    reshard = partial(reshard_rank_state, ranks=run.world.ranks_per_site, rank=run.world.rank)
    with hyperparameters_kept(run.optimizer, run.scheduler):
        ckpt.load_checkpoint(found, run.model, run.optimizer, stateful, reshard if reshardable(run.cfg) else None)


def reshardable(cfg: Config) -> bool:
    """A fixed DiLoCo run may resume with another rank count per site (sites of different shapes)."""
    return cfg.diloco is not None and not cfg.diloco.elastic and cfg.diloco.mode == "diloco"


def record_start(run: Run, fresh: bool) -> None:
    """Rank 0, once training goes ahead: move a previous run aside (a fresh start deletes nothing),
    write the config this run really uses, and print each setting the resume changed."""
    if fresh:
        retire_previous_run(run.run_dir, run.ckpt_root, run.cfg.checkpoint.keep_old)
    dump_config(run.cfg, run.run_dir / "config.toml")
    for change in run.changes:
        print(change.line(), flush=True)


def site_agreed(value: str) -> str:
    """Rank 0's value on every rank of the site."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def run_complete(run: Run) -> bool:
    return run.outer.finished(run.progress.step, run.cfg.train.steps)


def agreed_checkpoint(run: Run, found: ckpt.CheckpointInfo | None) -> ckpt.CheckpointInfo | None:
    """Fixed DiLoCo: every site resumes from the newest step all sites have (membership/resume.py).
    Elastic sites need no agreement (a restarted site re-joins and receives the live state)."""
    d, world, store = run.cfg.diloco, run.world, run.topology.store
    if d is None or d.elastic or store is None:
        return found
    offer = verified_steps(run, found)
    # its prefix is this start's own (mesh.py): old offers are never read. Sites of different shapes:
    # every lane's group agrees (each rank talks on all of its lanes, in the run's lane order)
    groups: list[GlobalGroup | None] = [g for _, g in run.topology.lanes] or [run.group]
    for group in groups:
        prefix = group.prefix if group else f"zeroband/{run.cfg.name}/shard{world.rank}/"
        step = agree_resume(store, prefix, world.site_rank, world.site_count, offer, run.cfg.sites.timeout_s,
                            group.auth.subkey("resume") if group else None)
    if step is None or (found is not None and found.step == step):
        return found if step is not None else None
    path = next(p for p, s in ckpt.step_dirs(run.ckpt_root) if s == step)  # step_N, or step_N.old after a crash
    return ckpt.CheckpointInfo(path, step, trusted_manifest(run, path))


def trusted_manifest(run: Run, path: Path) -> dict[str, Any]:
    return ckpt.verify_trusted(path, run.topology.secret, run.ckpt_root, run.cfg.checkpoint.allow_unsigned,
                               owner=run.checkpointer.owner)


def verified_steps(run: Run, found: ckpt.CheckpointInfo | None) -> list[int]:
    """The steps this site can resume from: every checkpoint of its own that verifies and is
    trusted (auto), the explicit one, or none."""
    if run.cfg.checkpoint.resume != "auto":
        return [found.step] if found is not None else []
    steps = []
    for path, _ in ckpt.step_dirs(run.ckpt_root):
        try:
            steps.append(trusted_manifest(run, path)["step"])
        except ckpt.CheckpointError:
            continue  # find_checkpoint already logged why
    return steps


class StepWindow:
    """Loss and throughput over the steps since the last log line. The losses are already site
    means (settle_step), so their average is the site's without another all-reduce."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start, self.tokens = time.perf_counter(), 0
        self.losses: list[float] = []

    def add(self, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens

    def record(self, run: Run, grad_norm: float) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        tok_s = self.tokens / elapsed
        rec = {
            "loss": sum(self.losses) / len(self.losses), "grad_norm": grad_norm,
            "lr": float(run.scheduler.get_last_lr()[0]), "tokens": run.progress.tokens, "tokens_per_s": tok_s,
            "compute_utilisation": run.clock.utilisation, "peak_mem_mb": peak_memory_mb(run.world.device),
            "eta_s": (run.cfg.train.steps - run.progress.step) * elapsed / len(self.losses),
        }
        peak = peak_flops(run.world.device)
        if peak:
            rec["mfu"] = flops_per_token(run.cfg.model, run.cfg.data.seq_len) * tok_s / (peak * run.world.ranks_per_site)
        self.reset()
        return rec


def train_loop(run: Run, metrics: MetricsLogger) -> dict[str, Any]:
    cfg, world, progress, saver = run.cfg, run.world, run.progress, run.checkpointer
    accum = cfg.grad_accum_steps(world.ranks_per_site)
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    losses: list[float] = []  # each step's site-mean loss (a 1-rank site's own), as returned
    val: dict[str, float] = {}
    window = StepWindow()
    rollbacks = 0
    timer = ComputeTimer(world.device)
    stop, stopping = GracefulStop.install(), False
    while not run.outer.finished(progress.step, cfg.train.steps):
        batches = [run.train_data.next_batch(cfg.train.micro_batch) for _ in range(accum)]
        timer.mark()
        loss_t = forward_backward(run.model, batches, world.device)
        timer.mark()
        run.outer.sync_gradients()  # per-step cross-site data parallel only; a no-op otherwise
        timer.mark()
        grad_norm_t = optimizer_step(run.model, run.optimizer, cfg.optim.grad_clip)
        timer.mark()
        run.scheduler.step()
        result = settle_step(loss_t, grad_norm_t, run.topology)  # the step's one wait for the device
        loss, grad_norm = result.loss, result.grad_norm
        if not result.finite:  # before any outer step, log or save
            timer.seconds()
            rollbacks = on_nonfinite(run, metrics, loss, grad_norm, rollbacks)
            window.reset()
            continue
        run.clock.add_compute(timer.seconds())
        progress.step += 1
        progress.tokens += tokens_per_step
        losses.append(loss)
        window.add(loss, tokens_per_step)

        sync_point = sync_due(cfg.checkpoint, progress.step, cfg.train.steps)
        outer_stats = run.outer.after_inner_step(progress.step, sync_point=sync_point)
        run_step = run.outer.run_step(progress.step)  # the step itself but under diloco.round_seconds
        follow_schedule(run.scheduler, run_step)
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
        saver.maybe_save(run_step, last)
        if stop.agreed(run.topology):  # SIGTERM on any rank of the site: leave cleanly
            log.info("SIGTERM: leaving at step %d after a checkpoint", progress.step)
            stopping = True
            break
    stop.uninstall()
    run.outer.leave()  # finished or stopping: nobody should wait for this site any more (once)
    # Always when stopping early; at the end as configured (a site that joined at the very last
    # boundary trained no step and is saved here).
    saver.maybe_save(run.outer.run_step(progress.step), last=True, stopping=stopping)
    return {"losses": losses, "val": val, "steps": progress.step, "tokens": progress.tokens,
            "compute_utilisation": run.clock.utilisation, "run_dir": str(run.run_dir)}


def run_training(run: Run, report: bool = True) -> dict[str, Any]:
    """Resume or start, then train to the end; `report`: rank 0 prints the summary afterwards."""
    cfg, world = run.cfg, run.world
    try:
        found = resume_or_start(run)
    except RunComplete as done:  # elastic: this site came after the run's last round
        return joined_after_the_end(run, done, None)
    if found is not None and run_complete(run):
        if world.rank == 0:
            print(f"run complete: {found.path} is step {run.progress.step} of {cfg.train.steps}; nothing to train "
                  "(raise train.steps to go on, or start a new run with --checkpoint.resume none)", flush=True)
        return nothing_trained(run)
    keep = run.progress.step if found is not None or run.progress.step else -1
    if world.rank == 0:
        record_start(run, fresh=keep == -1)
    metrics = open_metrics(run, found, keep)
    try:
        result = train_loop(run, metrics)
    except RunComplete as done:  # left out of the run's last round: the event is in metrics.jsonl already
        return joined_after_the_end(run, done, metrics)
    finally:
        metrics.close()
    if report and world.rank == 0:
        print_summary(run)
    return result


def nothing_trained(run: Run) -> dict[str, Any]:
    return {"losses": [], "val": {}, "steps": run.progress.step, "tokens": run.progress.tokens,
            "complete": True, "run_dir": str(run.run_dir)}


def joined_after_the_end(run: Run, done: RunComplete, metrics: MetricsLogger | None) -> dict[str, Any]:
    """An elastic site that came after the run's last round: one line, and its "run_complete" record in
    metrics.jsonl (kept as it is: nothing of this site is rewound or moved aside, nor given to the ledger)."""
    if metrics is None:
        metrics = MetricsLogger(run.cfg, run.run_dir, run.world.rank == 0, run.cfg.train.steps, run.progress.step,
                                tag=f"site{run.world.site_rank}", keep_through=None)
        metrics.log(run.progress.step, done.event, "membership")
        metrics.close()
    if run.world.rank == 0:
        print(done, flush=True)
    return nothing_trained(run)


def open_metrics(run: Run, found: ckpt.CheckpointInfo | None, keep: int) -> MetricsLogger:
    """metrics.jsonl, continued after `keep` (-1: a fresh start), with the start's own records."""
    cfg, world = run.cfg, run.world
    tag = f"site{world.site_rank}" if cfg.diloco else ""
    metrics = MetricsLogger(cfg, run.run_dir, world.rank == 0, cfg.train.steps, run.progress.step, tag=tag,
                            keep_through=keep)
    run.outer.attach(lambda event: on_membership_event(run, metrics, event))
    if run.ledger is not None:  # each commit's record of the data ledger
        run.ledger.attach(lambda record: metrics.log(run.progress.step, record, "data"))
    unauthenticated = cfg.diloco is not None and world.site_count > 1 and run.topology.secret is None
    metrics.record_insecure(run.progress.step, insecure_choices(cfg, unauthenticated))
    if found is None:
        metrics.log(0, {"params": num_params(cfg.model), "ranks": world.ranks_per_site, "sites": world.site_count,
                        "run_id": run.run_id}, "run")
    else:
        changed = {c.key: [c.old, c.new] for c in run.changes}
        metrics.log(run.progress.step, {"from": str(found.path), "run_id": run.run_id,
                                        **({"changed": changed} if changed else {})}, "resumed")
    return metrics


def on_membership_event(run: Run, metrics: MetricsLogger, event: dict[str, Any]) -> None:
    """Record a membership event; a group's link probe (event "link", one per peer) is a record of its own kind."""
    metrics.log(run.progress.step, event, "link" if event.get("event") == "link" else "membership")


def print_summary(run: Run) -> None:
    """The end of a run, from its own metrics.jsonl: summary lines and a loss plot."""
    from zeroband.tools.report import run_report

    name = f"{run.cfg.name}-site{run.world.site_rank}" if run.cfg.diloco else run.cfg.name
    print(run_report(run.run_dir, run.ckpt_root, name, run.clock.wall_s), flush=True)


class NonFiniteError(RuntimeError):
    """Training diverged (NaN/inf loss or gradient norm); nothing was saved after it."""


def on_nonfinite(run: Run, metrics: MetricsLogger, loss: float, grad_norm: float, rollbacks: int) -> int:
    """Stop with an error, or (train.on_nonfinite = "rollback") reload this run's newest good
    checkpoint with the data stream left where it is. Returns the rollbacks used so far."""
    step = run.progress.step + 1
    metrics.log(step, {"loss": loss, "grad_norm": grad_norm}, "nonfinite")
    good = ckpt.find_checkpoint(run.ckpt_root, "auto", run.topology.secret, run.cfg.checkpoint.allow_unsigned,
                                owner=run.checkpointer.owner)
    good = good if good is not None and good.manifest.get("run_id") == run.run_id else None
    if run.cfg.train.on_nonfinite == "rollback" and good is not None and rollbacks < run.cfg.train.max_rollbacks:
        # Everything but the data position (and the wall clock): replaying the same batches would diverge again.
        keep = {k: v for k, v in run.stateful.items() if k not in ("data", "clock")}
        load_state(run, good, keep)
        log.warning("step %d: non-finite loss or gradient norm (%s, %s); rolled back to %s (rollback %d of %d)",
                    step, loss, grad_norm, good.path, rollbacks + 1, run.cfg.train.max_rollbacks)
        metrics.rewind(run.progress.step)  # the steps after it are redone: no step logged twice
        metrics.log(run.progress.step, {"from": str(good.path), "diverged_at": step}, "rollback")
        return rollbacks + 1
    run.outer.leave()
    where = f"the last good checkpoint is {good.path}" if good else "there is no good checkpoint of this run"
    raise NonFiniteError(
        f"step {step}: non-finite loss or gradient norm (loss {loss}, grad norm {grad_norm}): training diverged "
        f"and was stopped before saving or syncing; {where}. Fix: {nonfinite_fix(run.cfg)}"
    )


def nonfinite_fix(cfg: Config) -> str:
    """What a diverged run can change: a DiLoCo site cannot roll back alone (config.py refuses it)."""
    fix = "lower optim.lr or set optim.grad_clip (e.g. 1.0)"
    if cfg.diloco is not None:
        return fix + ", then launch again: every site resumes from its last good checkpoint"
    return fix + ", or set train.on_nonfinite = \"rollback\""


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
        """Whether the site stops after this step. A 1-rank site has no one to agree with: its own
        flag, read without a device tensor, a collective or a wait for the device (every step)."""
        if topology.world.ranks_per_site == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=topology.world.device)
        topology.site_all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def uninstall(self) -> None:
        """The previous handler back, unless this site is leaving: a further SIGTERM must not cut its
        leave notice or last checkpoint short (PR_SET_PDEATHSIG sends one per thread of an agent
        killed outright; torchrun and SLURM follow up with SIGKILL after their grace anyway)."""
        if self.previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN if self.requested else self.previous)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: an agent killed outright is a SIGTERM, so it leaves
        die_with_parent(os.getppid(), signal.SIGTERM)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = argv.pop(0) if argv and not argv[0].startswith("--") else None
    try:
        cfg = load_config(path, argv)
        check_devices(cfg)
        train(cfg)
    except (ConfigError, ckpt.CheckpointError, FileNotFoundError, TrustError, ResumeMismatch, NonFiniteError) as e:
        print(f"zeroband: error: {e}", file=sys.stderr)
        return 2
    except (PeerTimeout, PeerLost, Interrupted, StoreUnreachable) as e:  # a peer or the store failed: not our config
        print(f"zeroband: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

