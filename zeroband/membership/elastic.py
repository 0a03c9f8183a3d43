"""Membership that survives sites dying, hanging, joining and leaving, with no master.

`DiLoCo` (zeroband/outer/diloco.py) computes the outer step; this decides who takes part in it:
each round goes through `RoundCoordinator` (zeroband/membership/rounds.py): the sites agree on the
members, form this generation's global groups (fresh store prefix; survivors keep their processes
and state), hand the outer state to members that lack it (joiners, restarted or dropped sites),
all-reduce, vote, and apply the step only if the verdict is `commit`. A failed attempt is retried
in a new generation with the same pseudo-gradients, never applying a partial result.

- Crash, hang or partition of a site: its heartbeat stops; waits and the all-reduce are abandoned
  as soon as a member is seen dead (within `dead_after_s`), or at the group timeout at worst.
- Join: a site that starts while a run is going on waits for the next boundary, receives the state
  dicts registered with `register_state_dict_fn` (the outer state, progress, schedule: what a
  checkpoint saves) from a live peer over the global group, checks the outer state by checksum
  against every member, and trains from there. Sites keep fixed slots (`site_rank` <
  `site_count`); which documents each reads is the data ledger's (zeroband/data/ledger.py), a
  `RoundParticipant` called before each vote and at each commit (`add_participant`).
- Leave (SIGTERM): the site writes `leave/<site>`, so nobody waits for its heartbeat to time out.
- End: the members that commit the round after which the run is over (`run_end`, the outer loop's
  rule) publish it (`complete`, signed). A site without the run's state (starting, restarted, or
  left out of the last round) that reads it, at its start, before each attempt or while it waits
  for a decision, stops with `RunComplete` (exit 0, event "run_complete"): it never forms a group of
  its own after the end, even when the last members finish while it waits to be admitted.
- Quorum: a round proceeds with at least `min_sites` members once every expected live site has
  arrived or `grace_s` has passed (a number, or "auto": from this site's measured step, exchange
  and arrival times, membership/grace.py); a late site waits for the next boundary as a joiner and
  re-syncs from a peer there, bringing its late round to that merge with diloco.late_weight > 0
  (zeroband/outer/diloco.py `offer`; the data ledger holds its lease that one round), else dropping it.
- Events: every decision the site acts on is also a structured record (`attach(sink)`; the loop
  writes them to metrics.jsonl as kind "membership", shapes in docs/architecture.md).
- Trust: members of a new generation admit each other with a challenge-response on the shared
  secret and compare config fingerprints (zeroband/trust/auth.py) before forming groups. Every
  store value is signed for this launch only ($ZEROBAND_INCARNATION, trust/signed.py).
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from zeroband.comm.group import OPEN, SECRET, GlobalGroup, checksum_table, new_global_group, rendezvous
from zeroband.comm.link import LinkPolicy
from zeroband.config import DilocoConfig, SitesConfig
from zeroband.membership.base import Event, EventLog
from zeroband.membership.grace import AUTO_FIRST_S, GraceMeter, auto_grace
from zeroband.membership.heartbeat import (
    Heartbeat,
    LeaseHeartbeat,
    LeaseLiveness,
    Liveness,
    Presence,
    heartbeat_key,
    leave_key,
)
from zeroband.membership.rounds import (
    Decision,
    LeftBehind,
    RoundCoordinator,
    RoundParticipant,
    RunComplete,
    run_over,
)
from zeroband.mesh import Topology
from zeroband.store.client import open_store, store_failures_named
from zeroband.store.etcd import EtcdStore
from zeroband.trust.auth import SECRET_FIX, PeerRefused, Verdict, admission
from zeroband.trust.mac import WireAuth
from zeroband.trust.signed import INCARNATION_ENV, SignedStore, incarnation_key, run_incarnation, stop_keepers
from zeroband.watchdog import Watch, read_by_all

log = logging.getLogger(__name__)


class MemberLost(RuntimeError):
    pass


class StateDiffers(RuntimeError):
    """The members' outer state differs after a hand-over: the attempt fails."""


