"""Agreeing, without a leader, on who takes part in an outer step and whether it counts.

Every outer round r (round 0 is the start) may take several attempts a. For each attempt:

1. **arrive**: each site's rank 0 writes `r<r>/a<a>/arrive/<site>`;
2. **decide who**: one site (`proposer`: the lowest live one that arrived holding the state)
   proposes the member list once `decide_members` (a pure function of who arrived, who is alive,
   who took part last time, the quorum and the grace window) says so; the proposal is written
   with compare-and-set and every site reads the same `r<r>/a<a>/members`. Sites that arrive after
   it are not in this attempt;
3. the members form the attempt's groups, transfer state to fresh members, all-reduce;
4. **vote**: each member site writes ok/fail (ok only if every one of its ranks succeeded);
5. **verdict**: any site may write `commit` (all members voted ok) or `abort` (a fail vote, a
   member dead or gone, or the vote timed out), again by compare-and-set. A committed step is
   applied by every member; an aborted one by none, and the round is retried as attempt a+1 in
   a new generation. So no two survivors ever apply different results. A member still inside
   its exchange gives up as soon as it reads an abort, so it reaches the retry with the others.

The store is linearizable (one TCPStore server, or etcd), which is all the agreement needs; on
etcd a write-once slot is a transaction (`create_revision == 0`), and waits watch the store. Every
value is signed with the shared secret (zeroband/trust/signed.py): a forged arrival, member
list, vote or verdict reads as absent, and an honest site takes a forged write-once slot back.
With the secret nobody without the run's credentials deletes a key (store/client.py `open_store`),
so a write-once slot stays written and a value read once stays readable.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from zeroband.membership.grace import lateness
from zeroband.membership.heartbeat import Presence
from zeroband.trust.signed import SignedStore
from zeroband.watchdog import Ticker, _sites

log = logging.getLogger(__name__)


class RoundTimeout(TimeoutError):
    pass


class RunComplete(Exception):
    """This site came after the run's last round: it stops (exit 0) without training. `event`: the
    structured record of it (membership event "run_complete")."""

    def __init__(self, event: dict[str, Any]) -> None:
        super().__init__(f"run already complete at step {event['step']} (its last round, {event['last_round']}, was "
                         "committed before this site could take part in it); nothing to train: this site stops")
        self.event = event


class LeftBehind(RuntimeError):
    """The round was committed without this site (it came late). Proposing one now would commit the
    round twice, by disjoint sites."""


@dataclass(frozen=True)
class Decision:
    members: list[int]
    fresh: list[int]  # members that must receive the state before they contribute
    generation: int  # groups are built under this generation's store prefix
    # The fragment the round syncs (zeroband/outer/fragments.py), as its proposer, a holder of the
    # state, is due to: a site without the state contributes to that one. None: the whole model, or
    # a round that only hands the state over (no holder: `_propose_if_orphaned`).
    topic: int | None = None

    @property
    def has_holder(self) -> bool:
        """Some member holds the run's state (else the round re-forms the run from the lowest member's)."""
        return any(m not in self.fresh for m in self.members)

    @property
    def donor(self) -> int:
        """The member that sends the state: the lowest one that has it (or the lowest of all)."""
        holders = [m for m in self.members if m not in self.fresh]
        return min(holders) if holders else min(self.members)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Decision:
        return cls(**json.loads(raw))


class RoundParticipant(Protocol):
    """State that moves with the rounds (the data ledger, zeroband/data/ledger.py): the membership
    calls it on every rank, on the main thread, where site collectives are safe."""

    def before_vote(self, round: int, attempt: int, decision: Decision) -> None:
        """Before this site votes on `attempt` (once every rank returned here): what the commit will
        read from this rank must be in the store now."""

    def on_commit(self, round: int, decision: Decision) -> None:
        """Round `round` was committed by `decision`'s members (the verdict is read, the step applied)."""


@dataclass
class WaitState:
    """When the quorum was first seen during this attempt (for the grace window), and what this site
    saw of the arrivals (the measured inputs of `grace_s = "auto"`, membership/grace.py)."""

    quorum_since: float | None = None
    arrived: dict[int, str] = field(default_factory=dict)  # every arrival read so far
    extra: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # this site arrived
    seen_at: dict[int, float] = field(default_factory=dict)  # when each arrival was first read
    decided_at: float | None = None  # `decide_members` first said go (after round 0 only)
    waited_for: set[int] = field(default_factory=set)  # the sites it waited for then

    def timings(self) -> tuple[float | None, float | None]:
        """(quorum time, lateness after the quorum) of this attempt as this site saw it; None where
        it saw none (it never decided: another site proposed first, or round 0's launch spread)."""
        if self.decided_at is None or self.quorum_since is None:
            return None, None
        late = lateness(self.seen_at, self.quorum_since, self.waited_for, self.decided_at)
        return self.quorum_since - self.started, late


