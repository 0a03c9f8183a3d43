"""A run directory's owner and its history.

Each site owns one run directory (`runs/<name>/` for one site, `runs/<name>/site<k>/` for a DiLoCo
site: the sites of one run write beside each other, never into each other's) and one checkpoint
directory. While a site runs, its rank 0 holds an exclusive `flock` on `run.lock` in its run
directory, so a second run with the same name (or the same site of it) stops at once, naming the
process that holds it, instead of interleaving metrics and checkpoints with it. The lock dies with
its process (kill -9 included); the file stays and says who held it last.

A fresh start (nothing resumed) deletes nothing of the previous run: its metrics, config, loss
plot and checkpoints move together into `<run dir>/old-<UTC time>/` (checkpoints under
`checkpoints/` there), and only the newest `checkpoint.keep_old` such folders are kept.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zeroband.config import ConfigError

log = logging.getLogger(__name__)

LOCK = "run.lock"
RECORDS = ("metrics.jsonl", "config.toml", "loss.png")  # what a run writes into its run directory
_OLD = re.compile(r"old-(\d{8}-\d{6})(?:-(\d+))?")  # folders of retired runs (older `old-<run_id>` ones are not ours)


class RunDirBusy(ConfigError):
    """Another live process owns this run directory; the fix is another name, or waiting."""


def own_command() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return " ".join([sys.executable, *sys.argv])


def busy_message(run_dir: Path, holder: str) -> str:
    pid, _, command = holder.partition("\n")
    command = command.strip()
    who = f"PID {pid.strip() or '?'}" + (f" ({command[:300]})" if command else "")
    return (f"{run_dir} is in use by another run: {who}. Fix: wait for it to finish or stop it, or give this "
            "run another name (--name ...)")


@contextmanager
def run_dir_lock(run_dir: Path, owner: bool) -> Iterator[None]:
    """Hold `run_dir/run.lock` for the body when `owner` (the site's rank 0); RunDirBusy at once
    if another process holds it."""
    if not owner:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(busy_message(run_dir, os.pread(fd, 4096, 0).decode(errors="replace"))) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{own_command()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def old_victims(names: list[str], keep_old: int) -> list[str]:
    """Which retired-run folders to delete: every `old-<time>[-n]` folder but the `keep_old` newest;
    any other name (an `old-<run_id>` of an older version, say) is left alone."""
    ours = sorted((m.group(1), int(m.group(2) or 0), n) for n in names if (m := _OLD.fullmatch(n)))
    return [n for *_, n in ours[: max(len(ours) - keep_old, 0)]]


def _new_old_dir(run_dir: Path, now: float) -> Path:
    """A new `old-<time>` folder that sorts after every existing one of the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    taken = [int(m.group(2) or 0) for p in run_dir.glob(f"old-{stamp}*") if (m := _OLD.fullmatch(p.name))]
    dest = run_dir / (f"old-{stamp}-{max(taken) + 1}" if taken else f"old-{stamp}")
    dest.mkdir(parents=True)
    return dest


def _same_device(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def retire_previous_run(run_dir: Path, ckpt_root: Path, keep_old: int, now: float | None = None) -> Path | None:
    """Move the previous run's records and checkpoints into a new `run_dir/old-<time>/` and prune
    those folders to `keep_old`; returns the folder (None: nothing to move). A checkpoint directory
    on another filesystem keeps its checkpoints in its own `old-<time>/` (a rename cannot cross it)."""
    records = [run_dir / name for name in RECORDS if (run_dir / name).is_file()]
    steps = sorted(ckpt_root.glob("step_*")) if ckpt_root.is_dir() else []
    if not records and not steps:
        return None
    dest = _new_old_dir(run_dir, time.time() if now is None else now)
    for path in records:
        os.replace(path, dest / path.name)
    if steps:
        into = dest / "checkpoints" if _same_device(ckpt_root, run_dir) else ckpt_root / dest.name
        into.mkdir(parents=True)
        for path in steps:
            os.replace(path, into / path.name)
    removed = prune_old(run_dir, ckpt_root, keep_old)
    moved = [p.name for p in records] + [f"{len(steps)} checkpoint{'s' * (len(steps) != 1)}"] * bool(steps)
    log.warning("fresh start: moved the previous run (%s) to %s/%s", ", ".join(moved), dest,
                f"; deleted {', '.join(removed)} (checkpoint.keep_old = {keep_old})" if removed else "")
    return dest


def prune_old(run_dir: Path, ckpt_root: Path, keep_old: int) -> list[str]:
    """Delete the retired-run folders `old_victims` names (and their checkpoints kept beside them)."""
    victims = old_victims([p.name for p in run_dir.iterdir() if p.is_dir()], keep_old)
    for name in victims:
        for path in (run_dir / name, ckpt_root / name):
            try:
                shutil.rmtree(path)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    log.warning("could not delete %s: %s", path, e)
    return victims