class ElasticAttempt:
    """One attempt of an elastic round: groups of this generation, the state handed to members that
    lack it, the outer loop's collectives on them, and a vote; any failure inside `with` is the attempt's."""

    def __init__(self, member: ElasticMembership, decision: Decision, number: int) -> None:
        self.member, self.decision, self.number, self.topic = member, decision, number, decision.topic
        self.contributes = not member.fresh
        self.averages = member.round > 0 and decision.has_holder  # else the state hand-over is the whole round
        self.failed = self.committed = False

    def __enter__(self) -> ElasticAttempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> bool:
        m = self.member
        if error is None or not isinstance(error, Exception):
            return False
        if isinstance(error, PeerRefused) and m.world.site_rank not in [self.decision.members[i] for i in error.admitted]:
            m.leave()  # we are the foreign peer: stop, and let the others go on without us
            return False
        if isinstance(error, PeerRefused | StateDiffers):
            log.error("round %d: %s", m.round, error)
        else:  # every failure is voted on, never applied
            log.warning("round %d: attempt failed on site %d rank %d: %s", m.round, m.world.site_rank, m.world.rank,
                        error)
        self.failed, m.group = True, None  # a group that saw a failure is not trusted again
        return True

    def group(self) -> GlobalGroup:
        """This generation's group, formed on a watched thread (rendezvous, admission, the run's state
        handed to members that lack it). From here on every watched call on it (the outer loop's
        all-reduce) also gives up as soon as a member is seen dead or another member aborted this
        attempt (`ElasticMembership.check`). Site-group collectives happen only on the main thread,
        outside the watched ones: an abandoned thread must never hold a site collective that the
        others would match with another."""
        m, check = self.member, partial(self.member.check, self.decision, self.number)
        m.watch.check, m.watch.current = None, "the members (forming the group)"  # one thread polls the store
        group, crcs = m.watch.run(partial(m._form, self.decision, self.number), f"round {m.round}: forming the group", check)
        # kept only here, on the main thread: a forming thread abandoned by an aborted attempt must never
        # install its group afterwards (its generation would be proposed again, with stale admission values)
        m.group, m.generation, m.members = group, self.decision.generation, self.decision.members
        if crcs is not None and len(set(crcs)) > 1:
            raise StateDiffers(f"outer state differs between members after hand-over: {crcs}")
        m.watch.check = check
        return group

    def commit(self) -> bool:
        m, decision = self.member, self.decision
        m.watch.check = None  # this attempt's waits are over
        bound = None if m.group is None else m.group.settle_bound()  # None: it failed, its vote aborts
        with store_failures_named(m.sites.store):  # the participants write and read the store too
            for participant in m.participants:  # before the site's vote: its ranks agree on it in `_site_ok`
                participant.before_vote(m.round, self.number, decision)
            verdict = m.rounds.vote_and_verdict(m.round, self.number, decision, m._site_ok(not self.failed),
                                                m.sites.timeout_s, bound)
            if verdict == "commit":
                m._commit(decision, self.number)
                self.committed = True
                stop_keepers()  # every member passed this generation's waits: all read our values of them
                return True
        log.warning("round %d attempt %d aborted (members %s); retrying", m.round, self.number, decision.members)
        m.emit("aborted", attempt=self.number, members=decision.members, generation=decision.generation)
        m.group = None  # a group that saw a failure is not trusted again
        return False