def decide_members(
    arrived: set[int], alive: set[int], expected: set[int], min_sites: int, grace_s: float,
    now: float, wait: WaitState, wait_for_unseen: bool = False,
) -> list[int] | None:
    """The members of an attempt, or None to keep waiting.

    Proceed when every expected site that is still alive has arrived, or when a quorum
    (`min_sites`) has been waiting for `grace_s`: late sites are then left out (their
    pseudo-gradients dropped; they re-sync from a peer at the next boundary). At launch
    (`wait_for_unseen`) sites that have not shown a heartbeat yet are waited for too.
    """
    ready = arrived & alive
    if len(ready) < min_sites:
        wait.quorum_since = None
        return None
    if wait.quorum_since is None:
        wait.quorum_since = now
    waiting_for = expected if wait_for_unseen else expected & alive
    if waiting_for <= ready or now - wait.quorum_since >= grace_s:
        return sorted(ready)
    return None


def orphaned(arrivals: dict[int, str], alive: set[int], me: int) -> bool:
    """No live site holds the run's state: every live site has arrived at this attempt, and fresh.
    All the holders died (one after another, each restarted before the next died), so waiting for
    one of them to propose would wait forever; the fresh sites form the round among themselves and
    the lowest one's state (its checkpoint) goes to the others, as after a full restart. A site
    alone is not orphaned: the run finished or every other site is gone (`_alone` says so)."""
    return bool(alive - {me}) and alive <= set(arrivals) and all(arrivals[s] == "fresh" for s in alive)


def run_over(end: dict[str, int] | None, total_steps: int, fresh: bool) -> bool:
    """Whether this site must stop instead of joining: the run's finishing members published its
    `end` ({"steps": their train.steps, "step", "round"}; None: not yet, or forged) and this site
    does not hold the run's state (`fresh`: a joiner, a restarted site, or one left out of the last
    round), so there is no round left for it. An end of fewer train.steps than this site's is an
    earlier, shorter run of this name (train.steps raised on a resume): not this run's end. A site
    holding the state is the run itself: its own loop ends it."""
    return fresh and end is not None and end["steps"] >= total_steps


def proposer(arrivals: dict[int, str], alive: set[int], r: int) -> int | None:
    """The one site that writes an attempt's member list: the lowest live site that has arrived and
    may propose (holds the state, or anyone at launch); None if there is none yet. Should that site
    die or leave, the next one takes over once it is seen dead."""
    able = {s for s, v in arrivals.items() if s in alive and (r == 0 or v == "ready")}
    return min(able) if able else None


def decide_verdict(members: list[int], votes: dict[int, str], gone: set[int]) -> str | None:
    """'commit', 'abort', or None to keep waiting for votes (`gone`: members dead, left or `overdue`)."""
    if any(v != "ok" for v in votes.values()) or gone & set(members) - set(votes):
        return "abort"
    if set(votes) >= set(members):
        return "commit"
    return None


def overdue(members: list[int], votes: dict[int, str], since_vote_s: float, bound_s: float | None) -> set[int]:
    """Members whose vote is overdue, `since_vote_s` after this site voted. A site votes once all its
    ranks completed the attempt's exchanges, so every other member then holds all but what this
    site's uplink still carried and only has its own CPU work left: its vote is due within `bound_s`
    (GlobalGroup.settle_bound: the link bound of the largest payload of the attempt). One that
    froze after its last message (before voting) is treated like a dead one, instead of stalling the
    others until sites.timeout_s. None: no measured link; dead_after_s and timeout_s end the wait."""
    if bound_s is None or since_vote_s < bound_s:
        return set()
    return set(members) - set(votes)


