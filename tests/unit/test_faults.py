"""The test-side fault injector alone: the schedule, which seam fires when, and that it leaves no trace.

The entry point for subprocess runs is tested last; the end-to-end uses (kills mid all-reduce, mid
save, between the seal renames) are in test_elastic, test_train, test_checkpoint_safety and test_chaos.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import faults
from tests.faults import Fault, InjectedFault, install, parse_faults, uninstall
from tests.inject import inject_command, site_of
from zeroband import checkpoint, seams
from zeroband.outer.base import NoOuter


@pytest.fixture(autouse=True)
def _clean():
    yield
    uninstall()


def _no_outer():
    """The outer class of a one-site run, as a run built now gets it (through the installed seams)."""
    return seams.current().outer(NoOuter(), torch.nn.Linear(1, 1))


def test_parse_faults():
    assert parse_faults("site1:step30:allreduce:kill, site0:step20:checkpoint:raise:rank1") == [
        Fault(1, 30, "allreduce", "kill"), Fault(0, 20, "checkpoint", "raise", 1)]
    for bad in ("site1:30:inner:kill", "site1:step3:loop:kill", "site1:step3:inner:explode", "site1:step3"):
        with pytest.raises(ValueError, match="fault"):
            parse_faults(bad)


def test_inner_fault_fires_at_its_step_on_its_site_and_rank_only():
    install("site1:step3:inner:raise:rank0,site0:step4:inner:raise", site=1, rank=0)
    outer = _no_outer()
    outer.after_inner_step(2)  # inner step 2 done
    with pytest.raises(InjectedFault, match="site 1 rank 0 step 3 \\(inner\\)"):
        outer.after_inner_step(3)
    outer.after_inner_step(4)  # site 0's entry: not this process
    install("site1:step3:inner:raise:rank0", site=1, rank=1)
    _no_outer().after_inner_step(3)  # rank 1 of site 1: not in the schedule


def test_seal_fault_fires_between_the_two_renames(tmp_path):
    final, tmp = tmp_path / "step_000000004", tmp_path / "step_000000004.tmp"
    for d, run in ((final, "r"), (tmp, None)):
        d.mkdir()
        (d / "data").write_text("x")
        if run:
            (d / checkpoint.MANIFEST).write_text(json.dumps({"run_id": run}))
    install("site0:step4:seal:raise", site=0, rank=0)
    with pytest.raises(InjectedFault):
        checkpoint._seal(tmp, final, 4, 1, {"run_id": "r"}, None)
    assert not final.exists() and Path(str(final) + checkpoint.ASIDE).is_dir() and tmp.is_dir()
    assert checkpoint.os is faults.os  # the module's own `os` is back


def test_uninstall_restores_every_seam():
    """Faults go through the seams a run is built with: nothing of the package is patched, ever."""
    before = (checkpoint.save_checkpoint, checkpoint._seal, NoOuter.after_inner_step, checkpoint.os)
    install("site0:step1:inner:raise")
    assert seams.current() is not seams.PLAIN and type(_no_outer()) is faults.FaultyOuter
    assert (checkpoint.save_checkpoint, checkpoint._seal, NoOuter.after_inner_step, checkpoint.os) == before
    uninstall()
    assert seams.current() is seams.PLAIN and type(_no_outer()) is NoOuter
    _no_outer().after_inner_step(1)  # step 1: nothing fires any more


def test_inject_command_wraps_the_trainer_of_a_site_command():
    cmd = ["torchrun", "--nproc-per-node", "1", "-m", "zeroband.train", "c.toml", "--sites.site_rank", "2"]
    assert inject_command(cmd, "site2:step5:inner:kill", 2) == [
        "torchrun", "--nproc-per-node", "1", "-m", "tests.inject", "--faults", "site2:step5:inner:kill",
        "--site", "2", "--", "train", "c.toml", "--sites.site_rank", "2"]
    assert site_of(cmd[5:]) == 2 and site_of(["c.toml"]) is None