class ElasticMembership:
    def __init__(self, cfg: DilocoConfig, sites: SitesConfig, topology: Topology, run_name: str,
                 fingerprint: dict[str, str], total_steps: int = 0,
                 run_end: Callable[[], int | None] = lambda: None) -> None:
        # the run's end: train.steps, and the step at which the run is over once a round committed
        # (the outer loop's rule; None while it goes on)
        self.total_steps, self.run_end = total_steps, run_end
        self.cfg, self.sites, self.topology, self.world, self.fingerprint = cfg, sites, topology, topology.world, fingerprint
        self.checksums: list[Callable[[], list[torch.Tensor]]] = []  # what must agree after a hand-over
        # this launch's keys only: under its own prefix (a persistent store's earlier launches are
        # never read) and signed under its own key (a value copied from one is refused: trust/signed.py)
        incarnation = run_incarnation()
        self.prefix = f"zeroband/{run_name}/elastic/" + (f"{incarnation}/" if incarnation else "")
        slots = range(self.world.site_count)
        self.secret = topology.secret
        self.auth = WireAuth.from_secret(self.secret, run_name)  # seals all-reduce messages
        # and, independently keyed, the protocol's store values (the ledger's too: `self.signed`)
        sign_key = incarnation_key(self.auth.subkey("store"), incarnation)
        self.sign_key = sign_key  # for a SignedStore on another connection: bound to this launch alike
        if self.secret is not None and not incarnation and self.world.rank == 0:
            log.warning("%s is unset: this run's signed store values verify in every launch of run %r, so values "
                        "recorded from an earlier launch (its `complete`) can be replayed into this one; `zeroband "
                        "launch` sets it, else export one fresh value on every site at each launch", INCARNATION_ENV,
                        run_name, extra={"event": "incarnation_unset"})
        # With the secret nobody without the run's credentials deletes a key (store/client.py
        # `open_store`): what we write stays until we delete it. On etcd liveness is its leases, elsewhere signed beats.
        assert topology.store is not None, "elastic membership needs the coordination store (sites.store)"
        self.store: dist.Store = topology.store
        etcd = topology.store if isinstance(topology.store, EtcdStore) else None
        self.signed = SignedStore(self.store, sign_key)
        me, reopen = self.world.site_rank, lambda: open_store(sites.store, False, timedelta(seconds=sites.timeout_s))
        self.liveness: Presence
        self.heartbeat: Heartbeat | None = None
        beat: Heartbeat
        if etcd is not None:
            self.liveness = LeaseLiveness(etcd, self.prefix, slots, cfg.dead_after_s, sign_key, me)
            beat = LeaseHeartbeat(reopen, self.prefix, me, cfg.heartbeat_s, cfg.dead_after_s, sign_key)
        else:
            self.liveness = Liveness(self.store, self.prefix, slots, cfg.dead_after_s, sign_key, me)
            beat = Heartbeat(reopen, self.prefix, me, cfg.heartbeat_s, sign_key)
        self.rounds = RoundCoordinator(self.store, self.prefix, me, self.world.rank == 0, self.liveness, sign_key)
        if self.world.rank == 0:
            self.store.delete_key(leave_key(self.prefix, me))  # back after a leave
            self.heartbeat = beat.start()
        self.watch = Watch(sites.timeout_s, interruptible=False)  # SIGTERM here means: finish the round, then leave
        self.members: list[int] = []
        self.generation = -1
        self.group: GlobalGroup | None = None
        self.fresh = True  # until this site holds the run's current outer state
        self.had_peer = False  # a decision named another site: it shares our secret (`refuse_if_foreign`)
        self.round = 0
        self.may_retry = True
        self.handed: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.participants: list[RoundParticipant] = []  # called before each vote and at each commit
        self.events = EventLog(self.world.site_rank)
        self.meter = GraceMeter(*grace_steps(cfg))  # the measured inputs of grace_s = "auto"
        self.shown_grace: float | None = None  # the window last printed

    # ------------------------------------------------------------------ the protocol's small parts
    @property
    def holds_state(self) -> bool:
        return not self.fresh

    def rounds_done(self, local_rounds: int) -> int:
        return self.round - 1  # rounds are the shared clock; round 0 was the start

    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any],
                               checksum_fn: Callable[[], list[torch.Tensor]] | None = None) -> None:
        self.handed[key] = (load_fn, save_fn)
        if checksum_fn is not None:
            self.checksums.append(checksum_fn)

    def attach(self, sink: Callable[[Event], None]) -> None:
        self.events.attach(sink)

    def add_participant(self, participant: RoundParticipant) -> None:
        self.participants.append(participant)

    def emit(self, event: str, **fields: Any) -> Event:
        return self.events.emit(event, round=self.round, **fields)

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = state.get("round", 0)

    # ------------------------------------------------------------------ start / join / leave
    def start(self, resumed: bool) -> None:
        """Find the round being formed: round 0 at launch, the next boundary when joining. A resumed
        site is still fresh: the live run (or, after a full restart, the lowest site) decides the
        state, so sites restarted from different checkpoints cannot diverge."""
        with store_failures_named(self.sites.store):
            self.liveness.poll()
            self.round = self.rounds.committed_round() + 1
            self._stop_if_over()

    def _stop_if_over(self) -> None:
        """Act on `run_over` (a site without the state: one store read): record it, leave, raise
        RunComplete. Each rank reads on its own; the key stays, so all of them stop."""
        if not self.fresh or not self.total_steps:
            return
        end = self.rounds.completed()
        if not run_over(end, self.total_steps, self.fresh):
            return
        assert end is not None  # run_over says so
        event = self.emit("run_complete", last_round=end["round"], step=end["step"])
        self.leave()
        raise RunComplete(event)

    def leave(self) -> None:
        """Announce the departure, stop the heartbeat thread and drop the group (clean exit)."""
        beat, self.heartbeat = self.heartbeat, None
        if beat is not None:
            beat.stop()
        if self.world.rank == 0:
            with store_failures_named(self.sites.store):
                self.signed.set(leave_key(self.prefix, self.world.site_rank), str(self.round))
        self.group = None

    # ------------------------------------------------------------------ one round
    def attempts(self, topic: int | None = None) -> Iterator[ElasticAttempt]:
        """This round's attempts, one per generation. A site left out of a decision waits for the next
        boundary as a joiner (its own progress of this round is dropped) and goes on in that round.
        `topic`: the fragment this site syncs (a holder's proposal names it: `Decision.topic`)."""
        number = 0
        while True:
            with store_failures_named(self.sites.store):
                self._stop_if_over()  # left out of the run's last round, say
                try:
                    decision = self._decide(number, topic)
                    left_out = self._left_out(decision, number)
                except LeftBehind as e:  # never propose for a round the others already committed
                    log.warning("round %d: %s; joining the next boundary", self.round, e)
                    self.emit("left_out", attempt=number, members=[], fresh=[], generation=-1)
                    left_out = True
            if left_out:  # the others went on without us: our group is stale, never to be reused
                self.fresh, self.round, number, self.group = True, self.round + 1, 0, None
                self.meter.restart(None)  # it waits for the next boundary: no inner steps to time
                continue
            attempt = ElasticAttempt(self, decision, number)
            yield attempt
            if attempt.committed:
                return
            if self.after_aborted(number, self.cfg.max_retries) == "skip":
                self._skip()
                return
            number += 1

    def _left_out(self, decision: Decision, attempt: int) -> bool:
        """Whether this site is outside `decision` (late, presumed dead, or the decision predates a restart)."""
        log.info("site %d round %d attempt %d: %s", self.world.site_rank, self.round, attempt, decision)
        self.emit("decision", attempt=attempt, members=decision.members, fresh=decision.fresh,
                  generation=decision.generation)
        refuse_if_foreign(self, decision)
        stale = self.fresh and self.world.site_rank not in decision.fresh  # decided before we (re)started
        if self.world.site_rank in decision.members and not stale:
            return False
        log.warning("round %d: left out (late, presumed dead, or a decision from before a restart); "
                    "joining the next boundary", self.round)
        self.emit("left_out", attempt=attempt, members=decision.members, fresh=decision.fresh,
                  generation=decision.generation)
        return True

    @staticmethod
    def after_aborted(attempt: int, max_retries: int) -> str:
        """What follows aborted attempt number `attempt` of a round: "retry" in a new generation while
        attempts remain, else "skip": the round ends without an outer step (`_skip`, next)."""
        return "retry" if attempt < max_retries else "skip"

    def _skip(self) -> None:
        """The effect of "skip": the round is over without an outer step. The outer loop
        then applies nothing, so every site keeps its local progress and its outer copy."""
        log.error("round %d failed %d times: skipped, local progress kept", self.round, self.cfg.max_retries + 1)
        self.emit("skipped", attempts=self.cfg.max_retries + 1)
        self.round += 1
        self.meter.restart(time.monotonic())

    def _decide(self, attempt: int, topic: int | None = None) -> Decision:
        expected = set(range(self.world.site_count)) if self.round == 0 else set(self.members)
        self.meter.arrived(time.monotonic())
        grace = self.cfg.start_grace_s if self.round == 0 else self._grace(len(expected))
        timeout = self.cfg.join_timeout_s if self.fresh else self.sites.timeout_s
        decision = self.rounds.rendezvous(self.round, attempt, expected, self.cfg.min_sites, grace, self.fresh,
                                          timeout, self._next_generation, self._stop_if_over, topic)
        self.meter.decided(time.monotonic(), *self.rounds.last_wait.timings())
        return decision

    def _grace(self, sites: int) -> float:
        """diloco.grace_s, or with "auto" the window `auto_grace` derives from this site's measurements;
        a changed window is logged and recorded (event "grace"). Only a proposer's window decides
        anything (`decide_members`), so sites that measured differently disagree harmlessly."""
        if self.cfg.grace_s != "auto":
            return self.cfg.grace_s
        if self.fresh:  # it never proposes a round it has no state for: the window is unused
            return AUTO_FIRST_S
        measured = self.meter.measured()
        grace = auto_grace(measured, sites, AUTO_FIRST_S)
        if self.shown_grace is None or abs(grace - self.shown_grace) > 0.1 * self.shown_grace:
            self.shown_grace = grace
            fields = {k: None if v is None else round(v, 3) for k, v in vars(measured).items()}
            log.info("round %d: grace window %.2f s (auto; measured %s)", self.round, grace,
                     " ".join(f"{k}={v}" for k, v in fields.items()),
                     extra={"event": "grace", "grace_s": grace})
            self.emit("grace", grace_s=round(grace, 3), sites=sites, **fields)
        return grace

    def _next_generation(self, members: list[int]) -> int:
        """Keep the groups while the members are the same and healthy; else a fresh generation."""
        if self.group is not None and members == self.members:
            return self.generation
        return self.store.add(self.prefix + "generation", 1)

    def _form(self, decision: Decision, attempt: int) -> tuple[GlobalGroup, list[str] | None]:
        """The attempt's group, and the members' digests after a hand-over (global groups and the store only)."""
        group = self._ensure_group(decision, attempt)
        return group, self._hand_over(decision, group) if decision.fresh else None

    def _site_ok(self, ok: bool) -> bool:
        flag = torch.tensor([1.0 if ok else 0.0], device=self.world.device)
        self.topology.site_all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _ensure_group(self, decision: Decision, attempt: int) -> GlobalGroup:
        if self.group is not None and decision.generation == self.generation:
            return self.group
        index = decision.members.index(self.world.site_rank)
        # Formed under a prefix of its own attempt: no two attempts' admission values ever meet.
        prefix = f"{self.prefix}r{self.round}/a{attempt}/gen{decision.generation}/shard{self.world.rank}/"
        timeout = timedelta(seconds=self.sites.timeout_s)
        mark = OPEN if self.secret is None else SECRET
        rendezvous(self.store, prefix, index, len(decision.members), self.sites.timeout_s, mark,
                   self.auth.subkey("arrive"))
        admitted = admission(self.store, prefix, index, len(decision.members), self.secret,
                             self.fingerprint, timeout)
        auth = self.auth.for_session(prefix.encode(), admitted.nonces)  # this generation's key only
        group = new_global_group(self.store, prefix, index, len(decision.members), timeout,
                                 self.sites.backend, self.watch, mark, auth, policy=LinkPolicy.of(self.sites))
        for record in group.link_records():  # the link measured for this generation
            self.emit("link", generation=decision.generation, members=decision.members, **record)
        return group

    def check(self, decision: Decision, attempt: int) -> None:
        """While a watched call of the attempt waits (the watcher polls this): give up as soon as a
        member is seen dead or another member has already aborted the attempt (the timeout bounds the rest).

        The abort matters when a member died mid all-reduce: the sites next to it get an error at
        once and vote fail, but a site waiting on one of *them* hears nothing until the dead site's
        heartbeat expires (dead_after_s). Left waiting, it would reach the retry after the others'
        grace window and be left out of a round it was ready for."""
        dead = self.liveness.dead_among(decision.members)
        if dead:
            raise MemberLost(f"sites {sorted(dead)} stopped responding")
        if self.rounds.verdict(self.round, attempt) == "abort":
            raise MemberLost("another member aborted this attempt")

    def _commit(self, decision: Decision, attempt: int) -> None:
        self.fresh, self.members = False, decision.members
        self.meter.committed(time.monotonic())
        if self.world.site_rank == decision.donor and self.world.rank == 0:
            self.rounds.mark_committed(self.round)
        self.emit("commit", attempt=attempt, members=decision.members, generation=decision.generation,
                  joined=decision.fresh)
        for participant in self.participants:
            participant.on_commit(self.round, decision)
        self.round += 1
        if (step := self.run_end()) is not None:  # every member publishes it: any one of them suffices
            self.rounds.mark_complete(self.round - 1, step, self.total_steps)

    # ------------------------------------------------------------------ state hand-over
    def _hand_over(self, decision: Decision, group: GlobalGroup) -> list[str]:
        """The donor's registered state to every member; returns the members' keyed digests."""
        hand_over(group, decision.members.index(decision.donor), self.handed)
        return checksum_table([t for fn in self.checksums for t in fn()], group)


