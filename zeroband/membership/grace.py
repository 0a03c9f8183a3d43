"""The grace window of an elastic round from measured times (`diloco.grace_s = "auto"`).

Once a quorum has arrived at a round, the proposer waits the grace window for the late sites
before leaving them out (`decide_members`, zeroband/membership/rounds.py). A fixed window is
either too short (an honest site a little late loses its round) or too long (every site that
arrived idles). `auto_grace` derives it from what the membership measures (`GraceMeter`): the
inner step time, the exchange's seconds, the quorum time and how late sites arrived after the
quorum in recent attempts. Only the proposer's window decides anything (it alone writes the member
list), so sites may hold different windows: nothing here needs to agree across sites.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

AUTO_FIRST_S = 5.0  # "auto" before anything is measured: the fixed default it replaces
EWMA_ALPHA = 0.3  # weight of the newest sample of a time (step, exchange, quorum)
LATE_WINDOW = 8  # attempts whose arrivals the lateness is the worst of


@dataclass(frozen=True)
class GraceRule:
    """The constants of the rule. The floor stays above the store's poll and watch (up to 0.5 s,
    membership/heartbeat.py) and the scheduling jitter of honest sites; the cap bounds any window."""

    slack_margin: float = 0.5  # share of the slack spent on waiting (the rest absorbs its noise)
    late_margin: float = 2.0  # multiple of the recent worst lateness waited for
    floor_s: float = 1.0
    cap_s: float = 60.0


@dataclass(frozen=True)
class Measured:
    """What the rule reads; None: not measured yet."""

    step_s: float | None = None  # one inner step
    sync_s: float | None = None  # one exchange: member decision to committed verdict
    quorum_s: float | None = None  # from arriving at a round to seeing the quorum there
    late_s: float | None = None  # the worst arrival after the quorum of recent attempts
    steps_per_round: int = 1  # inner steps between two rounds
    overlap_steps: int = 0  # inner steps the exchange runs behind (0: blocking outer steps)


def auto_grace(m: Measured, sites: int, fallback_s: float, rule: GraceRule = GraceRule()) -> float:
    """The grace window in seconds for a round of `sites` expected sites:

        slack = overlap_steps x step_s - (quorum_s + sync_s)
        free  = slack_margin x max(0, slack)
        paid  = min(late_margin x late_s, steps_per_round x step_s / (sites - 1))
        grace = min(cap_s, max(floor_s, free, paid))

    `free` is the wait the overlapped inner steps hide (Decoupled DiLoCo: grace <= margin x slack):
    it costs no compute. Blocking outer steps (overlap_steps = 0), or an overlap whose slack the
    quorum and the exchange already use up, hide nothing: every second of grace idles each site that
    arrived, so the window follows how late sites measurably arrive (`paid`), and never costs the
    waiting sites more than the late one's round is worth (its progress is dropped if it is left
    out: past a round's compute time over the sites - 1 that wait, leaving it out is cheaper).
    Nothing measured yet (the first rounds, a site that never proposed): `fallback_s`.
    """
    free = 0.0
    if m.overlap_steps and m.step_s is not None and m.sync_s is not None and m.quorum_s is not None:
        slack = m.overlap_steps * m.step_s - (m.quorum_s + m.sync_s)
        free = rule.slack_margin * max(0.0, slack)
    if m.late_s is None or m.step_s is None:
        if not free:
            return fallback_s
        paid = 0.0
    else:
        paid = min(rule.late_margin * m.late_s, m.steps_per_round * m.step_s / max(1, sites - 1))
    return min(rule.cap_s, max(rule.floor_s, free, paid))


def lateness(seen_at: dict[int, float], quorum_since: float | None, waited_for: set[int], decided_at: float) -> float | None:
    """How long after the quorum the last of `waited_for` arrived (`seen_at`: when each arrival was
    first read). One still missing at the decision counts as late by the whole wait: a lower bound,
    so a window that left an honest site out grows again instead of shrinking with what it saw.
    None: no quorum was seen."""
    if quorum_since is None:
        return None
    return max([0.0] + [seen_at.get(s, decided_at) - quorum_since for s in waited_for])


def ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * sample


class GraceMeter:
    """The measured inputs of `auto_grace` on one site, fed by the membership at each round's
    arrival, decision and commit (monotonic seconds)."""

    def __init__(self, steps_per_round: int, overlap_steps: int) -> None:
        self.steps_per_round, self.overlap_steps = steps_per_round, overlap_steps
        self.step_s: float | None = None
        self.sync_s: float | None = None
        self.quorum_s: float | None = None
        self.late: deque[float] = deque(maxlen=LATE_WINDOW)
        self.trained_since: float | None = None  # the last commit or skip this site trained on from
        self.decided_at: float | None = None

    def arrived(self, now: float) -> None:
        """This site reached a round's boundary: the inner steps since the last one are a sample."""
        if self.trained_since is not None:
            self.step_s = ewma(self.step_s, (now - self.trained_since) / self.steps_per_round)
        self.trained_since = None

    def decided(self, now: float, quorum_s: float | None, late_s: float | None) -> None:
        """A member decision was read; `quorum_s`, `late_s`: what this site saw of its attempt."""
        self.decided_at = now
        if quorum_s is not None:
            self.quorum_s = ewma(self.quorum_s, quorum_s)
        if late_s is not None:
            self.late.append(late_s)

    def committed(self, now: float) -> None:
        """The attempt committed: its exchange is a sample, and the next round's inner steps start."""
        if self.decided_at is not None:
            self.sync_s = ewma(self.sync_s, now - self.decided_at)
        self.restart(now)

    def restart(self, now: float | None) -> None:
        """Inner steps start at `now` (None: this site trains nothing it could time, e.g. left out)."""
        self.trained_since, self.decided_at = now, None

    def measured(self) -> Measured:
        return Measured(self.step_s, self.sync_s, self.quorum_s, max(self.late) if self.late else None,
                        self.steps_per_round, self.overlap_steps)
