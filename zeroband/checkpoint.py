"""Sharded checkpoints that are either complete or absent.

Layout of one checkpoint (one per site; each site has its own directory):

    step_000100/
      dcp/            model + inner optimizer, torch.distributed.checkpoint (sharded, reshardable)
      rank_00000.pt   this rank's own state: data position, RNG, scheduler, outer (DiLoCo) state
      manifest.json   written last: step, model fingerprint, world size, size + sha256 of every file

Saving writes `step_000100.tmp/` and renames it to `step_000100/` only after the manifest is on
disk, so a save killed at any moment leaves the previous checkpoint untouched and loadable.
Saving the same step again first renames the old copy to `step_000100.old/` (the finder accepts
it), so there is no moment without a valid checkpoint. Loading verifies the manifest first.

Every manifest carries the `run_id` of the run that wrote it (new at a fresh start, kept across
resumes). Pruning only ever deletes older checkpoints of the same run, never the one just written.
`checkpoint.resume = "none"` in a directory that holds checkpoints moves them to `old-<run_id>/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from zeroband.faults import maybe_inject

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
ASIDE = ".old"  # the previous copy of a step, while a new copy of the same step is being sealed
_STEP_DIR = re.compile(r"step_(\d+)(\.old)?")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: the message says which and what to do."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def step_dirs(root: Path) -> list[tuple[Path, int]]:
    """Sealed checkpoint directories under root (`step_N` and aside `step_N.old`), newest first;
    for one step the sealed copy comes before its aside copy. `.tmp` saves are never candidates."""
    found = []
    for p in root.glob("step_*"):
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), m.group(2) is None, p))
    return [(p, step) for step, _, p in sorted(found, reverse=True)]


def read_run_id(path: Path) -> str | None:
    """The run id in a checkpoint's manifest; None if it has none (older format) or is unreadable."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extras: dict[str, Stateful],
    meta: dict[str, Any],
    keep_last: int,
    site: int = 0,
) -> Path:
    """Collective over the site group: every rank of the site calls it with the same step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final, tmp = step_dir(root, step), Path(str(step_dir(root, step)) + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    own = {name: obj.state_dict() for name, obj in extras.items()}
    own["rng"] = rng_state()
    torch.save(own, tmp / f"rank_{rank:05d}.pt")
    maybe_inject("checkpoint", step, site, rank)  # a kill here must leave the previous checkpoint usable
    dist.barrier()
    if rank == 0:
        _seal(tmp, final, step, world, meta, site)
        _prune(root, keep_last, meta.get("run_id", ""), step)
    dist.barrier()
    return final


def _seal(tmp: Path, final: Path, step: int, world: int, meta: dict[str, Any], site: int) -> None:
    files = {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world, "time": time.time(), "files": files}
    manifest.update(meta)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    # The same step saved again (e.g. after a resume): move the old copy aside, seal the new one,
    # then drop the aside copy. A crash between the renames leaves step_N.old, which the finder takes.
    aside = Path(str(final) + ASIDE)
    if final.exists() and read_run_id(final) != meta.get("run_id"):  # another run's work: keep it
        log.warning("%s belongs to another run; moved it to %s", final, _into_old(final.parent, [final]))
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # a stale aside copy of a step that is sealed
        os.replace(final, aside)
    maybe_inject("seal", step, site, 0)  # a kill here must leave the aside copy usable
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def prune_victims(entries: list[tuple[Path, int, str | None]], keep_last: int, run_id: str, written: int) -> list[Path]:
    """Which of `entries` (path, step, run id) to delete after `written` was sealed: this run's
    checkpoints older than the `keep_last - 1` newest before `written`. Other runs' checkpoints,
    and steps after `written` (an abandoned future of this run), are left alone."""
    ours = sorted({step for _, step, rid in entries if rid == run_id and step < written}, reverse=True)
    doomed = set(ours[keep_last - 1 :])
    return [path for path, step, rid in entries if rid == run_id and step in doomed]


def _prune(root: Path, keep_last: int, run_id: str, written: int) -> None:
    entries = [(path, step, read_run_id(path)) for path, step in step_dirs(root)]
    for old in prune_victims(entries, keep_last, run_id, written):
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest if every file is present with its recorded size and sha256, else CheckpointError."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; the save did not finish (partial checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(
                f"{path}: {name} has {file.stat().st_size} bytes, manifest says {expected['bytes']} (truncated?)"
            )
        if sha256_file(file) != expected["sha256"]:
            raise CheckpointError(f"{path}: {name} fails its sha256 check (corrupt)")
    return manifest


def find_checkpoint(root: Path, resume: str) -> CheckpointInfo | None:
    """Resolve `checkpoint.resume`: 'none', 'auto' (newest valid under root) or an explicit path."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a directory")
        manifest = verify_checkpoint(path)
        return CheckpointInfo(path, manifest["step"], manifest)
    for path, _ in step_dirs(root):
        try:
            manifest = verify_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping unusable checkpoint: %s", e)
            continue
        return CheckpointInfo(path, manifest["step"], manifest)
    return None


