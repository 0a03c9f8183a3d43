"""DiLoCo that survives sites dying, hanging, joining and leaving, with no master.

Same contract as `DiLoCo` (zeroband/outer/diloco.py); what changes is how an outer step is carried out:
each round goes through `RoundCoordinator` (zeroband/membership/rounds.py): the sites agree on the
members, form this generation's global groups (fresh store prefix; survivors keep their processes
and state), hand the outer state to members that lack it (joiners, restarted or dropped sites),
all-reduce, vote, and apply the step only if the verdict is `commit`. A failed attempt is retried
in a new generation with the same pseudo-gradients, never applying a partial result.

- Crash, hang or partition of a site: its heartbeat stops; waits and the all-reduce are abandoned
  as soon as a member is seen dead (within `dead_after_s`), or at the group timeout at worst.
- Join: a site that starts while a run is going on waits for the next boundary, receives the outer
  parameters, outer momentum and progress counters from a live peer over the global group,
  checks them by checksum against every member, and trains from there. Sites keep fixed slots
  (`site_rank` < `site_count`), and a slot's documents belong to it alone, so no shard is read by
  two sites; a re-joining slot continues from the data position it last published.
- Leave (SIGTERM): the site writes `leave/<site>`, so nobody waits for its heartbeat to time out.
- Quorum: a round proceeds with at least `min_sites` members once every expected live site has
  arrived or `grace_s` has passed; a late site's pseudo-gradient is dropped and it re-syncs from a
  peer at the next boundary (its local progress of that round is discarded).
- Trust: members of a new generation admit each other with a challenge-response on the shared
  secret and compare config fingerprints (zeroband/membership/auth.py) before forming groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeroband.comm.group import OPEN, SECRET, GlobalGroup, new_global_group, rendezvous
from zeroband.comm.mac import WireAuth
from zeroband.comm.reduce import ReduceResult, SiteStats
from zeroband.config import DilocoConfig
from zeroband.membership.auth import PeerRefused, Verdict, admit
from zeroband.membership.heartbeat import Heartbeat, Liveness, heartbeat_key, leave_key
from zeroband.membership.rounds import Decision, RoundCoordinator
from zeroband.membership.signed import SignedStore
from zeroband.membership.store import open_store
from zeroband.mesh import Topology
from zeroband.outer.base import OuterStats
from zeroband.outer.diloco import DiLoCo, checksum_table, site_stats
from zeroband.testing.faults import maybe_inject, poison_due
from zeroband.watchdog import Watch, read_by_all

log = logging.getLogger(__name__)


class MemberLost(RuntimeError):
    pass


class ElasticDiLoCo(DiLoCo):
    def __init__(self, model: torch.nn.Module, cfg: DilocoConfig, topology: Topology, run_name: str,
                 progress: Any, scheduler: Any, fingerprint: dict[str, str], tokens_per_step: int = 0) -> None:
        super().__init__(model, cfg, topology, tokens_per_step)  # outer copy, outer optimizer, round clock
        self.world = topology.world
        self.boundary_step, self.round_tokens = 0, 0.0
        self.progress, self.scheduler, self.fingerprint = progress, scheduler, fingerprint
        self.prefix = f"zeroband/{run_name}/elastic/"
        slots = range(self.world.site_count)
        self.secret = topology.secret
        self.auth = WireAuth.from_secret(self.secret, run_name)  # seals all-reduce messages
        sign_key = self.auth.subkey("store")  # and, independently keyed, the protocol's store values
        self.signed = SignedStore(topology.store, sign_key)
        self.liveness = Liveness(topology.store, self.prefix, slots, cfg.dead_after_s, sign_key)
        self.rounds = RoundCoordinator(topology.store, self.prefix, self.world.site_rank, self.world.rank == 0,
                                       self.liveness, sign_key)
        self.heartbeat = None
        if self.world.rank == 0:
            topology.store.delete_key(leave_key(self.prefix, self.world.site_rank))  # back after a leave
            reopen = lambda: open_store(cfg.store, False, timedelta(seconds=cfg.timeout_s))  # noqa: E731
            self.heartbeat = Heartbeat(reopen, self.prefix, self.world.site_rank, cfg.heartbeat_s, sign_key).start()
        self.watch = Watch(cfg.timeout_s, interruptible=False)  # SIGTERM here means: finish the round, then leave
        self.members: list[int] = []
        self.generation = -1
        self.group: GlobalGroup | None = None
        self.fresh = True  # until this site holds the run's current outer state
        self.round = 0

    # ------------------------------------------------------------------ start / join / leave
    def start(self, resumed: bool = False) -> None:
        """Take part in the round being formed: round 0 at launch, the next boundary when joining.

        A resumed site is still fresh: the live run (or, after a full restart, the lowest site)
        decides the state, so sites restarted from different checkpoints cannot diverge.
        """
        self.liveness.poll()
        self.round = self.rounds.committed_round() + 1
        while self.fresh:
            self._round(pseudo_gradient=None)

    def leave(self) -> None:
        """Announce the departure, stop the heartbeat thread and drop the group (clean exit)."""
        if self.world.rank == 0:
            self.signed.set(leave_key(self.prefix, self.world.site_rank), str(self.round))
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        self.group = None

    # ------------------------------------------------------------------ the outer step
    def finished(self, step: int, total_steps: int) -> bool:
        if self.cfg.round_seconds:  # rounds are the shared clock; round 0 was the start
            return self.round > total_steps // self.cfg.inner_steps
        return step >= total_steps

    def after_inner_step(self, step: int, sync_point: bool = False) -> OuterStats | None:
        if not self.clock.tick(step):
            return None
        self.boundary_step = step + 1
        self.poison = poison_due(step + 1, self.world.site_rank, self.world.rank)
        self.round_tokens = self.clock.take_tokens()
        with torch.no_grad():
            grads = None if self.fresh else self._pseudo_gradient()
            return self._round(grads)

    @torch.no_grad()
    def _round(self, pseudo_gradient: list[torch.Tensor] | None) -> OuterStats | None:
        """One outer step; a site left out of it waits for the next boundary as a joiner."""
        while True:
            left_out, stats = self._try_round(pseudo_gradient)
            if not left_out:
                return stats
            pseudo_gradient = None  # fresh now: its own progress of this round is dropped

    def _try_round(self, pseudo_gradient: list[torch.Tensor] | None) -> tuple[bool, OuterStats | None]:
        t0 = time.perf_counter()
        for attempt in range(self.cfg.max_retries + 1):
            decision = self._decide(attempt)
            log.info("site %d round %d attempt %d: %s", self.world.site_rank, self.round, attempt, decision)
            self._refuse_if_foreign(decision)
            stale = self.fresh and self.world.site_rank not in decision.fresh  # decided before we (re)started
            if self.world.site_rank not in decision.members or stale:
                log.warning("round %d: left out (late, presumed dead, or a decision from before a restart); "
                            "joining the next boundary", self.round)
                self.fresh, self.round = True, self.round + 1
                return True, None
            outcome = self._attempt(decision, pseudo_gradient)
            verdict = self.rounds.vote_and_verdict(self.round, attempt, decision, self._site_ok(outcome is not None),
                                                   self.cfg.timeout_s)
            if verdict == "commit":
                return False, self._commit(decision, outcome, time.perf_counter() - t0)
            log.warning("round %d attempt %d aborted (members %s); retrying", self.round, attempt, decision.members)
            self.group = None  # a group that saw a failure is not trusted again
        log.error("round %d failed %d times: skipped, local progress kept", self.round, self.cfg.max_retries + 1)
        self.round += 1
        return False, None

    def _refuse_if_foreign(self, decision: Decision) -> None:
        """Alone, while other slots' heartbeats are there but fail our key: we hold another secret.
        Stop with the admission error rather than train alone (the others do not see us either)."""
        me = self.world.site_rank
        if decision.members != [me] or not self.fresh:
            return
        refused = self.liveness.store.refused
        why = {s: refused[heartbeat_key(self.prefix, s)] for s in range(self.world.site_count)
               if s != me and heartbeat_key(self.prefix, s) in refused}
        if not why:
            return
        self.leave()
        if "bad-mac" in why.values():
            reason = f"wrong shared secret: the store values of sites {sorted(why)} do not verify under this site's"
        else:  # a secret on one side only
            marks = {me: OPEN if self.secret is None else SECRET} | {s: OPEN if r == "unsigned" else SECRET
                                                                       for s, r in why.items()}
            who = ", ".join(f"site {s} {m}" for s, m in sorted(marks.items()))
            reason = f"sites disagree on admission ({who}); set the same diloco.secret or ZEROBAND_SECRET on every site"
        # the others see the same mismatch about now; give them time to read it before the store may go
        read_by_all(self.topology.store, f"{self.prefix}refused/", me, self.world.site_count, 2 * self.cfg.dead_after_s)
        raise PeerRefused(me, Verdict([], {me: reason}))

    def _decide(self, attempt: int) -> Decision:
        expected = set(range(self.world.site_count)) if self.round == 0 else set(self.members)
        grace = self.cfg.start_grace_s if self.round == 0 else self.cfg.grace_s
        timeout = self.cfg.join_timeout_s if self.fresh else self.cfg.timeout_s
        return self.rounds.rendezvous(self.round, attempt, expected, self.cfg.min_sites, grace, self.fresh, timeout,
                                      self._next_generation)

    def _next_generation(self, members: list[int]) -> int:
        """Keep the groups while the members are the same and healthy; else a fresh generation."""
        if self.group is not None and members == self.members:
            return self.generation
        return self.topology.store.add(self.prefix + "generation", 1)

    def _attempt(self, decision: Decision, pseudo_gradient: list[torch.Tensor] | None) -> tuple | None:
        """Groups, state hand-over, all-reduce; None if anything failed (the vote then aborts).

        Site-group collectives happen only here on the main thread, before and after the watched
        thread: an abandoned thread must never hold a site collective that the others would then
        match with a different one.
        """
        if self.round == 0:
            grads, stats = None, None
        elif pseudo_gradient is None:  # fresh: takes part, contributes nothing
            grads, stats = [torch.zeros_like(o) for o in self.outer], SiteStats(0.0, 0.0, 0.0, abstain=True)
        else:
            grads = [g.clone() for g in pseudo_gradient]  # the original survives an aborted attempt
            stats = site_stats(grads, self.topology, self.round_tokens)
        try:
            crcs, result = self._watched(decision, lambda: self._exchange(decision, grads, stats))
        except PeerRefused as e:
            if self.world.site_rank not in [decision.members[i] for i in e.admitted]:
                self.leave()  # we are the foreign peer: stop, and let the others go on without us
                raise
            log.error("round %d: %s", self.round, e)
            self.group = None
            return None
        except Exception as e:  # every failure is voted on, never applied
            log.warning("round %d: attempt failed on site %d rank %d: %s", self.round, self.world.site_rank,
                        self.world.rank, e)
            self.group = None
            return None
        if crcs is not None and len(set(crcs)) > 1:
            log.error("round %d: outer state differs between members after hand-over: %s", self.round, crcs)
            return None
        return (grads, result, stats)

    def _exchange(self, decision: Decision, grads: list[torch.Tensor] | None,
                  stats: SiteStats | None) -> tuple[list[int] | None, ReduceResult | None]:
        """Everything that crosses sites in one attempt (global groups and the store only)."""
        self._ensure_group(decision)
        maybe_inject("allreduce", self.boundary_step, self.world.site_rank, self.world.rank)
        crcs = self._transfer_state(decision) if decision.fresh else None
        result = self.reduce(grads, stats) if grads is not None else None
        return crcs, result

    def _site_ok(self, ok: bool) -> bool:
        flag = torch.tensor([1.0 if ok else 0.0], device=self.world.device)
        self.topology.site_all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _ensure_group(self, decision: Decision) -> None:
        if self.group is not None and decision.generation == self.generation:
            return
        index = decision.members.index(self.world.site_rank)
        prefix = f"{self.prefix}gen{decision.generation}/shard{self.world.rank}/"
        timeout = timedelta(seconds=self.cfg.timeout_s)
        mark = OPEN if self.secret is None else SECRET
        rendezvous(self.topology.store, prefix, index, len(decision.members), self.cfg.timeout_s, mark)
        admit(self.topology.store, prefix, index, len(decision.members), self.secret, self.fingerprint, timeout)
        self.group = new_global_group(self.topology.store, prefix, index, len(decision.members), timeout,
                                      self.cfg.backend, self.watch, mark, self.auth)
        self.generation, self.members = decision.generation, decision.members

    def _watched(self, decision: Decision, work: Callable[[], Any]) -> Any:
        """Run `work` on a thread; give up as soon as a member is seen dead or the timeout passes."""
        def check() -> None:
            dead = self.liveness.dead_among(decision.members)
            if dead:
                raise MemberLost(f"sites {sorted(dead)} stopped responding")

        self.watch.current = "the members (forming the group)"
        return self.watch.run(work, f"round {self.round} exchange", check)

    def _commit(self, decision: Decision, outcome: tuple, elapsed: float) -> OuterStats | None:
        grads, result, stats = outcome
        self.fresh, self.members = False, decision.members
        if self.world.site_rank == decision.donor and self.world.rank == 0:
            self.rounds.mark_committed(self.round)
        self.round += 1
        if result is None:  # round 0: the state hand-over was the whole round
            for t, o in zip(self.local, self.outer):
                t.copy_(o.to(t.device, t.dtype))
            return None
        self._apply(grads, result)
        for t, o in zip(self.local, self.outer):
            t.copy_(o.to(t.device, t.dtype))
        return self._stats(result, stats, grads, elapsed, elapsed, overlapped=False)

    # ------------------------------------------------------------------ state hand-over
    def _transfer_state(self, decision: Decision) -> list[int]:
        """The donor's outer parameters, momentum and counters to every member; returns the members' checksums."""
        src = decision.members.index(decision.donor)
        for o in self.outer:
            self.group.broadcast(o, src)
        for o in self.outer:
            state = self.optimizer.state[o]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(o)
            self.group.broadcast(state["momentum_buffer"], src)
        counters = torch.tensor([self.outer_step, self.progress.step, self.progress.tokens], dtype=torch.float64)
        self.group.broadcast(counters, src)
        self.outer_step, self.progress.step, self.progress.tokens = (int(x) for x in counters.tolist())
        self.scheduler.last_epoch = self.progress.step
        for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_lr()):
            group["lr"] = lr
        return checksum_table(self.checksum_tensors(), self.group)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["round"] = self.round
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.round = state.get("round", 0)
