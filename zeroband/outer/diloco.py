"""DiLoCo's outer loop (Douillard et al. 2023) for one rank's shard.

Contract (shared by `NoOuter`, `DiLoCo` and `CrossSiteDataParallel`, so the training loop has
no branches on the method):
- `start()` once, on a fresh run: every site takes site 0's parameters (a sealed broadcast, then
  verified by a keyed digest: docs/security.md);
- `sync_gradients()` between backward and the inner optimizer step (a no-op here);
- `after_inner_step(step, sync_point)` after every inner step; every `inner_steps` steps it runs
  an outer step and returns `OuterStats`, otherwise None. `sync_point=True` asks for a blocking
  outer step (checkpoints and the last step), after which all sites are bitwise identical.

The outer step (blocking, `sync`): pseudo-gradient = outer copy - local shard (fp32, CPU), averaged
over the sites on this rank's global group (comm/reduce.py), applied by the outer optimizer
(zeroband/outer/optimizer.py: Nesterov SGD by default, any torch optimizer) to the CPU fp32 outer
copy, which is copied back into the local shard. Every site receives the same all-reduce bytes and
runs the same CPU arithmetic, so all end identical. `sync` asks the membership for the round's
attempts (fixed: one; elastic: retried in new generations, or the round skipped) and applies the
average of the attempt that commits: it asks each attempt for the round's group and averages on
it itself (`reduce`, watched by the group), handing the membership no work of its own.

The overlapped outer step (`diloco.overlap = true`): a one-step-delayed outer update, as in
Streaming DiLoCo's overlapped communication (Douillard et al. 2025, arXiv 2501.18512, Sec. 2.3,
with the overlap set to a whole round) and eager updates (Kale et al. 2025, arXiv 2502.12996). At
boundary k, with outer copy g_k and the local shard's snapshot s_{k-1} from the previous boundary:
  1. wait for the average d_{k-1} launched at boundary k-1 (it had a whole round to arrive);
  2. g_k = OuterOpt(g_{k-1}, d_{k-1})             -- the outer update, one round late;
  3. local = g_k + (local - s_{k-1})              -- keep the progress made while it was in flight;
  4. d_k = g_k - local (= minus this round's local progress); launch its all-reduce on a
     background thread; s_k = local; go on training.
A blocking boundary first completes the pending round the same way, then runs a blocking step.
With `overlap_steps = tau` > 0, steps 1-3 run tau inner steps after the launch instead of at the
next boundary (Streaming DiLoCo's overlap of tau steps): the average is a fraction of a round late.

That is the "delayed" rule (`diloco.overlap_rule`): during round k+1 a site trains
from g_k plus its own progress of round k, at full weight and outside the outer optimizer. The
two eager rules do steps 1-4, then move the local model at once by an outer step previewed on an
estimate of round k's average, which has not arrived yet:
  5. local = OuterOpt_preview(g_k, w * d_k^own); s_k = local    -- the outer state is not changed
     "eager" (the default): w = 1, this site's own fresh pseudo-gradient stands in for the average;
     "eager_share": w = 1/n (n = sites in the group): only this site's own share of the average,
                    which is what Kale et al. 2025 (arXiv 2502.12996, Sec. 3) apply early.
Kale et al. keep one outer state per site and feed it d_k^own / n + (others' d_{k-1}) / n; summed
over rounds that applies every pseudo-gradient once, own ones a round early. Here the outer copy g
stays the exact consensus (true averages, one round late), identical on every site, and only the
working model carries the estimate: for momentum 0, "eager_share" is the same model as theirs.
The estimate's error never accumulates: boundary k+1 replaces the preview with the real step, and
a blocking boundary makes every site identical again. Measured: docs/results/convergence*.md.

Outer hyperparameters per step: `outer_lr_schedule = "inner"` multiplies outer_lr by the inner
schedule's factor at the boundary, and `outer_momentum_warmup` ramps the momentum from 0 over that
many outer steps (why: docs/results/convergence_tuning.md and the README table of outer defaults).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zeroband.comm import codecs
from zeroband.comm.direct import Arena, flat_base
from zeroband.comm.group import GlobalGroup, digest48
from zeroband.comm.reduce import ReduceResult, SiteStats, describe_exclusions, rda_scale, reduce_across_sites
from zeroband.comm.timing import Parts
from zeroband.config import DilocoConfig
from zeroband.membership.base import Attempt, FixedMembership, Membership
from zeroband.mesh import Topology
from zeroband.outer.base import OuterStats, RoundClock
from zeroband.outer.lanes import LaneSet
from zeroband.outer.optimizer import OptimizerFactory, OuterHyper, OuterSchedule, build_outer_optimizer
from zeroband.outer.overlap import InFlight, Overlap
from zeroband.outer.placement import OuterCopy, _views, outer_thread_count, torch_threads
from zeroband.outer.replicas import broadcast_from_site0, verify_identical
from zeroband.outer.stats import site_stats, tensor_stats
from zeroband.trust.mac import NO_AUTH

log = logging.getLogger(__name__)
LATE_MAX_AGE = 1  # rounds: late work older than this is dropped (the ledger holds a lease no longer)


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns: the local shard of an FSDP2 DTensor, or the tensor itself."""
    data = param.data
    return data.to_local() if isinstance(data, DTensor) else data


