"""Faults injected from the test side on a (site, step, point) schedule, as torchft's tests do.

    site1:step30:allreduce:kill,site0:step20:checkpoint:kill:rank1

Each entry: site, step (the inner step about to finish, 1-based), point, action (`kill` = SIGKILL,
`term` = SIGTERM, `stop` = SIGSTOP, `raise`, `hang`: the calling thread blocks for good while the
process lives on, as a collective waiting on a peer that stopped sending does, or `nan`: the
pseudo-gradient sent at that `allreduce` is poisoned with NaN, or `late`: the calling thread sleeps
LATE_S while the process and its heartbeats go on, so an elastic round's grace window passes without
the site), and optionally the rank inside the site (default: every rank).

Production code knows nothing of this: `install` builds wrappers for the seams every run is built
through (zeroband/seams.py), as torchft's FakeProcessGroupWrapper wraps a process group, and the
trainer calls the same public interfaces on them:
- `inner`: the outer method's `after_inner_step(step)` (`FaultyOuter`), before it runs;
- `allreduce`: the first call on a cross-site process group (`FaultyPG`: send, recv, all-reduce,
  broadcast) after that `after_inner_step` began, so only at a sync boundary (an overlapped
  boundary's all-reduce starts after the call returns: the fault waits for it); `nan` makes
  this site's pseudo-gradient NaN instead: one value of the local model is NaN while the outer
  step takes pseudo-gradient = outer copy - local model (it is put back if no round ended);
- `pieces`: in the middle of that all-reduce: at this site's first all-gather send (comm/direct.py),
  when it has sent its reduce-scatter pieces, received its peers' and agreed on the review, so its
  peers wait on the pieces it never sends (a wait bounded by the measured link, comm/link.py);
- `checkpoint`: inside the save (`FaultyCheckpointer`), once this rank's shards are written and
  before the step is sealed (when the extras' state is read);
- `seal`: at the rename that seals the step (`seams.replace`), after a copy saved earlier of the
  same step was moved aside: between the two renames.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeroband import seams
from zeroband.checkpoint import step_dir
from zeroband.comm.group import AG_TAG, STATS_TAG

POINTS = ("inner", "allreduce", "pieces", "checkpoint", "seal")
ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
OTHER_ACTIONS = ("raise", "hang", "nan", "late")
LATE_S = 5.0  # `late`: 5x the tests' elastic grace_s (1 s), room for a loaded machine


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
            raise ValueError(f"fault {entry!r} must look like site<N>:step<N>:<point>:<action>[:rank<N>]")
        point, action = parts[2], parts[3]
        if point not in POINTS or (action not in ACTIONS and action not in OTHER_ACTIONS):
            raise ValueError(f"fault {entry!r}: point must be one of {POINTS}, "
                             f"action one of {[*ACTIONS, *OTHER_ACTIONS]}")
        rank = int(parts[4].removeprefix("rank")) if len(parts) == 5 else None
        faults.append(Fault(int(parts[0][4:]), int(parts[1][4:]), point, action, rank))
    return faults


@dataclass
class Injector:
    """The schedule of one process (site, rank), and the step whose `allreduce` faults are armed."""

    faults: list[Fault]
    site: int
    rank: int
    armed: int | None = None  # step whose `allreduce` faults fire at the next cross-site call
    armed_pieces: int | None = None  # step whose `pieces` faults fire at the next all-gather send
    lock: threading.Lock = field(default_factory=threading.Lock)

    def due(self, point: str, step: int | None) -> list[Fault]:
        return [f for f in self.faults if (f.point, f.step, f.site) == (point, step, self.site)
                and f.rank in (None, self.rank)]

    def fire(self, point: str, step: int | None) -> None:
        for f in self.due(point, step):
            if f.action == "raise":
                raise InjectedFault(f"injected fault at site {self.site} rank {self.rank} step {step} ({point})")
            if f.action == "hang":
                threading.Event().wait()  # a watched thread: the watcher abandons it, the process goes on
            if f.action == "late":
                time.sleep(LATE_S)
            if f.action in ACTIONS:  # nan is applied to the pseudo-gradient, not here
                # To this thread, not the process: a process-wide signal is taken by the main thread
                # (then the process stops); under CPU load that takes ms, while this thread (a watched
                # exchange) sent the very message the fault must withhold, and the peers went on.
                signal.pthread_kill(threading.get_ident(), ACTIONS[f.action])

    def poisons(self, step: int) -> bool:
        return any(f.action == "nan" for f in self.due("allreduce", step))

    def group_call(self) -> None:
        with self.lock:  # the all-reduce may run on a watched thread: fire once
            step, self.armed = self.armed, None
        if step is not None:
            self.fire("allreduce", step)

    def piece_send(self, tag: int) -> None:
        if not AG_TAG <= tag < STATS_TAG:
            return
        with self.lock:
            step, self.armed_pieces = self.armed_pieces, None
        if step is not None:
            self.fire("pieces", step)

    def replace(self, src: Any, dst: Any) -> None:
        """`os.replace`, firing a `seal` fault just before the step's new copy is renamed into place."""
        dst = Path(dst)
        for f in self.due_anywhere("seal"):
            if dst == step_dir(dst.parent, f.step) and Path(src) != dst:
                self.fire("seal", f.step)
        os.replace(src, dst)

    def due_anywhere(self, point: str) -> list[Fault]:
        return [f for f in self.faults if (f.point, f.site) == (point, self.site) and f.rank in (None, self.rank)]

    def seams(self) -> seams.Seams:
        return seams.Seams(pg=lambda pg, rank: FaultyPG(pg, self), outer=lambda outer, model: FaultyOuter(outer, model, self),
                           checkpointer=lambda saver: FaultyCheckpointer(saver, self), replace=self.replace)