def grace_steps(cfg: DilocoConfig) -> tuple[int, int]:
    """(inner steps per round, inner steps the exchange runs behind: 0 for blocking outer steps) of
    the grace rule. A round is one fragment's (zeroband/outer/fragments.py); an overlapped average
    lands overlap_steps after its launch, or a whole round later with 0."""
    per_round = max(1, cfg.inner_steps // cfg.fragments)
    return per_round, (cfg.overlap_steps or per_round) if cfg.overlap else 0


def hand_over(group: GlobalGroup, src: int, handed: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]]) -> None:
    """Member `src`'s registered state dicts (what a checkpoint saves) loaded on every other member:
    sealed with the run's key (a forged or replayed payload fails before it is read) and read
    with weights_only=True (tensors and plain values only)."""
    payload = None
    if group.rank == src:
        buf = io.BytesIO()
        torch.save({key: save() for key, (_, save) in handed.items()}, buf)
        payload = buf.getvalue()
    state = torch.load(io.BytesIO(group.broadcast_bytes(payload, src)), weights_only=True)
    if group.rank != src:
        for key, (load, _) in handed.items():
            load(state[key])


def foreign_alone(refused: int, slots: int, fresh: bool, had_peer: bool) -> bool:
    """Whether a site that decided a round alone holds another secret than the run: `refused` of
    the other `slots - 1` slots hold heartbeats that fail its key. A failing beat alone does not say
    which side is foreign (each side sees the other's fail), so the failing slots are counted
    against the rest: this site, the slots whose beats verify, and the silent ones, which may be
    honest peers not started yet (issue 23: an honest site alone with one foreign beat and its late
    peer refused itself). `had_peer`: a decision once named another site, which signed its arrival
    with our key: never the foreign one. A tie refuses a `fresh` site (starting or joining: two
    slots, each sees the other fail, both stop naming the mismatch) but not one that has trained
    alone, so a foreign newcomer never stops a running site. It is checked again at each round
    until it has a peer: a foreign site that started beside one honest site goes on alone until
    the others' beats show."""
    if had_peer or refused == 0:
        return False
    rest = slots - refused
    return refused >= rest if fresh else refused > rest


