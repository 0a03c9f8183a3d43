"""Who this process is: its rank inside its site, its site among the sites, and its device.

Sources, in order: the config's `[diloco]` section, then the environment
(`ZEROBAND_SITE_RANK`, `ZEROBAND_SITE_COUNT`), then a single site of one rank. Inside a site the
ranks come from torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`); a plain `python -m` run is rank 0 of 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import overload

import torch

from zeroband.config import Config, ConfigError


@dataclass(frozen=True)
class World:
    rank: int  # rank inside the site (the FSDP rank)
    ranks_per_site: int  # torchrun's WORLD_SIZE: one site is one torchrun job
    local_rank: int  # rank on this node (picks the GPU)
    site_rank: int
    site_count: int
    device: torch.device

    @property
    def backend(self) -> str:
        """Backend of the site group; it follows the device."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def dp_rank(self) -> int:
        """Position among every data-parallel reader of every site: decides which documents we read."""
        return self.site_rank * self.ranks_per_site + self.rank

    @property
    def dp_size(self) -> int:
        return self.site_count * self.ranks_per_site


@overload
def _env_int(name: str, default: int) -> int: ...
@overload
def _env_int(name: str, default: None) -> int | None: ...
def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer") from None


def resolve_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is visible; use train.device='cpu' or 'auto'")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def check_devices(cfg: Config, cuda: bool | None = None) -> None:
    """Refuse settings that need CUDA on a machine without it, before any process starts or waits:
    otherwise this site crashes while the others wait for it."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cuda:
        return
    if cfg.diloco is not None and cfg.sites.backend == "nccl":
        raise ConfigError("sites.backend='nccl' needs CUDA, and no CUDA device is visible here; "
                          "use --sites.backend gloo on CPU machines")
    if cfg.train.device == "cuda":
        raise ConfigError("train.device='cuda' but no CUDA device is visible; use train.device='cpu' or 'auto'")


def world_from_env(cfg: Config) -> World:
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    site_rank, site_count = 0, 1
    if cfg.diloco is not None:
        named_rank = cfg.sites.site_rank if cfg.sites.site_rank is not None else _env_int("ZEROBAND_SITE_RANK", None)
        named_count = (
            cfg.sites.site_count if cfg.sites.site_count is not None else _env_int("ZEROBAND_SITE_COUNT", None)
        )
        if named_rank is None or named_count is None:
            raise ConfigError(
                "a [diloco] run needs the site identity: set sites.site_rank and sites.site_count "
                "(e.g. --sites.site_rank 0 --sites.site_count 2) or ZEROBAND_SITE_RANK / ZEROBAND_SITE_COUNT"
            )
        site_rank, site_count = named_rank, named_count
        if not 0 <= site_rank < site_count:
            raise ConfigError(f"site rank {site_rank} must be in [0, site count {site_count})")
    cfg.check_world(world_size)
    return World(rank, world_size, local_rank, site_rank, site_count, resolve_device(cfg.train.device, local_rank))