def resume_checkpoint(root: Path, resume: str) -> CheckpointInfo | None:
    """`find_checkpoint` for a training start: auto-resume refuses to silently start from step 0
    when there are checkpoints but none of them verifies (a crash loop would make no progress)."""
    found = find_checkpoint(root, resume)
    if found is None and resume == "auto" and step_dirs(root):
        names = ", ".join(p.name for p, _ in step_dirs(root))
        raise CheckpointError(
            f"no checkpoint under {root} passes verification ({names}; reasons logged above). Fix: restore "
            "a good copy, resume a specific one with --checkpoint.resume PATH, or start fresh with "
            "--checkpoint.resume none (moves these aside)"
        )
    return found


def move_aside(root: Path) -> Path | None:
    """Start-fresh in a directory that holds checkpoints: move them all into `old-<run_id>/` (a new
    name if taken), so the new run neither loads nor prunes them. Returns where they went."""
    if not step_dirs(root):
        return None
    return _into_old(root, sorted(root.glob("step_*")))


def _into_old(root: Path, paths: list[Path]) -> Path:
    """Move `paths` into a new `root/old-<run id of the newest>[-n]/`; returns it."""
    label = next((rid for p, _ in step_dirs(root) if p in paths and (rid := read_run_id(p))), "unknown")
    dest, n = root / f"old-{label}", 1
    while dest.exists():
        dest, n = root / f"old-{label}-{n}", n + 1
    dest.mkdir(parents=True)
    for path in paths:
        os.replace(path, dest / path.name)
    _fsync_dir(root)
    return dest


def check_compatible(info: CheckpointInfo, meta: dict[str, Any], world_size: int) -> None:
    """Refuse a checkpoint of another model shape or batch geometry, saying what differs."""
    theirs, ours = info.manifest.get("model", {}), meta.get("model", {})
    diffs = [f"model.{k}: checkpoint {theirs.get(k)!r} vs config {ours.get(k)!r}" for k in ours if theirs.get(k) != ours.get(k)]
    if diffs:
        raise CheckpointError(
            f"{info.path} was written for a different model ({'; '.join(diffs)}). Fix: use the config it was "
            "trained with, or start fresh with --checkpoint.resume none"
        )
    if info.manifest["world_size"] != world_size:
        raise CheckpointError(
            f"{info.path} was written by {info.manifest['world_size']} ranks per site, this run has {world_size}; "
            "per-rank data positions and outer states need the same rank count. Restart with "
            f"{info.manifest['world_size']} ranks or --checkpoint.resume none"
        )


def load_checkpoint(
    info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extras: dict[str, Stateful]
) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(info.path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    own = torch.load(info.path / f"rank_{dist.get_rank():05d}.pt", weights_only=False)
    for name, obj in extras.items():
        obj.load_state_dict(own[name])
    set_rng_state(own["rng"])