def refuse_if_foreign(member: ElasticMembership, decision: Decision) -> None:
    """Alone, while most other slots' heartbeats are there but fail our key (`foreign_alone`): we
    hold another secret. Stop with the admission error rather than train alone (the others do not
    see us either)."""
    me = member.world.site_rank
    member.had_peer = member.had_peer or any(m != me for m in decision.members)
    if decision.members != [me]:
        return
    refused = member.liveness.store.refused
    why = {s: refused[heartbeat_key(member.prefix, s)] for s in range(member.world.site_count)
           if s != me and heartbeat_key(member.prefix, s) in refused}
    if not foreign_alone(len(why), member.world.site_count, member.fresh, member.had_peer):
        return
    member.leave()
    if "bad-mac" in why.values():
        reason = (f"wrong or missing shared secret: the store values of sites {sorted(why)} do not verify under "
                  f"this site's secret (configs are compared only once the secret matches); {SECRET_FIX}")
    else:  # a secret on one side only
        marks = {me: OPEN if member.secret is None else SECRET} | {s: OPEN if r == "unsigned" else SECRET
                                                                   for s, r in why.items()}
        who = ", ".join(f"site {s} {m}" for s, m in sorted(marks.items()))
        reason = f"sites disagree on admission ({who}); set the same sites.secret or ZEROBAND_SECRET on every site"
    # the others see the same mismatch about now; give them time to read it before the store may go
    read_by_all(member.store, f"{member.prefix}refused/", me, member.world.site_count, 2 * member.cfg.dead_after_s)
    raise PeerRefused(me, Verdict([], {me: reason}))