class RoundCoordinator:
    """The store protocol of one site (all its ranks use it; only rank 0 writes)."""

    def __init__(self, store: dist.Store, prefix: str, site: int, is_leader: bool, liveness: Presence,
                 sign_key: bytes | None = None) -> None:
        self.store = SignedStore(store, sign_key)
        self.prefix, self.site, self.is_leader, self.liveness = prefix, site, is_leader, liveness
        self.last_wait = WaitState()

    def _key(self, r: int, a: int, *rest: object) -> str:
        return self.prefix + f"r{r}/a{a}/" + "/".join(str(x) for x in rest)

    def committed_round(self) -> int:
        """The newest committed round (-1 before the first)."""
        return int(self.store.read(self.prefix + "committed") or 0) - 1

    def rendezvous(self, r: int, a: int, expected: set[int], min_sites: int, grace_s: float, fresh: bool,
                   timeout_s: float, new_generation: Callable[[list[int]], int],
                   stop_if_over: Callable[[], None] = lambda: None, topic: int | None = None) -> Decision:
        """Arrive, and (holders of the state, or anyone at launch) propose once it is time.

        A fresh site joining a running run never proposes: it cannot know whom to expect. While it
        waits, `stop_if_over` (at every poll) stops it once the run has ended: the last members may
        finish while it waits, and joiners alone would otherwise form the run again (`orphaned`).
        """
        key = self._key(r, a, "members")
        if self.is_leader:
            self.store.set(self._key(r, a, "arrive", self.site), "fresh" if fresh else "ready")
        may_propose = self.is_leader and (r == 0 or not fresh)
        wait, deadline = WaitState(), time.monotonic() + timeout_s
        self.last_wait = wait  # what this site saw of the attempt, for the grace rule
        ticker = Ticker(f"round {r} attempt {a}: member decision")
        while (raw := self.store.read(key)) is None:
            ticker.tick("the other sites to arrive" if may_propose else "a site holding the state to decide")
            if self.committed_round() >= r:
                raise LeftBehind(f"round {r} was committed without this site")
            if time.monotonic() > deadline:
                raise RoundTimeout(f"round {r} attempt {a}: no member decision within {timeout_s:.0f} s")
            if not may_propose:
                stop_if_over()  # before a fresh site would ever propose, or give up as alone
            if may_propose:
                raw = self._maybe_propose(r, a, expected, min_sites, grace_s, fresh, wait, new_generation, topic)
            elif self.is_leader:
                raw = self._propose_if_orphaned(r, a, min_sites, new_generation)
            if raw is not None:  # what the slot holds now: decided
                break
            if not may_propose and self._alone(wait):
                raise RoundTimeout(f"round {r}: no other site has been alive for {self.liveness.dead_after_s:.0f} s; "
                                   "the run has finished or every other site is gone, so there is nothing to join")
            self.liveness.wait()  # a poll interval, or a watch of the store
        return Decision.from_json(raw)

    def _alone(self, wait: WaitState) -> bool:
        """A joiner that has seen no other live site for dead_after_s (they finished or died)."""
        self.liveness.poll()
        if self.liveness.alive() - {self.site}:
            wait.extra.pop("alone_since", None)
            return False
        since = wait.extra.setdefault("alone_since", time.monotonic())
        return time.monotonic() - since > self.liveness.dead_after_s

    def _arrivals(self, r: int, a: int) -> dict[int, str]:
        """{site: "ready" | "fresh"} of the sites that arrived at this attempt."""
        out = {}
        for s in self.liveness.sites:
            raw = self.store.read(self._key(r, a, "arrive", s))
            if raw is not None:
                out[s] = raw.decode()
        return out

    def _propose_if_orphaned(self, r: int, a: int, min_sites: int,
                             new_generation: Callable[[list[int]], int]) -> bytes | None:
        """A fresh site proposes only when no live site holds the state (`orphaned`), and only the
        lowest live one (one writer: `proposer`). Returns the member list the slot holds, if it wrote."""
        self.liveness.poll()
        arrivals, alive = self._arrivals(r, a), self.liveness.alive()
        if not orphaned(arrivals, alive, self.site) or len(alive) < min_sites or self.site != min(alive):
            return None
        members = sorted(alive)
        proposal = Decision(members, members, new_generation(members)).to_json()
        return self.store.compare_set(self._key(r, a, "members"), "", proposal)

    def _maybe_propose(self, r: int, a: int, expected: set[int], min_sites: int, grace_s: float, fresh: bool,
                       wait: WaitState, new_generation: Callable[[list[int]], int],
                       topic: int | None = None) -> bytes | None:
        """Propose once `decide_members` says so, if this site is the attempt's `proposer`; returns the
        member list the slot holds then (ours, or one written just before), or None to keep waiting.
        Arrivals count once read, and this site's own without a read."""
        self.liveness.poll()
        for s in self.liveness.sites:
            if s not in wait.arrived and (raw := self.store.read(self._key(r, a, "arrive", s))) is not None:
                wait.arrived[s], wait.seen_at[s] = raw.decode(), time.monotonic()
        wait.arrived[self.site] = "fresh" if fresh else "ready"
        alive, now = self.liveness.alive(), time.monotonic()
        expected = expected - self.liveness.left  # a site that said goodbye is never waited for
        members = decide_members(set(wait.arrived), alive, expected, min_sites, grace_s, now, wait,
                                 wait_for_unseen=r == 0)
        if members is not None and r > 0 and wait.decided_at is None:  # round 0's spread is the launch's
            wait.decided_at, wait.waited_for = now, expected & alive
        if members is None or proposer(wait.arrived, alive, r) != self.site:
            return None
        fresh_members = [s for s in members if wait.arrived[s] == "fresh"]
        proposal = Decision(members, fresh_members, new_generation(members), topic if r > 0 else None).to_json()
        return self.store.compare_set(self._key(r, a, "members"), "", proposal)

    def vote_and_verdict(self, r: int, a: int, decision: Decision, site_ok: bool, timeout_s: float,
                         bound_s: float | None = None) -> str:
        """Vote, and wait for the verdict; the leader proposes it once the votes call for one, or a
        member is dead or `overdue` (its vote not in `bound_s` after ours), or at timeout_s."""
        if self.is_leader:
            self.store.set(self._key(r, a, "vote", self.site), "ok" if site_ok else "fail")
        voted = time.monotonic()
        key, deadline = self._key(r, a, "verdict"), voted + timeout_s
        ticker = Ticker(f"round {r} attempt {a}: votes")
        while (verdict := self.verdict(r, a)) is None:
            ticker.tick(f"the votes of sites {decision.members}")
            proposal = self._tally(r, a, decision, time.monotonic() - voted, bound_s) if self.is_leader else None
            if proposal is None and time.monotonic() > deadline:
                proposal = "abort"  # a member that neither votes nor dies must not stall the others
            if proposal is not None:
                self.store.compare_set(key, "", proposal)
            self.liveness.wait()  # a poll interval, or a watch of the store
        return verdict

    def verdict(self, r: int, a: int) -> str | None:
        """The attempt's verdict, or None while there is none (a forged one reads as none)."""
        raw = self.store.read(self._key(r, a, "verdict"))
        return None if raw is None else raw.decode()

    def _tally(self, r: int, a: int, decision: Decision, since_vote_s: float = 0.0,
               bound_s: float | None = None) -> str | None:
        """The verdict the votes call for, or None to keep waiting."""
        votes = {}
        for m in decision.members:
            if (vote := self.store.read(self._key(r, a, "vote", m))) is not None:
                votes[m] = vote.decode()
        late = overdue(decision.members, votes, since_vote_s, bound_s)
        verdict = decide_verdict(decision.members, votes, self.liveness.dead_among(decision.members) | late)
        if late and verdict == "abort":
            log.warning("round %d attempt %d: no vote from %s within %.1f s of this site's vote (the link bound of "
                        "the attempt's largest payload): frozen or stalled, aborting", r, a, _sites(late), bound_s)
        return verdict

    def completed(self) -> dict[str, int] | None:
        """The run's end, once its finishing members published it (`mark_complete`); None before (a
        missing, forged or malformed value reads as "not yet")."""
        raw = self.store.read(self.prefix + "complete")
        try:
            end = json.loads(raw) if raw is not None else None
            return {k: int(end[k]) for k in ("steps", "step", "round")} if end is not None else None
        except (ValueError, TypeError, KeyError):
            return None

    def mark_complete(self, r: int, step: int, total_steps: int) -> None:
        """Publish that round r committed the run's end (step `step` of train.steps = `total_steps`):
        a site that comes later stops instead of joining (`run_over`)."""
        if self.is_leader:
            self.store.set(self.prefix + "complete", json.dumps({"steps": total_steps, "step": step, "round": r}))

    def mark_committed(self, r: int) -> None:
        """Advance the committed-round counter to r (once per round: the donor writes it)."""
        if r > self.committed_round():  # the value is r + 1, as a counter started at 0 would read
            self.store.set(self.prefix + "committed", str(r + 1))
