"""Faults injected from the test side on a (site, step, point) schedule, as torchft's tests do.

    site1:step30:allreduce:kill,site0:step20:checkpoint:kill:rank1

Each entry: site, step (the inner step about to finish, 1-based), point, action (`kill` = SIGKILL,
`term` = SIGTERM, `stop` = SIGSTOP, `raise`, `hang`: the calling thread blocks for good while the
process lives on, as a collective waiting on a peer that stopped sending does, or `nan`: the
pseudo-gradient sent at that `allreduce` is poisoned with NaN), and optionally the rank inside the
site (default: every rank).

Production code knows nothing of this: `install` wraps, from outside, the seams the outer loop and
the checkpoint module keep for it (docs: the fault seams in the notes of issue 14):
- `inner`: before `after_inner_step(step)` of any outer class, i.e. once inner step `step + 1` is done;
- `allreduce`: the first cross-site collective (a `GlobalGroup` call) made inside that
  `after_inner_step`, so only at a sync boundary; `nan` poisons `pseudo_gradient()` instead;
- `checkpoint`: inside `checkpoint.save_checkpoint`, once this rank's shards are written and before
  the step is sealed (when the extras' state is read);
- `seal`: inside `checkpoint._seal`, between the two renames that replace a step saved twice.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POINTS = ("inner", "allreduce", "checkpoint", "seal")
ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
OTHER_ACTIONS = ("raise", "hang", "nan")
# Where the outer classes live, before and after the outer/membership split; missing ones are skipped.
OUTER_MODULES = ("zeroband.outer", "zeroband.membership", "zeroband.diloco", "zeroband.elastic",
                 "zeroband.cross_site_dp")
GROUP_MODULES = ("zeroband.comm.group", "zeroband.mesh")
GROUP_CALLS = ("all_reduce", "broadcast", "gather_scalars", "post_scalars")


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
    """The schedule of one process (site, rank) and the state of the step being finished."""

    faults: list[Fault]
    site: int
    rank: int
    step: int | None = None  # inner step being finished, while inside after_inner_step
    armed: int | None = None  # step whose `allreduce` faults fire at the next cross-site call
    boundary: bool = False  # pseudo_gradient was taken in this after_inner_step: a sync boundary
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
            if f.action in ACTIONS:  # nan is applied to the pseudo-gradient, not here
                os.kill(os.getpid(), ACTIONS[f.action])

    def poisons(self) -> bool:
        return any(f.action == "nan" for f in self.due("allreduce", self.step))

    def group_call(self) -> None:
        with self.lock:  # the all-reduce may run on a watched thread: fire once
            step, self.armed = self.armed, None
        if step is not None:
            self.fire("allreduce", step)


_active: Injector | None = None
_originals: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to restore
_depth = threading.local()  # nested after_inner_step calls (a subclass calling super) fire once


def install(spec: str, site: int | None = None, rank: int | None = None) -> Injector:
    """Arm `spec` for this process: site from ZEROBAND_SITE_RANK, rank from RANK unless given.
    Installing again replaces the schedule; the wrappers are put in place once."""
    global _active
    site = int(os.environ.get("ZEROBAND_SITE_RANK", "0")) if site is None else site
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    _active = Injector(parse_faults(spec), site, rank)
    if not _originals:
        _wrap_all()
    return _active


def uninstall() -> None:
    global _active
    _active = None
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _originals.append((owner, name, original))
    setattr(owner, name, make(original))


def _modules(names: tuple[str, ...]) -> Iterator[Any]:
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        yield module
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            try:
                yield importlib.import_module(f"{name}.{info.name}")
            except ImportError:  # an optional dependency (e.g. etcd3gw) this run does not use
                continue


def _classes_with(names: tuple[str, ...], attribute: str) -> list[type]:
    found: dict[int, type] = {}
    for module in _modules(names):
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__.startswith("zeroband.") and attribute in obj.__dict__:
                found[id(obj)] = obj
    return list(found.values())


def _wrap_all() -> None:
    from zeroband import checkpoint

    for cls in _classes_with(OUTER_MODULES, "after_inner_step"):
        _patch(cls, "after_inner_step", _wrap_after_inner_step)
    for name in ("pseudo_gradient", "_pseudo_gradient"):  # the contract name, and the one before the rename
        for cls in _classes_with(OUTER_MODULES, name):
            _patch(cls, name, _wrap_pseudo_gradient)
    for cls in _classes_with(GROUP_MODULES, "all_reduce"):
        for name in GROUP_CALLS:
            if name in cls.__dict__:
                _patch(cls, name, _wrap_group_call)
    _patch(checkpoint, "save_checkpoint", _wrap_save_checkpoint)
    _patch(checkpoint, "_seal", _wrap_seal)


def _wrap_after_inner_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def after_inner_step(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        inj, depth = _active, getattr(_depth, "n", 0)
        if inj is None or depth:
            return original(self, step, *args, **kwargs)
        inj.fire("inner", step + 1)
        inj.step, inj.armed = step + 1, (step + 1 if inj.due("allreduce", step + 1) else None)
        inj.boundary, _depth.n = False, 1
        try:
            return original(self, step, *args, **kwargs)
        finally:
            # An overlapped boundary returns before its all-reduce starts: stay armed for it.
            _depth.n, inj.step = 0, None
            if not inj.boundary:
                inj.armed = None
    return after_inner_step


def _wrap_pseudo_gradient(original: Callable) -> Callable:
    @functools.wraps(original)
    def pseudo_gradient(self: Any, *args: Any, **kwargs: Any) -> Any:
        grads = original(self, *args, **kwargs)
        if _active is not None:
            _active.boundary = True
        if _active is not None and _active.poisons():  # a site whose pseudo-gradient went bad
            grads[0].view(-1)[0] = float("nan")
        return grads
    return pseudo_gradient


def _wrap_group_call(original: Callable) -> Callable:
    @functools.wraps(original)
    def group_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _active is not None:
            _active.group_call()
        return original(self, *args, **kwargs)
    return group_call


class _FireOnRead:
    """An extra whose state is read by save_checkpoint after the shards are written: the fault fires there."""

    def __init__(self, inj: Injector, step: int) -> None:
        self.inj, self.step = inj, step

    def state_dict(self) -> dict[str, Any]:
        self.inj.fire("checkpoint", self.step)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _wrap_save_checkpoint(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        step = bound.arguments["step"]
        if _active is not None and _active.due("checkpoint", step):
            bound.arguments["extras"] = {**bound.arguments["extras"], "injected_fault": _FireOnRead(_active, step)}
        return original(*bound.args, **bound.kwargs)
    return save_checkpoint


class _RenameWatch:
    """`os` as _seal sees it, firing the `seal` fault just before `tmp` is renamed into place."""

    def __init__(self, tmp: Path, fire: Callable[[], None]) -> None:
        self.tmp, self.fire_once = tmp, fire
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def replace(self, src: Any, dst: Any) -> None:
        if Path(src) == self.tmp and not self.fired:
            self.fired = True
            self.fire_once()
        os.replace(src, dst)


def _wrap_seal(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _seal(*args: Any, **kwargs: Any) -> Any:
        from zeroband import checkpoint

        bound = signature.bind(*args, **kwargs)
        step, inj = bound.arguments["step"], _active
        if inj is None or not inj.due("seal", step):
            return original(*args, **kwargs)
        watch = _RenameWatch(Path(bound.arguments["tmp"]), lambda: inj.fire("seal", step))
        checkpoint.os = watch
        try:
            result = original(*args, **kwargs)
        finally:
            checkpoint.os = os
        if not watch.fired:  # _seal no longer renames tmp into place: fail loudly, never silently skip
            inj.fire("seal", step)
        return result
    return _seal
