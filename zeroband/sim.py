"""k sites of one run in one process: the trainer's own loop on k threads, joined by a real gloo group.

Why: a convergence sweep runs hundreds of small multi-site runs. As k processes per run it pays a
torch import per process (4-20 s here) and k processes fighting over 2 cores; in one process the
k sites share one import and one core, so two runs go side by side, one per core.

Nothing of the algorithm is re-implemented. Each thread is one site of 1 rank and runs
`zeroband.train.build_run` + `run_training` (a resume included), so the inner step, `DiLoCo` (outer step, all-reduce
codecs, direct exchange), `CrossSiteDataParallel` and the metrics are the production code. The
only difference from `zeroband launch` is where the global group comes from: a
`ProcessGroupGloo` per site over an in-process `HashStore` instead of the TCP store, and a
1-rank site needs no site mesh. With torch's intra-op threads set to 1 (as every site process of
a launch on this machine has), a simulated run gives the same numbers as the multi-process run;
tests/integration/test_sim.py checks that bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeroband import seams
from zeroband.comm.group import new_global_group
from zeroband.config import Config, deep_merge, validate_config
from zeroband.mesh import Topology
from zeroband.outer.base import RoundClock
from zeroband.world import World


def site_configs(tree: dict[str, Any], sites: int) -> list[Config]:
    """One validated config per site: the run's tree with that site's identity."""
    if "diloco" not in tree:
        return [validate_config(tree)]
    # The sites share this process's intra-op threads: an outer step must not change that count
    # (torch.set_num_threads is process-wide, and k threads calling it at once can hang OpenMP).
    shared = {"diloco": {"outer_threads": torch.get_num_threads()}}
    return [validate_config(deep_merge(deep_merge(shared, tree), {"sites": {"site_rank": s, "site_count": sites}}))
            for s in range(sites)]


def run_sites(tree: dict[str, Any], sites: int, eval_on: Callable[[int], bool] = lambda s: True,
              step_s: list[float] | None = None) -> dict[str, Any]:
    """Train one run of `sites` sites (1 rank each) on threads; returns site 0's result and the wall time.

    `eval_on(site)` False: that site scores one validation batch instead of the full set (after an
    outer step every site holds the same model, so site 0's score is the run's; saves CPU only).
    `step_s`: rounds of diloco.round_seconds on a virtual clock (`StepClock`), where every inner step
    of site s takes step_s[s] seconds: sites of different speeds, with the same numbers every run.
    """
    cfgs = site_configs(tree, sites)
    own_default = not dist.is_initialized()
    if own_default:  # what a 1-rank site's torchrun would give it (checkpoints use the default group)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    installed = seams.current()
    if step_s is not None:
        seams.use(replace(installed, outer=virtual_clocks(installed.outer, step_s)))
    try:
        return _run_threads(cfgs, eval_on)
    finally:
        seams.use(installed)
        if own_default:
            dist.destroy_process_group()


class StepClock(RoundClock):
    """A round clock on virtual time: every inner step takes `step_s` seconds, so a round of
    diloco.round_seconds ends after the steps that fit in it, whatever the machine's load. What a
    wall clock does on sites of different speeds, reproducibly (the loss side of a measurement;
    waiting and utilisation need real time)."""

    def __init__(self, clock: RoundClock, step_s: float) -> None:
        if not clock.cfg.round_seconds:
            raise ValueError("a virtual clock needs diloco.round_seconds > 0 (rounds of inner_steps steps take no clock)")
        super().__init__(clock.cfg, clock.tokens_per_step, clock.offset)
        self.step_s, self.sync_at = step_s, clock.sync_at
        self.counted = -1  # the last step `tick` counted

    def tick(self, step: int, force: bool = False, decided: bool | None = None) -> bool:
        self.counted = step
        return super().tick(step, force, decided)

    def due(self, step: int) -> bool:
        """Whether step `step` ends the round, asked before its tick (as fragments do) or in it."""
        steps = self.steps_in_round + (0 if self.counted == step else 1)
        return steps * self.step_s >= self.budget()


def virtual_clocks(outer_seam: Callable[[Any, Any], Any], step_s: list[float]) -> Callable[[Any, Any], Any]:
    """An `outer` seam that gives each site's DiLoCo (each fragment's) a `StepClock` of its own speed."""
    def wrap(outer: Any, model: Any) -> Any:
        for d in getattr(outer, "fragments", [outer]):
            d.clock = StepClock(d.clock, step_s[d.topology.world.site_rank])
        return outer_seam(outer, model)
    return wrap


def _run_threads(cfgs: list[Config], eval_on: Callable[[int], bool]) -> dict[str, Any]:
    store = dist.HashStore()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    start = time.perf_counter()
    # Setup (tokenising, the datasets cache) runs one site at a time: concurrent builders of one
    # cache raced and failed a site now and then. The barrier then lets a site whose setup failed
    # stop the others at once, instead of leaving them in the first collective until its timeout.
    sync = _SetupSync(len(cfgs))
    threads = [threading.Thread(target=_site, args=(cfg, len(cfgs), store, eval_on(s), results, errors, sync),
                                name=f"zeroband-site{s}", daemon=True) for s, cfg in enumerate(cfgs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # The first site that failed by itself, not one the barrier stopped on its behalf.
        site, error = min(errors.items(), key=lambda kv: (isinstance(kv[1], threading.BrokenBarrierError), kv[0]))
        raise RuntimeError(f"simulated site {site} failed: {type(error).__name__}: {error}") from error
    return {**results[0], "wall_s": time.perf_counter() - start, "sites": len(cfgs)}


class _SetupSync:
    def __init__(self, sites: int) -> None:
        self.lock, self.barrier = threading.Lock(), threading.Barrier(sites)


def _site(cfg: Config, sites: int, store: dist.Store, full_eval: bool, results: dict, errors: dict,
          sync: _SetupSync) -> None:
    from zeroband.train import build_run, run_training

    site = (cfg.sites.site_rank or 0) if cfg.diloco else 0  # site_configs sets every site's site_rank
    try:
        world = World(0, 1, 0, site, sites, torch.device(cfg.train.device if cfg.train.device != "auto" else "cpu"))
        group = None
        if cfg.diloco is not None:
            timeout = timedelta(seconds=cfg.sites.timeout_s)
            group = new_global_group(store, f"zeroband/{cfg.name}/sim/", site, sites, timeout, "gloo")
        with sync.lock:
            run = build_run(cfg, world, Topology(world, None, store, timeout_s=cfg.sites.timeout_s), group)
        sync.barrier.wait()
        if not full_eval:
            run.eval_set = run.eval_set[:1]
        results[site] = run_training(run, report=False)  # resumes from the sites' newest common checkpoint
    except BaseException as e:  # re-raised by run_sites on the caller's thread
        sync.barrier.abort()
        errors[site] = e
