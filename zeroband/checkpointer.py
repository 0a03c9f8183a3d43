"""When a site saves, and what: the one place for the save policy.

The loop calls `checkpointer.maybe_save(step, last)` after every step, `maybe_save(step, last,
stopping=True)` when it leaves on SIGTERM, and `maybe_save(step, last=True)` once after the loop
(a site that joined at the very last boundary trained no step and is saved there). `should_save`
is the pure rule; `save` writes through `zeroband.checkpoint.save_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zeroband import checkpoint as ckpt
from zeroband.config import CheckpointConfig, Config
from zeroband.trust.secret import RunSecret


def should_save(cfg: CheckpointConfig, step: int, last: bool, stopping: bool = False,
                saved_at: int | None = None) -> bool:
    """Save at every `interval` steps, at the end with `save_at_end`, always when stopping early;
    never the same step twice (`saved_at`: the step saved last in this process)."""
    if saved_at == step:
        return False
    if stopping:
        return True
    if last:
        return cfg.save_at_end
    return bool(cfg.interval) and step % cfg.interval == 0


def sync_due(cfg: CheckpointConfig, step: int, total_steps: int) -> bool:
    """An outer step must be blocking here (all sites bitwise identical): a checkpoint or the end."""
    return should_save(cfg, step, False) or step == total_steps


def checkpoint_meta(cfg: Config) -> dict[str, Any]:
    """What a manifest says about the run: the model shape, and the whole resolved config (the
    secret is never part of a dump), which a resume compares with its own (resume_rules.py)."""
    return {"model": cfg.model.model_dump(exclude={"init_from", "preset"}), "fingerprint": cfg.fingerprint(),
            "config": cfg.model_dump(mode="json")}


def signs_every_checkpoint(cfg: Config) -> bool:
    """A multi-site run cannot start without a secret unless sites.insecure, so all its checkpoints
    are signed: an unsigned one was stripped (site_count unset: launched sites, several)."""
    return cfg.diloco is not None and not cfg.sites.insecure and cfg.sites.site_count != 1


class Checkpointer:
    def __init__(self, cfg: Config, root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 stateful: dict[str, ckpt.Stateful], secret: RunSecret | None = None, site: int = 0) -> None:
        self.cfg, self.root, self.model, self.optimizer, self.stateful = cfg, root, model, optimizer, stateful
        self.secret = secret  # the run's, resolved once at start (trust/secret.py): signs every checkpoint
        self.owner = ckpt.Owner(cfg.name, site)  # named in every manifest, under the signature
        self.run_id = ""
        self.saved_at: int | None = None

    def maybe_save(self, step: int, last: bool, stopping: bool = False) -> bool:
        if not should_save(self.cfg.checkpoint, step, last, stopping, self.saved_at):
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        ckpt.save_checkpoint(self.root, step, self.model, self.optimizer, self.stateful,
                             {**checkpoint_meta(self.cfg), "run_id": self.run_id, **self.owner.meta()},
                             self.cfg.checkpoint.keep_last,
                             secret=self.secret)
        self.saved_at = step
