"""The seams a run is built through: where tests wrap its public objects from outside.

Production builds every run with `PLAIN` (each seam returns what it is given), so nothing here
changes a run. A test process installs other seams before it builds a run, as torchft's tests wrap
the process group (FakeProcessGroupWrapper) instead of patching the code they test:

- `pg`: every cross-site process group, as `comm.group.new_global_group` builds it (fixed groups,
  each elastic generation's, a simulated run's); a wrapper sees each send, recv, all-reduce and
  broadcast the global group makes, in the order it makes them;
- `codec`: every wire codec, as `comm.reduce.wire_codec` hands it to an all-reduce; a wrapper
  sees every slice a site encodes (as a source and as a chunk's owner) before it is sealed;
- `outer`: the outer method as a whole (`DiLoCo`, `CrossSiteDataParallel`, `NoOuter`), with the
  model it trains, as `train.build_run` hands it to the loop;
- `checkpointer`: the save policy's object, as `train.build_run` hands it to the loop;
- `replace`: the rename that makes a checkpoint step final (`checkpoint._seal`, twice when a step is
  saved again), so a crash can be placed between the two renames;
- `site_command`: the command `zeroband launch` starts a site with (zeroband/tools/launch.py), so
  the sites' processes can install the same seams.

tests/faults.py builds its seams from a fault schedule; tests/attackers.py wraps `pg`
and `codec`.
This module imports nothing of zeroband, so every layer may read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _same(obj: Any, *context: Any) -> Any:
    return obj


@dataclass(frozen=True)
class Seams:
    pg: Callable[[Any, int], Any] = _same  # (process group, this member's rank in it) -> process group
    codec: Callable[[Any], Any] = _same  # (wire codec) -> wire codec
    outer: Callable[[Any, Any], Any] = _same  # (outer, model) -> outer
    checkpointer: Callable[[Any], Any] = _same  # (checkpointer) -> checkpointer
    replace: Callable[[Any, Any], None] = os.replace  # (src, dst): checkpoint seal's rename
    site_command: Callable[[list[str], int], list[str]] = _same  # (command, site) -> command


PLAIN = Seams()
_installed = PLAIN


def current() -> Seams:
    """The seams this process builds its runs and groups with."""
    return _installed


def use(seams: Seams | None) -> None:
    """Build this process's runs and groups from now on with `seams` (None: `PLAIN` again)."""
    global _installed
    _installed = seams or PLAIN
