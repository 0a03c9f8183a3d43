"""Faults injected on a (site, step, point) schedule, for tests and the chaos suite.

    ZEROBAND_FAULTS="site1:step30:allreduce:kill,site0:step20:checkpoint:kill:rank1"

Each entry: site, step (the inner step about to finish, 1-based), point (`inner`, `allreduce`,
`checkpoint`, `seal`: between the two renames that replace a step saved twice), action (`kill` = SIGKILL, `term` = SIGTERM, `stop` = SIGSTOP, `raise`, or `nan`:
the pseudo-gradient sent at that `allreduce` is poisoned with NaN), and
optionally the rank inside the site (default: every rank). Unset, this module does nothing.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "ZEROBAND_FAULTS"
POINTS = ("inner", "allreduce", "checkpoint", "seal")
ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    site: int
    step: int
    point: str
    action: str
    rank: int | None = None


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) not in (4, 5) or not parts[0].startswith("site") or not parts[1].startswith("step"):
            raise ValueError(f"{ENV} entry {entry!r} must look like site<N>:step<N>:<point>:<action>[:rank<N>]")
        point, action = parts[2], parts[3]
        if point not in POINTS or (action not in ACTIONS and action not in ("raise", "nan")):
            raise ValueError(f"{ENV} entry {entry!r}: point must be one of {POINTS}, "
                             f"action one of {[*ACTIONS, 'raise', 'nan']}")
        rank = int(parts[4].removeprefix("rank")) if len(parts) == 5 else None
        faults.append(Fault(int(parts[0][4:]), int(parts[1][4:]), point, action, rank))
    return faults


def _due(point: str, step: int, site: int, rank: int) -> list[Fault]:
    spec = os.environ.get(ENV)
    if not spec:
        return []
    return [f for f in parse_faults(spec) if (f.point, f.step, f.site) == (point, step, site) and f.rank in (None, rank)]


def poison_due(step: int, site: int, rank: int) -> bool:
    """True if the pseudo-gradient of this outer step should be poisoned with NaN."""
    return any(f.action == "nan" for f in _due("allreduce", step, site, rank))


def maybe_inject(point: str, step: int, site: int, rank: int) -> None:
    for f in _due(point, step, site, rank):
        if f.action == "nan":
            continue  # handled where the pseudo-gradient is computed (poison_due)
        if f.action == "raise":
            raise InjectedFault(f"injected fault at site {site} rank {rank} step {step} ({point})")
        os.kill(os.getpid(), ACTIONS[f.action])
