"""End to end through the real launchers: torchrun per site, the `zeroband` command, HF export."""

from __future__ import annotations

import json
import os

import pytest

from zeroband.tools.launch import site_cpus


def test_site_cpus_are_disjoint_and_refuse_too_many_sites():
    cpus = sorted(os.sched_getaffinity(0))
    sets = [set(map(int, s.split(","))) for s in site_cpus(len(cpus))]
    assert all(len(s) == 1 for s in sets) and set().union(*sets) == set(cpus)
    try:
        site_cpus(len(cpus) + 1)
    except ValueError as e:
        assert "one CPU per site" in str(e)
    else:
        raise AssertionError("more sites than CPUs must be refused")


# ------------------------------------------------------------------ the supervising launcher (issue 28)
def test_decide_names_the_first_failure_and_bounds_the_rest():
    from zeroband.tools.launch import SiteSeen, SupervisePolicy, decide

    fixed, elastic = SupervisePolicy(10, 10, 600), SupervisePolicy(10, None, 600)
    running, done = SiteSeen(), SiteSeen(0, 50.0)
    assert decide([running, running], 100.0, fixed) is None
    # A site that exited with an error: the others get the bound, then every live site is stopped.
    dead = SiteSeen(1, 100.0, error="zeroband: error: boom")
    assert decide([running, dead], 105.0, fixed) is None
    d = decide([running, dead], 110.0, fixed)
    assert d.stop == (0,) and d.failed == (1,) and d.why.startswith("site 1 failed first (exit code 1): zeroband: error: boom")
    assert decide([running, dead], 1000.0, elastic) is None  # elastic sites go on without it
    # A stopped (SIGSTOP) site is a failure once stopped for the bound; a fixed run ends then.
    stopped = SiteSeen(None, 100.0, stopped=True)
    assert decide([running, stopped], 109.0, fixed) is None
    d = decide([running, stopped], 110.0, fixed)
    assert d.stop == (0, 1) and d.failed == (1,) and "stopped (SIGSTOP) for 10 s" in d.why
    assert decide([running, stopped], 110.0, elastic) is None  # the others drop it and go on
    d = decide([done, stopped], 110.0, elastic)  # nobody else left: the frozen one is stopped at once
    assert d.stop == (1,) and d.failed == (1,)
    # The others finished: the rest get sites.timeout_s (their cross-site waits' own bound).
    assert decide([done, running], 649.0, fixed) is None
    d = decide([done, running], 650.0, fixed)
    assert d.stop == (1,) and d.failed == () and "site 1 still running 600 s" in d.why
    assert decide([done, SiteSeen(0, 60.0)], 10_000.0, fixed) is None  # all exited: nothing to stop


def test_policy_bound_follows_the_config():
    from zeroband.config import validate_config
    from zeroband.tools.launch import SupervisePolicy

    tree = {"diloco": {"inner_steps": 2}, "sites": {"timeout_s": 30}}
    assert SupervisePolicy.from_config(validate_config(tree)) == SupervisePolicy(10.0, 10.0, 30.0)
    tree = {"diloco": {"inner_steps": 2, "elastic": True, "dead_after_s": 5}, "sites": {"timeout_s": 3}}
    assert SupervisePolicy.from_config(validate_config(tree)) == SupervisePolicy(3.0, None, 3.0)


def test_terminal_filter_holds_back_everything_from_the_first_failure_on():
    from zeroband.tools.launch import TerminalFilter

    f = TerminalFilter()
    assert f.feed(1, b"step 1 loss 5\nstep 2") == b"step 1 loss 5\n"  # a piece without its end waits
    assert f.feed(2, b"\r 10%|#  |\r 20%|##") == b"\r 10%|#  |\r"  # a progress bar moves on \r
    assert f.feed(1, b" loss 4\nzeroband: error: x\nmore\n") == b"step 2 loss 4\n" and f.failed
    assert f.feed(2, b"E1126 03:18:48.4 8298 torch/distributed/elastic/multiprocessing/api.py:1] failed\n") == b""


def test_local_secret_is_made_once_0600_and_reused(tmp_path, monkeypatch):
    from zeroband.config import ConfigError, validate_config
    from zeroband.tools.launch import local_secret_env

    monkeypatch.delenv("ZEROBAND_SECRET", raising=False)
    cfg = validate_config({"name": "r", "output_dir": str(tmp_path), "diloco": {"inner_steps": 2}})
    env, path = local_secret_env(cfg)
    assert path == tmp_path / "r" / "launch.secret" and path.stat().st_mode & 0o777 == 0o600
    assert len(env["ZEROBAND_SECRET"]) >= 32 and local_secret_env(cfg) == (env, path)  # resume: the same one
    insecure = validate_config({"name": "r", "output_dir": str(tmp_path), "sites": {"insecure": True}})
    assert local_secret_env(insecure) == ({}, None)
    monkeypatch.setenv("ZEROBAND_SECRET", "x" * 32)  # a configured secret wins: nothing to add
    assert local_secret_env(cfg) == ({}, None)
    monkeypatch.delenv("ZEROBAND_SECRET")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        local_secret_env(cfg)


def test_the_launcher_shows_the_settings_a_resume_changed():
    from zeroband.tools.launch import progress_line

    rec = {"kind": "resumed", "step": 20, "from": "runs/t/site0/checkpoints/step_000000020",
           "changed": {"optim.lr": [0.0003, 0.0001]}}
    assert progress_line(json.dumps(rec)) == ("site 0 resumed at step 20 from runs/t/site0/checkpoints/step_000000020 "
                                              "(optim.lr: 0.0003 -> 0.0001 from here on)")


def test_nproc_takes_one_count_or_one_per_site():
    """`zeroband launch --nproc 2,1,1` (issue 26): a count per site; one count keeps meaning every site."""
    from zeroband.cli import _rank_counts
    from zeroband.config import ConfigError
    from zeroband.tools.launch import ranks_of

    assert _rank_counts("2") == 2 and _rank_counts("2,1,1") == [2, 1, 1]
    assert ranks_of(2, 3) == [2, 2, 2] and ranks_of([2, 1, 1], 3) == [2, 1, 1]
    for bad, sites in (([2, 1], 3), ([2, 0], 2), (0, 2)):
        with pytest.raises(ConfigError, match=r"^--nproc .* does not fit --sites \d: give one rank count"):
            ranks_of(bad, sites)
