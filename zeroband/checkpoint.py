"""Sharded checkpoints that are either complete or absent.

Layout of one checkpoint (one per site; each site has its own directory):

    step_000100/
      dcp/            model + inner optimizer, torch.distributed.checkpoint (sharded, reshardable)
      rank_00000.pt   this rank's own state: data position, RNG, scheduler, outer (DiLoCo) state
      manifest.json   written last: step, model fingerprint, world size, size + sha256 of every file,
                      and, when the run has a secret, an HMAC-SHA256 signature of all of that

Loading is code execution unless the author is known: DCP's metadata (and its non-tensor entries)
are pickles, so a checkpoint from a stranger runs whatever its author put in it, and a sha256
manifest proves nothing against whoever wrote the manifest. So before anything is unpickled,
`check_trust` requires a valid signature under the run's secret, or (no secret) that the checkpoint
is unsigned and lies in the run's own checkpoint directory, or the deliberate (and loudly printed)
`checkpoint.allow_unsigned`. A signed checkpoint is never taken for an unsigned one: with no secret
to check it, the load stops (`SecretNeeded`) with one line saying how to supply the secret.
rank_*.pt holds only tensors and plain Python values and is read with weights_only=True, and DCP is
read without its pickles' power too (`dcp_load`): metadata through an unpickler that builds only
DCP's own metadata classes, non-tensor entries with weights_only=True.

Saving writes `step_000100.tmp/` and renames it to `step_000100/` only after the manifest is on
disk, so a save killed at any moment leaves the previous checkpoint untouched and loadable.
Saving the same step again first renames the old copy to `step_000100.old/` (the finder accepts
it), so there is no moment without a valid checkpoint. Loading verifies the manifest first.

A signed manifest names its owner, the run (its name) and the site that saved it (`Owner`), under
the signature: a resume loads only its own run's and site's checkpoints, an export any site's of
its run, so one run's signed checkpoint is not another's (the secret may be shared between runs:
the launcher's launch.secret is). Not the launch (incarnation): a resume is a new launch and
must still load them.

Every manifest carries the `run_id` of the run that wrote it (new at a fresh start, kept across
resumes). Pruning only ever deletes older checkpoints of the same run, never the one just written.
A fresh start moves the previous run's checkpoints aside with its metrics (zeroband/rundir.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem  # noqa: F401  (its _StorageInfo is in the metadata allow-list)
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from zeroband import seams
from zeroband.trust.secret import SECRET_ENV, RunSecret, as_secret

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SIGNATURE = "signature"
OWNER = "owner"
SIGN_LABEL = "zeroband-checkpoint-v1"
ASIDE = ".old"  # the previous copy of a step, while a new copy of the same step is being sealed
_STEP_DIR = re.compile(r"step_(\d+)(\.old)?")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: the message says which and what to do."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Owner:
    """Whose state a checkpoint holds: the run's name and the site that saved it (None: any site of
    the run, for an export: every site holds the same model)."""

    run: str
    site: int | None = None

    def meta(self) -> dict[str, Any]:
        return {OWNER: {"run": self.run, "site": self.site}}


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
    """Every RNG's state as tensors and plain values (what weights_only=True loads)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())  # legacy=True: MT19937's tuple
    state = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    if isinstance(py, tuple):  # written before RNG states were plain values: the raw getstate() tuples
        random.setstate(py)
        np.random.set_state(npy)
    else:
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                             npy["cached"]))
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
    secret: RunSecret | bytes | None = None,
) -> Path:
    """Collective over the site group: every rank of the site calls it with the same step.
    With a `secret`, the manifest is signed with it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final, tmp = step_dir(root, step), Path(str(step_dir(root, step)) + ".tmp")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # every rank decides alike (nothing is written yet): none waits at a barrier for one that refused
    needed = world * state_bytes({"model": model_sd, "optim": optim_sd})
    read_only, free = disk_space(root)
    if problem := storage_problem(root, needed, read_only, free + tree_bytes(tmp)):  # tmp: a killed save's, removed below
        raise CheckpointError(f"cannot save step {step}: {problem}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        own = {name: obj.state_dict() for name, obj in extras.items()}
        own["rng"] = rng_state()
        torch.save(own, tmp / f"rank_{rank:05d}.pt")
    except (OSError, RuntimeError, CheckpointException) as e:  # a disk that filled (or went read-only) meanwhile
        # the estimate is short of what is left to write (rank files, metadata): under FULL_BELOW free is full
        if problem := storage_problem(tmp, max(needed - tree_bytes(tmp), FULL_BELOW), *disk_space(tmp)):
            raise CheckpointError(f"cannot save step {step}: {problem}") from None
        raise e
    dist.barrier()
    if rank == 0:
        _seal(tmp, final, step, world, meta, secret)
        _prune(root, keep_last, meta.get("run_id", ""), step)
    dist.barrier()
    return final


FULL_BELOW = 1 << 20  # bytes: a save that failed with less than this free failed for want of space


def state_bytes(state: Any) -> int:
    """The bytes of the tensors (this rank's shards) in a nested state dict: what a save writes, roughly."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 where there is none). Files and folders may vanish
    during the walk: rank 0 removes a killed save's tmp while the site's other ranks still measure
    it (`save_checkpoint`). What is gone counts 0, and the disk's free space has grown by as much,
    so free + this stays the same for every rank."""
    total = 0
    for folder, _, files in os.walk(path):  # no error for what vanished (onerror=None), unlike rglob
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def disk_space(path: Path) -> tuple[bool, int]:
    """(read-only, bytes free to this user) of the file system that holds `path`, or would."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.statvfs(where)
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserved blocks
    return bool(st.f_flag & os.ST_RDONLY), free * st.f_frsize


def storage_problem(path: Path, needed: int, read_only: bool, free: int) -> str:
    """Why `path` cannot take `needed` more bytes, in one line naming the fix ("": it can). Pure."""
    fix = "Fix: set checkpoint.dir to a disk that"
    if read_only:
        return (f"{path} is on a read-only file system (EROFS); the save needs {needed:,} bytes there. {fix} is "
                "writable, or remount it read-write")
    if free < needed:
        return (f"no space left on the device of {path} (ENOSPC): the save needs {needed:,} bytes, {free:,} are free. "
                f"{fix} has room, or free space (checkpoint.keep_last lower)")
    return ""


def _seal(tmp: Path, final: Path, step: int, world: int, meta: dict[str, Any], secret: RunSecret | bytes | None) -> None:
    files = {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world, "time": time.time(), "files": files}
    manifest.update(meta)
    if secret is not None:
        manifest[SIGNATURE] = {"alg": "hmac-sha256", "mac": manifest_mac(signing_key(secret), manifest)}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    # The same step saved again (e.g. after a resume): move the old copy aside, seal the new one,
    # then drop the aside copy. A crash between the renames leaves step_N.old, which the finder takes.
    replace = seams.current().replace  # os.replace, unless a test places a crash between them
    aside = Path(str(final) + ASIDE)
    if final.exists() and read_run_id(final) != meta.get("run_id"):  # another run's work: keep it
        log.warning("%s belongs to another run; moved it to %s", final, _into_old(final.parent, [final]))
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # a stale aside copy of a step that is sealed
        replace(final, aside)
    replace(tmp, final)
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


def signing_key(secret: RunSecret | bytes) -> bytes:
    """Slow, salted derivation (as for admission): a signed manifest must not make guessing cheap."""
    return as_secret(secret).derive(SIGN_LABEL)


def manifest_mac(key: bytes, manifest: dict[str, Any]) -> str:
    """HMAC-SHA256 over the canonical JSON of everything in the manifest but the signature."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, SIGN_LABEL.encode() + b"|" + canonical, hashlib.sha256).hexdigest()


SUPPLY_SECRET = (f"export {SECRET_ENV}=<the secret it was signed with>, or set sites.secret_file to a file "
                 "(mode 0600) holding it")


class SecretNeeded(CheckpointError):
    """A signed checkpoint and no secret to verify it: the same answer for every checkpoint, so
    auto-resume and export stop at once instead of falling back to another one."""


def check_trust(path: Path, manifest: dict[str, Any], secret: RunSecret | bytes | None, own_root: Path | None,
                allow_unsigned: bool = False, require_signature: bool = False, owner: Owner | None = None) -> None:
    """Refuse (CheckpointError, one line) a checkpoint whose author we cannot vouch for; see the module doc.
    A signature that fails is refused always, and one we hold no secret to check needs allow_unsigned;
    an unsigned checkpoint is refused with a secret set or from elsewhere. `require_signature`: its
    run signed every checkpoint (a multi-site run has a secret), so a missing signature was stripped.
    `owner`: whose a signed checkpoint must be (`check_owner`)."""
    signature = manifest.get(SIGNATURE)
    if secret is not None and signature is not None:
        mac = signature.get("mac", "") if isinstance(signature, dict) else ""
        if not hmac.compare_digest(str(mac), manifest_mac(signing_key(secret), manifest)):
            raise CheckpointError(f"{path}: manifest signature does not verify under the run's secret "
                                  "(tampered, or signed with another secret); refusing to load it")
        if owner is not None:
            check_owner(path, manifest, owner)
        return
    if allow_unsigned:
        return
    if signature is not None or require_signature:  # nothing to check the signature with: never loaded as if unsigned
        what = "is signed" if signature is not None else "belongs to a run that signs its checkpoints (multi-site)"
        raise SecretNeeded(f"{path} {what} and no secret is at hand to verify it. Fix: {SUPPLY_SECRET}; or "
                           "--checkpoint.allow_unsigned true to load it unverified (only if you trust its author)")
    if secret is not None:
        raise CheckpointError(f"{path}: manifest is not signed but the run has a secret; refusing it (loading a "
                              "checkpoint can run its author's code). Fix: --checkpoint.allow_unsigned true if you wrote it")
    if own_root is None or not path.resolve().is_relative_to(own_root.resolve()):
        raise CheckpointError(f"{path}: no secret to verify who wrote it, and it is outside this run's checkpoint "
                              f"directory {own_root}; loading a checkpoint can run its author's code. Fix: "
                              f"{SUPPLY_SECRET}, or --checkpoint.allow_unsigned true if you trust it")


def check_owner(path: Path, manifest: dict[str, Any], owner: Owner) -> None:
    """A signed manifest's owner must be `owner` (its site too, unless `owner.site` is None)."""
    named = manifest.get(OWNER)
    run, site = (named.get("run"), named.get("site")) if isinstance(named, dict) else (None, None)
    if run == owner.run and (owner.site is None or site == owner.site):
        return
    theirs = f"run {run!r} site {site}" if run is not None else "no run (it names no owner)"
    raise CheckpointError(f"{path}: signed for {theirs}, not for run {owner.run!r} site {owner.site}; a checkpoint "
                          "resumes only the run and site that saved it (to start from its weights: `zeroband "
                          "export` it, then model.init_from)")


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
    # A file the (signed) manifest does not cover could still be read (DCP looks for more metadata files).
    extra = sorted({str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - set(manifest["files"]) - {MANIFEST})
    if extra:
        raise CheckpointError(f"{path}: {extra[0]} is not listed in the manifest (added after the save?); refusing it")
    return manifest


def verify_trusted(path: Path, secret: RunSecret | bytes | None, own_root: Path | None, allow_unsigned: bool = False,
                   require_signature: bool = False, owner: Owner | None = None) -> dict[str, Any]:
    """The manifest of a checkpoint that is complete and whose author we trust (check_trust)."""
    manifest = verify_checkpoint(path)
    check_trust(path, manifest, secret, own_root, allow_unsigned, require_signature, owner)
    return manifest


def find_checkpoint(root: Path, resume: str, secret: RunSecret | bytes | None = None, allow_unsigned: bool = False,
                    require_signature: bool = False, owner: Owner | None = None,
                    refused: list[str] | None = None) -> CheckpointInfo | None:
    """Resolve `checkpoint.resume`: 'none', 'auto' (newest valid under root) or an explicit path.
    Only checkpoints that pass `check_trust` (root being the run's own directory) are returned;
    why each newer one did not is logged and appended to `refused`, for the caller's one line."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume!r} is not a directory")
        manifest = verify_trusted(path, secret, root, allow_unsigned, require_signature, owner)
        return CheckpointInfo(path, manifest["step"], manifest)
    for path, _ in step_dirs(root):
        try:
            manifest = verify_trusted(path, secret, root, allow_unsigned, require_signature, owner)
        except SecretNeeded:
            raise  # every signed checkpoint would fail alike: falling back to an older one hides why
        except CheckpointError as e:
            log.warning("skipping unusable checkpoint: %s", e)
            if refused is not None:
                refused.append(str(e))
            continue
        return CheckpointInfo(path, manifest["step"], manifest)
    return None


def resume_checkpoint(root: Path, resume: str, secret: RunSecret | bytes | None = None,
                      allow_unsigned: bool = False, owner: Owner | None = None) -> CheckpointInfo | None:
    """`find_checkpoint` for a training start: auto-resume refuses to silently start from step 0
    when there are checkpoints but none of them verifies (a crash loop would make no progress)."""
    refused: list[str] = []
    found = find_checkpoint(root, resume, secret, allow_unsigned, owner=owner, refused=refused)
    if found is None and refused:  # checkpoints, and none verifies (auto: explicit ones raise)
        names = ", ".join(p.name for p, _ in step_dirs(root))
        raise CheckpointError(
            f"no checkpoint under {root} passes verification ({names}; the newest: {refused[0]}). Fix: restore "
            "a good copy, resume a specific one with --checkpoint.resume PATH, or start fresh with "
            "--checkpoint.resume none (moves these aside)"
        )
    return found


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


def check_compatible(info: CheckpointInfo, meta: dict[str, Any], world_size: int, reshardable: bool = False) -> None:
    """Refuse a checkpoint of another model shape or batch geometry, saying what differs.
    `reshardable`: the run can take another rank count's per-rank state (`load_checkpoint`'s `reshard`)."""
    theirs, ours = info.manifest.get("model", {}), meta.get("model", {})
    diffs = [f"model.{k}: checkpoint {theirs.get(k)!r} vs config {ours.get(k)!r}" for k in ours if theirs.get(k) != ours.get(k)]
    if diffs:
        raise CheckpointError(
            f"{info.path} was written for a different model ({'; '.join(diffs)}). Fix: use the config it was "
            "trained with, or start fresh with --checkpoint.resume none"
        )
    if info.manifest["world_size"] != world_size and not reshardable:
        raise CheckpointError(
            f"{info.path} was written by {info.manifest['world_size']} ranks per site, this run has {world_size}; "
            "per-rank data positions and outer states need the same rank count. Restart with "
            f"{info.manifest['world_size']} ranks or --checkpoint.resume none"
        )


# DCP metadata is made of these, DCP's own metadata classes and torch dtypes; nothing else may be
# built while reading it. Every allowed (module, name) is decided from names alone, before anything
# is imported or even looked up: a name outside the list never reaches pickle's import machinery
# (importing a torch.* module can itself run code, e.g. a module that acts on being imported).
_METADATA_GLOBALS = frozenset(
    {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "PurePosixPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    | {(dcp_metadata.__name__, name) for name, value in vars(dcp_metadata).items()
       if isinstance(value, type) and value.__module__ == dcp_metadata.__name__}
)


def metadata_global_allowed(module: str, name: str) -> bool:
    """Whether DCP metadata may refer to `module.name`: an exact pair of the allow-list (pure)."""
    return (module, name) in _METADATA_GLOBALS


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not metadata_global_allowed(module, name):  # checked before any import or attribute lookup
            raise CheckpointError(f"DCP metadata refers to {module}.{name}, which checkpoint metadata never "
                                  "holds; refusing to unpickle it (crafted checkpoint?)")
        return getattr(sys.modules[module], name)  # every allowed module is imported by this file's imports


class _DataOnlyReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata unpickling can only build DCP metadata objects."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.path}: DCP metadata is not a Metadata object")
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # absent in older metadata
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata


class _DataOnlyPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyper-parameters) read with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with weights_only=True instead of False
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            raise CheckpointError(f"DCP entry {fqn!r} {_not_plain_data(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _not_plain_data(e: Exception) -> str:
    """`holds more than tensors and plain values; refusing it (why)`: torch.load's reason, in one line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    why = next((line for line in lines if "Unsupported" in line), lines[0] if lines else type(e).__name__)
    return f"holds more than tensors and plain values; refusing it ({why.split(' was not')[0]})"


def _first_failure(e: CheckpointException, path: Path) -> CheckpointError:
    """DCP gathers every rank's exception (with its traceback) into one: keep the first as one line."""
    exc = next(iter(e.failures.values()))[0] if e.failures else e
    if isinstance(exc, CheckpointError):
        return CheckpointError(f"{path}: {exc}")
    first = (str(exc).strip().splitlines() or [""])[0]
    return CheckpointError(f"{path}: DCP could not read it ({type(exc).__name__}: {first})")


def _rank_state(rank_file: Path) -> dict[str, Any]:
    try:  # numpy arrays: the RNG state of checkpoints written before it was stored as tensors
        with torch.serialization.safe_globals(_NUMPY_ARRAYS):
            return torch.load(rank_file, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{rank_file} {_not_plain_data(e)}") from None


def dcp_load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """dcp.load without pickle's power (see the module doc); whatever fails is one CheckpointError line."""
    with open(path / ".metadata", "rb") as f:  # checked here too: inside dcp.load the error loses its message
        try:
            _MetadataUnpickler(f).load()
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except Exception as e:  # truncated or garbled: whatever pickle says, one line
            raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e}); refusing it") from None
    try:
        dcp.load(state, storage_reader=_DataOnlyReader(str(path)), planner=_DataOnlyPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        raise _first_failure(e, path) from None


# numpy's array reconstruction builds plain arrays only (object arrays would need other globals).
_NUMPY_ARRAYS = [np._core.multiarray._reconstruct,  # type: ignore[attr-defined]  # private: numpy's stub leaves it out
                 np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint(
    info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extras: dict[str, Stateful],
    reshard: Callable[[str, list[Any]], Any] | None = None,
) -> None:
    """DCP reshards the model and inner optimizer by itself. The per-rank files of a checkpoint written
    by another rank count go through `reshard(name, [every saved rank's state of name])` (sites of
    different shapes whose shape changed: check_compatible(reshardable=True))."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, info.path / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved, rank = info.manifest["world_size"], dist.get_rank()
    if saved == dist.get_world_size() or reshard is None:
        own = _rank_state(info.path / f"rank_{rank:05d}.pt")
    else:
        states = [_rank_state(info.path / f"rank_{r:05d}.pt") for r in range(saved)]
        own = {name: reshard(name, [s[name] for s in states]) for name in states[0] if name != "rng"}
        own["rng"] = states[min(rank, saved - 1)]["rng"]
    for name, obj in extras.items():
        obj.load_state_dict(own[name])
    set_rng_state(own["rng"])