class Wrapper:
    """Everything but what a subclass defines goes to the wrapped object, writes included."""

    def __init__(self, inner: Any, inj: Injector) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "inj", inj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)


class FaultyPG(Wrapper):
    """A cross-site process group whose calls fire an armed `allreduce` fault first."""

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        self.inj.group_call()
        return self.inner.allreduce(*args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        self.inj.group_call()
        return self.inner.broadcast(*args, **kwargs)

    def send(self, tensors: Any, dst: int, tag: int) -> Any:
        self.inj.group_call()
        self.inj.piece_send(tag)
        return self.inner.send(tensors, dst, tag)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        self.inj.group_call()
        return self.inner.recv(*args, **kwargs)


class FaultyOuter(Wrapper):
    """The outer method; `inner` faults fire before a step is handed to it, `allreduce` ones are armed."""

    def __init__(self, inner: Any, model: torch.nn.Module, inj: Injector) -> None:
        super().__init__(inner, inj)
        object.__setattr__(self, "model", model)

    def after_inner_step(self, step: int, sync_point: bool = False) -> Any:
        done = step  # the inner steps done, 1-based
        self.inj.fire("inner", done)
        self.inj.armed = done if self.inj.due("allreduce", done) else None
        self.inj.armed_pieces = done if self.inj.due("pieces", done) else self.inj.armed_pieces
        rounds = self._rounds()
        with _poisoned(self.model, self.inj.poisons(done)) as poison:
            try:
                return self.inner.after_inner_step(step, sync_point=sync_point)
            finally:
                ended = rounds is not None and self._rounds() != rounds
                poison.keep = ended  # no round took the pseudo-gradient: the model is put back
                if not ended:  # an overlapped boundary's all-reduce starts after this: stay armed for it
                    self.inj.armed = None

    def _rounds(self) -> int | None:
        """Outer rounds this site has ended (DiLoCo's round clock); None for a method without rounds."""
        clock = getattr(self.inner, "clock", None)
        return None if clock is None else clock.rounds


class _poisoned:
    """One value of the model's first local tensor is NaN inside (if `on`): the pseudo-gradient
    (outer copy - local model) sent from it is NaN there; put back on the way out unless `keep`."""

    def __init__(self, model: torch.nn.Module, on: bool) -> None:
        data = next(model.parameters()).data if on else None
        self.value = None if data is None else (data.to_local() if hasattr(data, "to_local") else data).view(-1)
        self.keep = False
        self.before: float | None = None  # the value the NaN replaced (set on entry)

    def __enter__(self) -> _poisoned:
        if self.value is not None:
            self.before = self.value[0].item()
            with torch.no_grad():
                self.value[0] = float("nan")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.value is not None and self.before is not None and not self.keep and self.value[0].isnan():
            with torch.no_grad():
                self.value[0] = self.before


class _FireOnRead:
    """An extra whose state is read by the save after the shards are written: the fault fires there."""

    def __init__(self, inj: Injector, step: int) -> None:
        self.inj, self.step = inj, step

    def state_dict(self) -> dict[str, Any]:
        self.inj.fire("checkpoint", self.step)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FaultyCheckpointer(Wrapper):
    """The save policy's object; a `checkpoint` fault of the step saved fires inside its save."""

    def maybe_save(self, step: int, last: bool, stopping: bool = False) -> bool:
        if not self.inj.due("checkpoint", step):
            return self.inner.maybe_save(step, last, stopping)
        self.inner.stateful["injected_fault"] = _FireOnRead(self.inj, step)
        try:
            return self.inner.maybe_save(step, last, stopping)
        finally:
            self.inner.stateful.pop("injected_fault", None)


_active: Injector | None = None


def install(spec: str, site: int | None = None, rank: int | None = None) -> Injector:
    """Arm `spec` for this process: site from ZEROBAND_SITE_RANK, rank from RANK unless given. Runs
    and groups built from now on go through its wrappers; installing again replaces the schedule."""
    global _active
    site = int(os.environ.get("ZEROBAND_SITE_RANK", "0")) if site is None else site
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    _active = Injector(parse_faults(spec), site, rank)
    seams.use(_active.seams())
    return _active


def uninstall() -> None:
    """Runs built from now on are plain again."""
    global _active
    _active = None
    seams.use(None)
