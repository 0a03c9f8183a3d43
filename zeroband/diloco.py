"""Old import path: the outer loop lives in zeroband/outer/ now."""

from zeroband.comm.group import checksum_table, digest48
from zeroband.membership.base import agree_on_run
from zeroband.outer.base import NoOuter, OuterStats, RoundClock, SingleSite
from zeroband.outer.diloco import DiLoCo, broadcast_from_site0, local_shard, verify_identical
from zeroband.outer.stats import site_stats

__all__ = ["DiLoCo", "NoOuter", "OuterStats", "RoundClock", "SingleSite", "agree_on_run", "broadcast_from_site0",
           "checksum_table", "digest48", "local_shard", "site_stats", "verify_identical"]
