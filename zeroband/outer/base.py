"""What every outer method shares: the `Outer` protocol the loop talks to, the statistics of an
outer step, the round clock, and `NoOuter`.

The loop (zeroband/train.py) calls, and nothing else: `start(resumed)` once before the first
step; `sync_gradients()` between backward and the inner optimizer step; `after_inner_step(step,
sync_point)` after every inner step, `step` being the inner steps done (1-based) (an outer step
when a round ends; `sync_point` asks for a blocking one, after which every site holds the same
bits); `finished(step, total_steps)`; `leave()` once on the way out; `attach(sink)` for structured
events; `state_dict` / `load_state_dict` for checkpoints. Nothing below the loop writes the loop's
own state (progress, schedule).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from zeroband.config import DilocoConfig


@dataclass
class OuterStats:
    outer_step: int
    allreduce_s: float  # time the main thread waited for communication
    outer_step_s: float  # whole outer step on the main thread, communication included
    payload_bytes: int  # bytes this rank put into the all-reduce
    wire_bytes: int  # bytes this rank sent (what the all-reduce reports; 2(S-1)/S x payload for a dense ring)
    pseudo_grad_norm: float  # this site's, before averaging
    avg_pseudo_grad_norm: float  # of the averaged pseudo-gradient
    outer_lr: float
    sites_used: int
    excluded_sites: list[int] = field(default_factory=list)
    overlapped: bool = False
    outer_crc: int | None = None  # 48 bits of the keyed digest of this rank's outer state (diloco.log_checksum)
    wait_bound_s: float = 0.0  # longest link-derived bound of the round's cross-site waits (comm/link.py; 0: none)
    # seconds per part of the step on the main thread (d2h, pseudo_grad, stats, encode, mac,
    # network_wait, decode, review, optimizer, h2d; zeroband/comm/timing.py)
    timings: dict[str, float] = field(default_factory=dict)
    fragments: list[int] = field(default_factory=list)  # which fragments stepped (diloco.fragments > 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Outer(Protocol):
    def start(self, resumed: bool = False) -> None: ...

    def leave(self) -> None: ...

    def sync_gradients(self) -> None: ...

    def after_inner_step(self, step: int, sync_point: bool = False) -> OuterStats | None: ...

    def finished(self, step: int, total_steps: int) -> bool: ...

    def run_step(self, step: int) -> int: ...

    def attach(self, sink: Callable[[dict[str, Any]], None]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoOuter:
    """No outer loop: a plain one-site run."""

    def attach(self, sink: Callable[[dict[str, Any]], None]) -> None:
        pass

    def start(self, resumed: bool = False) -> None:
        pass

    def leave(self) -> None:
        pass

    def sync_gradients(self) -> None:
        pass

    def after_inner_step(self, step: int, sync_point: bool = False) -> OuterStats | None:
        return None

    def finished(self, step: int, total_steps: int) -> bool:
        return step >= total_steps

    def run_step(self, step: int) -> int:
        return step

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class RoundClock:
    """When an outer step is due: every `inner_steps` steps, or (time budget) every `round_seconds`.

    With a time budget the sites' own clocks decide, each site running as many inner steps as
    fit, and the run ends after train.steps // inner_steps rounds instead of after train.steps.
    `offset` (fragments, zeroband/outer/fragments.py): rounds end at steps = offset mod inner_steps.
    """

    def __init__(self, cfg: DilocoConfig, tokens_per_step: int, offset: int = 0) -> None:
        self.cfg, self.tokens_per_step, self.offset = cfg, tokens_per_step, offset
        self.rounds, self.steps_in_round, self.round_start = 0, 0, time.monotonic()
        # With a time budget: whether the boundary at a run step must be blocking (a checkpoint or the
        # run's last round; train.build_outer sets it). The loop's sync point reads the site's own
        # steps, which part under a budget: an overlapped round every site must agree on reads this.
        self.sync_at: Callable[[int], bool] = lambda run_step: False

    def due(self, step: int) -> bool:
        """Whether inner step `step` (1-based: the steps done) ends a round (nothing counted)."""
        if self.cfg.round_seconds:
            return time.monotonic() - self.round_start >= self.budget()
        return (step - self.offset) % self.cfg.inner_steps == 0

    def budget(self) -> float:
        """This round's seconds under a time budget: round_seconds, but a fragment's first round ends
        at its phase (offset / inner_steps of a round, as its rounds of steps do), so the fragments'
        boundaries keep falling round_seconds / fragments apart."""
        phase = (self.offset or self.cfg.inner_steps) / self.cfg.inner_steps
        return self.cfg.round_seconds * (phase if self.rounds == 0 else 1.0)

    def tick(self, step: int, force: bool = False, decided: bool | None = None) -> bool:
        """Count inner step `step`; True if it ends a round (`force`: it does, whatever the clock says;
        `decided`: the caller read the clock already, and that reading stands)."""
        self.steps_in_round += 1
        due = force or (self.due(step) if decided is None else decided)
        if due:
            self.rounds += 1
        return due

    def restart(self) -> None:
        """The current round's time budget starts now (not when the clock was built: a site's setup
        before the sites meet is no part of its first round)."""
        self.round_start = time.monotonic()

    def take_tokens(self) -> float:
        tokens = self.steps_in_round * self.tokens_per_step
        self.steps_in_round, self.round_start = 0, time.monotonic()
        return float(tokens)

    def finished(self, step: int, total_steps: int, rounds_done: int | None = None) -> bool:
        """The one rule for when a run ends: after train.steps inner steps, or with a time budget
        after train.steps // inner_steps rounds (`rounds_done`: the run's, when a membership keeps
        the shared count; this site's own otherwise)."""
        if self.cfg.round_seconds:
            done = self.rounds if rounds_done is None else rounds_done
            return done >= total_steps // self.cfg.inner_steps
        return step >= total_steps

    def run_step(self, step: int, rounds_done: int | None = None) -> int:
        """Where the run stands after this site's `step` inner steps, in inner steps: what the lr
        schedule follows and checkpoints are named by. `step` itself with rounds of inner_steps
        steps. With a time budget the sites' own step counts part (a slower site runs fewer steps a
        round), so the run step is the run's rounds x inner_steps, plus this round's steps up to
        inner_steps - 1: every site is at the same run step at each boundary, and only there on a
        multiple of inner_steps. `rounds_done` as for `finished`."""
        if not self.cfg.round_seconds:
            return step
        done = self.rounds if rounds_done is None else rounds_done
        return done * self.cfg.inner_steps + min(self.steps_in_round, self.cfg.inner_steps - 1)

    def blocks(self, rounds_done: int | None = None) -> bool:
        """Under a time budget, whether the boundary just reached (the round counted) is a sync point."""
        done = self.rounds if rounds_done is None else rounds_done
        return self.sync_at(done * self.cfg.inner_steps)

    def state_dict(self) -> dict[str, int]:
        return {"rounds": self.rounds, "steps_in_round": self.steps_in_round}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # a fragment saved mid-round (zeroband/outer/fragments.py) keeps the steps its round counted
        self.rounds, self.steps_in_round = state["rounds"], state.get("steps_in_round", 0)
