"""Sites of a fixed (non-elastic) DiLoCo run agree on the step they resume from, before training.

Without it, a site that resumes from step 10 while another starts fresh waits in a checksum
exchange that the other site never joins (it is broadcasting), and both hang. Each rank offers
the steps of its site's checkpoints that verify (or none: `checkpoint.resume = "none"` or an empty
directory) under a per-shard store key; every rank reads every site's offer and applies the same
pure rule (`decide_resume`), so all ranks of all sites reach the same answer without another
round. Elastic runs do not need this: a restarted site re-joins and takes the live state.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import torch.distributed as dist

from zeroband.trust.signed import SignedStore, exchange
from zeroband.watchdog import read_by_all

log = logging.getLogger(__name__)


class ResumeMismatch(RuntimeError):
    """The sites have no checkpoint step in common; the message says which site has what."""


def decide_resume(offers: Mapping[int, list[int]]) -> int | None:
    """The newest step every site has; None if no site has any checkpoint (a fresh start)."""
    if not any(offers.values()):
        return None
    common = set.intersection(*(set(steps) for steps in offers.values()))
    if common:
        return max(common)
    have = "; ".join(f"site {s} has {_steps(offers[s])}" for s in sorted(offers))
    raise ResumeMismatch(
        f"sites cannot resume together: {have}, and no step is in every site's checkpoints. Fix: copy the "
        "missing checkpoint to the site that lacks it, or start every site fresh with --checkpoint.resume none "
        "(in an empty checkpoint directory)"
    )


def _steps(steps: list[int]) -> str:
    return f"steps {sorted(steps)}" if steps else "no checkpoint"


def agree_resume(store: dist.Store, prefix: str, site: int, sites: int, offer: list[int], timeout_s: float,
                 key: bytes | None = None) -> int | None:
    """Publish this site's offer, wait (named, bounded) for every site's, return the agreed step.
    With a secret (`key`) offers are signed and bound to their key, under this start's own prefix
    (comm/group.py `incarnation_prefix`): a forged, copied or replayed offer reads as "not yet"."""
    keys = {s: f"{prefix}resume/site{s}" for s in range(sites)}
    signed = SignedStore(store, key)
    values = exchange(signed, keys, site, json.dumps(sorted(offer)), "resume agreement", timeout_s)
    offers = {s: json.loads(v) for s, v in values.items()}
    try:
        step = decide_resume(offers)
    except ResumeMismatch:
        read_by_all(store, f"{prefix}resume/", site, sites, timeout_s)
        raise
    if step is not None and offer and step != max(offer):
        log.warning("resuming from step %d, the newest step every site has (this site also has %s)", step,
                    sorted(set(offer) - {step}))
    return step