def outer_stats(diloco: DiLoCo, result: ReduceResult, stats: SiteStats, grads: list[torch.Tensor], comm_s: float,
                total_s: float, overlapped: bool) -> OuterStats:
    """The "outer" metrics record of the step just applied (the norms and crc are site-group reductions)."""
    return OuterStats(
        outer_step=diloco.outer_step,
        allreduce_s=comm_s,
        wait_bound_s=result.wait_bound_s,
        outer_step_s=total_s,
        payload_bytes=result.payload_bytes,
        wire_bytes=result.wire_bytes,
        pseudo_grad_norm=stats.sumsq**0.5,
        avg_pseudo_grad_norm=diloco.site_sum(diloco.applied_sumsq) ** 0.5,
        outer_lr=diloco.optimizer.applied_lr,
        sites_used=result.sites_used,
        excluded_sites=result.excluded_sites,
        overlapped=overlapped,
        outer_crc=diloco.digest48() if diloco.cfg.log_checksum else None,
        timings=diloco.parts.seconds,  # the same dict: the step's CPU seconds land in it when the step ends
    )


def saved_feedback(feedback: list[dict[int, torch.Tensor]] | None, mixed: bool) -> dict[Any, Any] | None:
    """The error feedback as a checkpoint holds it: equal shapes, the one lane's residual by tensor
    index (the format of every checkpoint so far); sites of different shapes, {"lanes": per lane}."""
    if feedback is None:
        return None
    return {"lanes": feedback} if mixed else feedback[0]


def loaded_feedback(saved: dict[Any, Any] | None, lanes: int, mixed: bool) -> list[dict[int, torch.Tensor]] | None:
    """`saved_feedback` read back; a residual of another layout (resharded, or saved before lanes
    kept theirs) starts again empty."""
    if saved is None:
        return None
    if not mixed:
        return [saved] if "lanes" not in saved else [{}]
    per_lane = saved.get("lanes")
    return per_lane if isinstance(per_lane, list) and len(per_lane) == lanes else [{} for _ in range(lanes)]


