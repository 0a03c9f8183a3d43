"""Old import path: the outer loop lives in zeroband/outer/ now."""

from zeroband.outer.base import NoOuter, OuterStats, RoundClock, SingleSite
from zeroband.outer.diloco import (
    DiLoCo,
    agree_on_run,
    broadcast_from_site0,
    checksum_table,
    crc32_of,
    local_shard,
    outer_preview,
    site_stats,
    verify_identical,
)

__all__ = ["DiLoCo", "NoOuter", "OuterStats", "RoundClock", "SingleSite", "agree_on_run", "broadcast_from_site0",
           "checksum_table", "crc32_of", "local_shard", "outer_preview", "site_stats", "verify_identical"]
