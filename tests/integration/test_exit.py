"""Issue 23: a rank that finished its run leaves no thread for the interpreter's finalization.

At finalization CPython 3.11 ends every other thread that next takes the GIL with pthread_exit; in a
C++ frame (a gloo worker dropping a tensor Python created, a c10d store call returning) that aborts
the process: "terminate called without an active exception", SIGABRT after the run's summary. Before
the fix the site's ProcessGroupGloo (two work loops and gloo's transport loop) outlived `shutdown`,
held by the site mesh and DTensor's caches, and the transport's peer threads were never joined.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tests.helpers import diloco_tree
from tests.multiproc import run_sites
from zeroband.config import validate_config


def _native_threads() -> list[str]:
    """The names (/proc comm) of this process's gloo threads: its work loops and transport loop."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # ended while listed
            pass
    return sorted(n for n in names if n in ("pt_gloo_runloop", "gloo_tcp_loop"))


def _train_then_threads(tree: dict) -> tuple[list[str], list[str]]:
    """Train to the end (train() runs mesh.shutdown), then the gloo threads and zeroband's own left."""
    from zeroband.train import train

    train(validate_config(tree))
    ours = sorted(t.name for t in threading.enumerate() if t.name.startswith("zeroband-"))
    return _native_threads(), ours


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
@pytest.mark.timeout(120)
def test_sites_of_two_and_one_ranks_end_every_thread_before_exit(corpus, tmp_path):
    tree = diloco_tree(corpus, tmp_path, train={"steps": 4})
    out = run_sites(_train_then_threads, 2, [2, 1], (tree,))
    assert out == {(0, 0): ([], []), (0, 1): ([], []), (1, 0): ([], [])}, out
