"""The settings every site of a run must share, as flat `key -> value` (a mismatch names the key)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from zeroband.config import Config
from zeroband.data.loader import resolve_files
from zeroband.data.tokenizer import TextTokenizer
from zeroband.trust.auth import flatten_fingerprint

# DiLoCo settings that are each site's own (how patient it is); every other one must match, so a setting
# added later is compared by default. Of [sites] (where a site is, how it reaches the others) only the
# settings that must agree are compared.
PER_SITE_DILOCO_KEYS = {"heartbeat_s", "dead_after_s", "grace_s", "start_grace_s", "join_timeout_s", "max_retries",
                        "log_checksum"}
SHARED_SITES_KEYS = {"site_count", "backend", "streams", "probe_s"}  # probe_s: 0 on one side only would stall the probe


def run_fingerprint(cfg: Config, tokenizer: TextTokenizer, ranks_per_site: int) -> dict[str, str]:
    """Every setting that must match across sites, as flat `key -> value` (a mismatch names the key).
    Batch sizes may differ (a slower site trains on less); model, optimiser, schedule, outer
    settings, wire format, tokenizer and data may not. The rank count may differ in a fixed DiLoCo run
    (sites of different shapes exchange per lane: comm/layout.py), not in an elastic or data-parallel one."""
    shapes_may_differ = cfg.diloco is not None and not cfg.diloco.elastic and cfg.diloco.mode == "diloco"
    return flatten_fingerprint({
        "model": cfg.model.model_dump(exclude={"init_from", "preset"}), "optim": cfg.optim.model_dump(),
        "ranks_per_site": "any" if shapes_may_differ else ranks_per_site,
        "train": cfg.train.model_dump(include={"steps", "seed", "mixed_precision"}),
        "tokenizer": {"vocab": tokenizer.vocab_size, "sha256": tree_sha256(cfg.data.tokenizer)},
        "data": cfg.data.model_dump(include={"hub_name", "text_field", "seq_len", "shuffle_seed", "val_fraction"})
        | {"files": data_identity(cfg.data.path) if not cfg.data.hub_name else []},
        "diloco": cfg.diloco.model_dump(exclude=PER_SITE_DILOCO_KEYS) if cfg.diloco else {},
        "sites": cfg.sites.model_dump(include=SHARED_SITES_KEYS) if cfg.diloco else {},
    })


def tree_sha256(path: str) -> str:
    """sha256 over a file, or over a directory's files (names and contents): the tokenizer's identity."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root] if root.is_file() else []
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def data_identity(path: str | list[str]) -> list[str]:
    """`name:size` of every training file: the same corpus under another mount point still matches."""
    try:
        return [f"{Path(f).name}:{Path(f).stat().st_size}" for f in resolve_files(path)]
    except FileNotFoundError:
        return [str(path)]