class DiLoCo:
    def __init__(self, model: torch.nn.Module, cfg: DilocoConfig, topology: Topology, tokens_per_step: int = 0,
                 lr_factor: Callable[[int], float] | None = None, membership: Membership | None = None,
                 group: GlobalGroup | None = None, optimizer: OptimizerFactory | None = None,
                 subset: list[int] | None = None, offset: int = 0, state_key: str = "outer",
                 topic: int | None = None) -> None:
        """`membership` says who takes part in each round; by default every site, on the fixed
        `group` (zeroband/membership/, mesh.fixed_global_group). `lr_factor(step)` is the inner schedule's
        multiplier (used by `outer_lr_schedule = "inner"`). `optimizer(params)` builds the outer
        optimizer (any torch optimizer) instead of `diloco.outer_optimizer`. `subset`: the indices in
        `model.parameters()` of the parameters it keeps (default: all), its rounds ending at steps = `offset` mod H, its state handed
        over as `state_key` (one fragment of Streaming DiLoCo: zeroband/outer/fragments.py), `topic` its
        index: the rounds it takes (`takes`; None: every one)."""
        every = list(model.parameters())
        subset = list(range(len(every))) if subset is None else subset
        params = [every[i] for i in subset]
        self.cfg = cfg
        self.topology = topology
        if membership is None:
            assert group is not None, "DiLoCo needs a `membership` or the fixed `group`"
            membership = FixedMembership(group, topology, topology.timeout_s)
        self.membership = membership
        self.local = [local_shard(p) for p in params]
        # the one cross-site data path, per lane (zeroband/outer/lanes.py): under equal shapes one lane,
        # this rank's whole shard on the round's group; sites of different shapes (`mixed`) cut it finer
        shapes = [tuple(p.shape) for p in every]
        self.lanes = LaneSet(topology, self.local, shapes, subset)
        self.mixed = not self.lanes.whole
        self.copy = OuterCopy(self.local, cfg)
        self.outer, self.outer_device = self.copy.tensors, self.copy.device
        self.optimizer = build_outer_optimizer(self.copy, cfg, optimizer)  # zeroband/outer/optimizer.py
        self.schedule = OuterSchedule(cfg, lr_factor)
        self.threads = outer_thread_count(cfg.outer_threads, len(os.sched_getaffinity(0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.parts = Parts()  # the current outer step's timers
        # Each lane's all-reduce memory (comm/direct.py) and, where a round may retry, the vector its inputs
        # are copied into: lent to one exchange at a time and reused only after an exchange completed.
        self.arenas = [Arena() for _ in self.lanes.lanes]
        self.spare: torch.Tensor | None = None
        self.applied_sumsq = 0.0  # sum of squares of the last average applied (this rank's shard)
        self.outer_step = 0
        # what the wire format lost, carried into the next outer step (always, for a codec that says so)
        spec = codecs.spec(cfg.comm_dtype)
        feedback = cfg.error_feedback or spec.feedback == "always"
        self.error_feedback: list[dict[int, torch.Tensor]] | None = [{} for _ in self.arenas] if feedback else None  # per lane
        self.attempt_feedback: list[dict[int, torch.Tensor]] | None = None  # a retried round's residual until it commits
        # A gathered codec's residual is folded into the pseudo-gradient before the site measures it, so
        # what it declares covers what it sends (comm/gather.py); a direct one's is added in the exchange.
        self.fold = feedback and spec.exchange == "gather"
        self.overlap = Overlap(cfg, self.local, self.copy, self.optimizer)  # its state: the average in flight
        self.clock = RoundClock(cfg, tokens_per_step, offset)
        self.topic = topic
        self.redirect: int | None = None  # the fragment of the round it left to another (`takes`)
        self.boundary_step = 0  # inner steps done at the current boundary
        self.last_reduce: ReduceResult | None = None  # whom it excluded: the data ledger reads it (data/ledger.py)
        self.membership.register_state_dict_fn(state_key, self.load_shared_state_dict, self.shared_state_dict,
                                               self.checksum_tensors)

    def attach(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.membership.attach(sink)

    @property
    def group(self) -> GlobalGroup:
        """The cross-site group of the current round (there is one wherever this is read: from the
        first round on, or from start() on for a fixed run; overlap is fixed-only)."""
        group = self.membership.group
        assert group is not None, "no cross-site group yet: the membership forms it in a round"
        return group

    # ------------------------------------------------------------------ start: identical replicas
    @torch.no_grad()
    def start(self, resumed: bool = False) -> None:
        """Fresh: every site takes site 0's parameters. Resumed: prove all sites loaded the same state.
        First of all, the sites prove the secret and agree on the run's settings. A site that does
        not hold the run's state (elastic) takes rounds until a peer handed it over. The agreement
        includes where the outer arithmetic runs: GPU and CPU kernels may round differently."""
        self.note_outer_device()
        self.membership.start(resumed)
        if not self.membership.holds_state:
            self.join()
        else:
            self.start_replicas(resumed)
        self.clock.restart()  # a time budget's first round counts from here, where the sites meet

    def note_outer_device(self) -> None:
        """Where the outer arithmetic runs joins what the sites agree on at start."""
        self.topology.fingerprint = {**self.topology.fingerprint, "outer device (diloco.outer_device)": self.outer_device.type}

    @torch.no_grad()
    def start_replicas(self, resumed: bool) -> None:
        """After the membership started: site 0's parameters everywhere (fresh), or proof that every
        site loaded the same state (resumed)."""
        if resumed:
            verify_identical(self.checksum_tensors(), self.group, self.topology, "resume", self._per_lane())
            return
        broadcast_from_site0(self.local, self.group, self.topology, self.lanes)
        for o, t in zip(self.outer, self.local):
            o.copy_(t.detach())
        verify_identical(self.outer, self.group, self.topology, "initial broadcast",
                         self._per_lane([[o] for o in self.outer]))

    def leave(self) -> None:
        self.membership.leave()

    def sync_gradients(self) -> None:
        pass

    def digest48(self, group: GlobalGroup | None = None) -> int:
        """48 bits of the keyed digest of the outer state (comm/group.py): the per-step replica check.
        Sites of different shapes: of the whole site's state (every lane's digest; a site collective)."""
        if self.mixed:
            return self.lanes.site_digest(self.lanes.digests(self.per_param_state()), self.topology)
        group = group or self.membership.group  # none yet (elastic): unkeyed
        return digest48(self.checksum_tensors(), group.auth if group is not None else NO_AUTH)

    def per_param_state(self) -> list[list[torch.Tensor]]:
        """Each parameter's outer copy and outer optimizer state (what `checksum_tensors` holds, by parameter)."""
        state = self.optimizer.optimizer.state
        return [[o, *(v for v in state.get(o, {}).values() if isinstance(v, torch.Tensor))] for o in self.outer]

    def _per_lane(self, per_param: list[list[torch.Tensor]] | None = None) -> list[tuple[GlobalGroup, list[torch.Tensor]]] | None:
        """Each lane's group and its pieces of `per_param` (default: the whole outer state); None: equal shapes."""
        if not self.mixed:
            return None
        per_param = per_param or self.per_param_state()
        return [(g, self.lanes.state_views(k, per_param)) for k, g in enumerate(self.lanes.groups(None))]

    def checksum_tensors(self) -> list[torch.Tensor]:
        return self.outer + self.optimizer.state_tensors()

    # ------------------------------------------------------------------ the outer step
    def finished(self, step: int, total_steps: int) -> bool:
        return self.clock.finished(step, total_steps, self.membership.rounds_done(self.clock.rounds))

    def run_step(self, step: int) -> int:
        return self.clock.run_step(step, self.membership.rounds_done(self.clock.rounds))

    def due(self, step: int) -> bool:
        """Whether inner step `step` ends this outer loop's round (nothing counted)."""
        return self.clock.due(step)

    def after_inner_step(self, step: int, sync_point: bool = False, force: bool = False,
                         decided: bool | None = None) -> OuterStats | None:
        """`force`: a boundary here whatever the round clock says (every fragment at a sync point);
        `decided`: whether this step is a boundary, read by the caller (fragments under a budget)."""
        if not self.clock.tick(step, force, decided):
            return self._land_early() if self.overlap.due(step) else None
        return self.boundary(step, sync_point)

    def boundary(self, step: int, sync_point: bool = False) -> OuterStats | None:
        """The outer step of a round the clock ended (`after_inner_step`; fragments under a budget
        also end an owed round here with no step of its own at the run's end)."""
        self.boundary_step = step
        self.parts = Parts()
        with torch_threads(self.threads), self.parts.cpu(), torch.no_grad():  # the exchange thread adds its CPU
            t0 = time.perf_counter()
            landed, waited = self.overlap.land(self.group, self._apply) if self.overlap.pending else (None, 0.0)
            if self.cfg.round_seconds and self.topic is None:  # the sites' steps part under a budget: the
                sync_point = self.clock.blocks(self.membership.rounds_done(self.clock.rounds))  # run's rounds decide
            if self.cfg.overlap and not sync_point:
                return self._launch(landed, waited, t0)
            grads = self.pseudo_gradient() if self.membership.holds_state else None
            return self.sync(grads, self.clock.take_tokens(), t0, waited)

    @torch.no_grad()
    def sync(self, grads: list[torch.Tensor] | None, tokens: float = 0.0, t0: float | None = None,
             waited: float = 0.0) -> OuterStats | None:
        """One blocking outer step: the round's members average `grads` (None: this site has none yet,
        it waits for the run's state) and apply the average to the outer copy and the local shard."""
        t0 = time.perf_counter() if t0 is None else t0
        t1, preparing = time.perf_counter(), 0.0
        began = self.membership.rounds_done(self.clock.rounds)  # the round `grads` belong to (elastic: the run's)
        for attempt in self.membership.attempts(self.topic):
            if not self.takes(attempt):  # a site left out moved on to a round of another fragment
                return None
            result, t2 = None, time.perf_counter()
            offer, weight = self.offer(grads, attempt, self.membership.rounds_done(self.clock.rounds) - began)
            mine, stats = self.contribution(offer, tokens, attempt.averages, weight)
            preparing += time.perf_counter() - t2
            self.attempt_feedback = None
            with attempt:  # where a round may retry, a failure in here fails this attempt only
                group = attempt.group()  # elastic: formed now, the run's state handed to members lacking it
                result = self.reduce(mine, stats, group) if attempt.averages else None
            if not attempt.commit():
                continue
            if self.attempt_feedback is not None:
                self.error_feedback, self.attempt_feedback = self.attempt_feedback, None
            comm_s = waited + time.perf_counter() - t1 - preparing
            if not attempt.averages:  # the round handed the run's state over: the local shard takes it
                with self.parts("h2d"):
                    self.copy.to_local()
                return None
            assert result is not None, "an attempt that averages commits only once its average is in"
            for part, seconds in result.timings.items():
                self.parts.add(part, seconds)
            self._apply(mine, result, into_local=True)
            return self._stats(result, stats, mine, comm_s, time.perf_counter() - t0, overlapped=False)
        return None  # the membership skipped the round: every site keeps its local progress

    def takes(self, attempt: Attempt) -> bool:
        """Whether the attempt's round is this fragment's: the fragment its proposer (a holder of the
        state) named, or none named (the whole model; a round that only hands the state over). A site
        without the state leaves another fragment's round to that fragment (`redirect`); a holder is
        always at the same fragment as the proposer, every holder being at the same inner step."""
        self.redirect = None
        if attempt.topic is None or attempt.topic == self.topic:
            return True
        if self.membership.holds_state:
            raise RuntimeError(f"the round syncs fragment {attempt.topic}, but fragment {self.topic} is due here: "
                               "this site's inner steps went out of step with the run's")
        self.redirect = attempt.topic
        return False

    def offer(self, grads: list[torch.Tensor] | None, attempt: Attempt,
              age: int) -> tuple[list[torch.Tensor] | None, float]:
        """What this site brings to `attempt`, with its weight: its round's pseudo-gradient (1), or
        none (a joiner). A site that held the state when its round began (`grads`) but contributes no
        more was left out of that round (late): with diloco.late_weight > 0 it brings that round's
        work to the next round's merge (`age` 1: rounds since), weighted by it (the ledger held its
        documents' lease that long). Older work is dropped, its documents read again by others."""
        if attempt.contributes:
            return grads, 1.0
        if grads is not None and self.cfg.late_weight > 0 and age == LATE_MAX_AGE:
            return grads, self.cfg.late_weight
        return None, 1.0

    def join(self) -> None:
        """A site without the run's state takes rounds, contributing nothing, until a peer handed it over."""
        while not self.membership.holds_state:
            self.sync(None)

    def contribution(self, grads: list[torch.Tensor] | None, tokens: float, averages: bool = True,
                     weight: float = 1.0) -> tuple[list[torch.Tensor], SiteStats]:
        """What this site puts into an attempt, with the site's statistics (site-group collectives: on
        the main thread): `grads`, copied where an attempt may be retried (a retry starts again from the
        originals), their share times `weight`; zeros that abstain if None; nothing where the attempt
        averages nothing."""
        if not averages:
            return [], SiteStats(0.0, 0.0, abstain=True)
        if grads is None:
            return [torch.zeros_like(o) for o in self.outer], SiteStats(0.0, 0.0, abstain=True)
        mine = self._folded(self._retry_copy(grads) if self.membership.may_retry else grads)
        with self.parts("stats"):  # (a folded residual changed them: measured again)
            stats = site_stats(mine, self.topology, tokens, local=None if self.fold else self.copy.stats_of(grads))
        return mine, replace(stats, weight=weight)

    def _folded(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """`grads` + the residual the last exchange left, in place, where the codec folds it here (`fold`)."""
        if not self.fold or self.error_feedback is None:
            return grads
        with self.parts("stats"):
            self.lanes.fold(grads, self.error_feedback)
        return grads

    def _launch(self, landed: InFlight | None, waited: float, t0: float) -> OuterStats | None:
        """The overlapped boundary: this round's average starts in the background (zeroband/outer/overlap.py);
        the statistics are those of the average that landed (none at the first boundary)."""
        grads = self._folded(self.pseudo_gradient())
        stats = site_stats(grads, self.topology, self.clock.take_tokens(),
                           local=None if self.fold else self.copy.stats_of(grads))
        self.overlap.launch(grads, stats, self.group.size, self.reduce, self.boundary_step)
        if landed is None:
            return None
        return self._stats(landed.result, landed.stats, landed.grads, waited, time.perf_counter() - t0, True)

    def settle(self) -> OuterStats | None:
        """The average in flight, if any, lands now (a checkpoint of fragments needs none in flight)."""
        return self._land_early() if self.overlap.pending is not None else None

    @torch.no_grad()
    def _land_early(self) -> OuterStats:
        """overlap_steps = tau: the pending average lands tau inner steps after its launch."""
        t0 = time.perf_counter()
        landed, waited = self.overlap.land(self.group, self._apply)
        return self._stats(landed.result, landed.stats, landed.grads, waited, time.perf_counter() - t0, True)

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """Outer copy - local shard: the list about to be averaged (fixed and elastic), as views of one
        host vector that the reduce averages in place (zeroband/outer/placement.py)."""
        return self.copy.pseudo_gradient(self.parts, fresh=self.cfg.overlap)

    def reduce(self, grads: list[torch.Tensor], stats: SiteStats, group: GlobalGroup | None = None) -> ReduceResult:
        """The average of `grads` over the sites, in place, lane by lane (zeroband/outer/lanes.py), each
        on a helper thread the group watches (its timeout, the peer it waits for named; elastic: also
        a member seen dead or the attempt aborted)."""
        group = group or self.group
        crcs = self._replica_crcs(group) if self.cfg.log_checksum and not stats.abstain else None
        feedback = self.error_feedback
        if feedback is not None and self.membership.may_retry:  # the residual of an attempt that commits (`sync`)
            feedback = self.attempt_feedback = [dict(f) for f in feedback]  # (an exchange replaces entries)
        self.last_reduce = None
        self.last_reduce = self.lanes.reduce(grads, stats, crcs, group, partial(self._reduce_lane, feedback))
        if self.membership.may_retry:
            self.spare = flat_base(grads)  # the `_retry_copy` vector (None for an abstainer's zeros)
        return self.last_reduce

    def _replica_crcs(self, group: GlobalGroup) -> list[int]:
        """Each lane's digest of the outer state entering the step, compared across sites by the
        exchange (under equal shapes: the whole shard's, `digest48`)."""
        if self.mixed:
            return self.lanes.digests(self.per_param_state(), group)
        return [self.digest48(group)]

    def _reduce_lane(self, feedback: list[dict[int, torch.Tensor]] | None, grads: list[torch.Tensor],
                     stats: SiteStats, group: GlobalGroup, k: int) -> ReduceResult:
        """Lane k's exchange. Its memory is lent: an exchange that raises or is abandoned by its
        watcher keeps it (a posted receive or the abandoned thread may still write into it), and the
        next one starts from fresh memory; one that completes gives it back."""
        arena, self.arenas[k] = self.arenas[k], Arena()
        what = f"outer all-reduce, lane {k}" if self.mixed else "outer all-reduce"
        result = self._exchange(grads, stats, group, None if feedback is None else feedback[k], arena, what)
        self.arenas[k] = arena
        return result

    def _exchange(self, grads: list[torch.Tensor], stats: SiteStats, group: GlobalGroup,
                  feedback: dict[int, torch.Tensor] | None, arena: Arena, what: str) -> ReduceResult:
        """The equal-shape reduce of `grads` on `group`, on a helper thread the group watches."""
        return group.watched(partial(reduce_across_sites, grads, stats, group, self.cfg.comm_dtype,
                                     int(self.cfg.piece_mb * 2**20), feedback, self.cfg.outlier_factor,
                                     weight_by_tokens=self.cfg.round_seconds > 0, arena=arena, settings=self.cfg,
                                     merge=self.cfg.merge), what)

    def _retry_copy(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """A copy of `grads` for one attempt to consume: a retried attempt starts again from the originals.
        Into the vector the last completed exchange gave back (fresh memory costs a page fault per
        4 KB: docs/results/outer_step.md, "Elastic rounds"), else a new one."""
        spare, self.spare = self.spare, None
        numel = sum(g.numel() for g in grads)
        if spare is None or spare.numel() != numel:
            spare = torch.empty(numel, dtype=torch.float32)
        return [v.copy_(g) for v, g in zip(_views(spare, grads), grads)]

    def _apply(self, grads: list[torch.Tensor], result: ReduceResult, into_local: bool = False) -> None:
        """The outer step with the average `grads`; `into_local`: the local shard takes the new outer copy."""
        if result.excluded_sites:
            log.error("outer step %d: excluded %s", self.outer_step, describe_exclusions(result.exclusions))
        with self.parts("stats"):  # of the average, for OuterStats (measured by the exchange when it can)
            self.applied_sumsq = result.sumsq if result.sumsq is not None else tensor_stats(grads)[0]
            if self.cfg.merge == "rda" and result.sites_used:
                self._rescale(grads, result)
        if result.sites_used == 0:  # nobody had a usable pseudo-gradient: keep the outer copy, drop the round
            if into_local:
                with self.parts("h2d"):
                    self.copy.to_local()
            return
        grads = self.copy.on_outer_device(grads, self.parts)
        self.optimizer.step(self.copy, grads, self.schedule.at(self.outer_step, self.boundary_step), self.parts,
                            into_local)
        self.outer_step += 1

    def _rescale(self, grads: list[torch.Tensor], result: ReduceResult) -> None:
        """"rda": the merged unit directions take the sites' mean norm. The merged norm is summed over
        the site's ranks (a site collective, on the main thread like every `_apply`): every site holds
        the same shards (or, of different shapes, the same lanes) of the same average, so every site
        scales by the same bytes."""
        merged = self.lanes.site_total(result.lane_sumsq, self.topology) if self.mixed else self.site_sum(self.applied_sumsq)
        scale = rda_scale(result.mean_norm, merged)
        torch._foreach_mul_(grads, scale)
        self.applied_sumsq *= scale * scale

    def site_sum(self, value: float) -> float:
        summed = torch.tensor([value], dtype=torch.float64, device=self.topology.world.device)
        self.topology.site_all_reduce(summed)
        return summed.item()

    def _stats(self, *args: Any, **kwargs: Any) -> OuterStats:
        return outer_stats(self, *args, **kwargs)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        if self.overlap.pending is not None:
            raise RuntimeError("checkpoint with an outer all-reduce in flight: save only at sync points")
        return {"outer": [o.detach().to("cpu", copy=True) for o in self.outer], "optimizer": self.optimizer.state_dict(),
                "outer_step": self.outer_step, "error_feedback": saved_feedback(self.error_feedback, self.mixed),
                "clock": self.clock.state_dict(),
                # the last step's schedule: an eager overlapped boundary previews the next step with it
                "outer_hyper": asdict(self.optimizer.applied),
                **self.membership.state_dict()}

    def shared_state_dict(self) -> dict[str, Any]:
        """What a site joining the run takes from a peer: the state dict less this site's own parts
        (quantisation residual, round clock, membership)."""
        own = {"error_feedback", "clock", *self.membership.state_dict()}
        return {k: v for k, v in self.state_dict().items() if k not in own}

    @torch.no_grad()
    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        for o, saved in zip(self.outer, state["outer"], strict=True):
            o.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])  # a resume's new outer settings apply
        self.outer_step = state["outer_step"]
        if "outer_hyper" in state:  # (checkpoints from before it was saved: the default)
            self.optimizer.applied = OuterHyper(**state["outer_hyper"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_shared_state_dict(state)
        if "error_feedback" in state:
            self.error_feedback = loaded_feedback(state["error_feedback"], len(self.arenas), self.mixed)
        self.clock.load_state_dict(state.get("clock", {"rounds": 0}))
        self.membership.load_state_dict(state)
