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


def test_decide_stops_every_site_once_the_store_exited_or_stayed_frozen():
    from zeroband.tools.launch import SiteSeen, SupervisePolicy, decide

    policy, running = SupervisePolicy(10, None, 600), SiteSeen()
    assert decide([running, running], 100.0, policy, SiteSeen()) is None
    assert decide([running, running], 109.0, policy, SiteSeen(None, 100.0, stopped=True)) is None
    d = decide([running, running], 110.0, policy, SiteSeen(None, 100.0, stopped=True))
    assert d.stop == (0, 1) and d.failed == () and d.why.startswith("the coordination store is frozen: stopped "
                                                                     "(SIGSTOP) for 10 s")
    d = decide([running, SiteSeen(0, 50.0)], 100.0, policy, SiteSeen(-9, 99.0))
    assert d.stop == (0,) and d.why == "the coordination store exited (killed by SIGKILL); no site can go on without it"
    assert decide([SiteSeen(0, 50.0)], 100.0, policy, SiteSeen(-9, 99.0)) is None  # nobody left to stop


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


# ------------------------------------------------------- signals, a frozen or slow store (issue 34)
# A stand-in site: records the signal that ended it, then exits 0 as a site that left cleanly.
_SITE = ("import pathlib, signal, sys, time\n"
         "out = pathlib.Path(sys.argv[1])\n"
         "def leave(sig, frame):\n"
         "    out.write_text(signal.Signals(sig).name)\n"
         "    sys.exit(0)\n"
         "for sig in (signal.SIGTERM, signal.SIGHUP):\n"
         "    signal.signal(sig, leave)\n"
         "out.write_text('ready')\n"
         "time.sleep(60)\n")


def _stand_in_sites(tmp_path, n: int = 2) -> tuple[list, list]:
    import subprocess
    import sys
    import time

    marks = [tmp_path / f"site{s}.mark" for s in range(n)]
    procs = [subprocess.Popen([sys.executable, "-c", _SITE, str(m)], start_new_session=True) for m in marks]
    deadline = time.monotonic() + 20
    while not all(m.is_file() for m in marks) and time.monotonic() < deadline:
        time.sleep(0.02)
    return procs, marks


def test_sighup_to_the_launcher_ends_every_site_with_sigterm(tmp_path):
    """A closed terminal (SIGHUP) stops the sites as SIGTERM does, never leaving them unsupervised;
    they get SIGTERM (on which ranks leave cleanly), not the SIGHUP that would kill them."""
    import signal
    import threading

    from zeroband.tools.launch import Stopped, SupervisePolicy, Supervisor

    procs, marks = _stand_in_sites(tmp_path)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGHUP)).start()
    with pytest.raises(Stopped) as stopped:
        Supervisor(procs, tmp_path, None, 10.0, SupervisePolicy(10, None, 10)).run(20)
    assert stopped.value.signum == signal.SIGHUP
    assert [m.read_text() for m in marks] == ["SIGTERM", "SIGTERM"] and [p.returncode for p in procs] == [0, 0]


def test_a_frozen_store_is_named_and_ends_the_sites_within_the_bound(tmp_path, capsys):
    """A SIGSTOPped store: one line naming it at once, the sites stopped once it stayed frozen for
    the bound; it is resumed (SIGCONT) so that they can leave through it. Before: 4 silent minutes."""
    import signal
    import subprocess
    import sys
    import time

    from zeroband.tools.launch import SupervisePolicy, Supervisor, proc_state

    procs, marks = _stand_in_sites(tmp_path)
    store = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        os.kill(store.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        out = Supervisor(procs, tmp_path, None, 10.0, SupervisePolicy(1.0, None, 10), store).run(20)
        took = time.monotonic() - t0
        assert proc_state(store.pid) != "T"
    finally:
        store.kill()
        store.wait()
    said = capsys.readouterr().err
    assert f"the coordination store (pid {store.pid}) is stopped: process {store.pid} is in state T" in said, said
    assert out.failure.startswith("the coordination store is frozen: stopped (SIGSTOP) for 1 s"), out.failure
    assert took < 1.0 + 3.0 and list(out) == [0, 0]  # the bound, polls of 0.5 s, the sites' own exit
    assert [m.read_text() for m in marks] == ["SIGTERM", "SIGTERM"]


def test_a_store_that_starts_slowly_is_named_within_the_bound():
    """The launcher's store start is bounded by sites.timeout_s and says what it waited for."""
    import time

    from zeroband.tools.launch import StoreDidNotStart, free_port, store_process

    def slow(cmd: list[str]) -> list[str]:  # a machine so loaded that the store takes 30 s to start
        return ["sh", "-c", 'sleep 30; exec "$@"', "sh", *cmd]

    t0 = time.monotonic()
    with pytest.raises(StoreDidNotStart) as failed:
        with store_process(["127.0.0.1", free_port()], slow, timeout_s=1.5):
            pass
    assert time.monotonic() - t0 < 1.5 + 2.0  # the wrapper and its sleep die with it (their own session)
    assert "did not start within 1.5 s (max(sites.timeout_s, 60 s)); it printed nothing yet" in str(failed.value)
    assert "\n" not in str(failed.value)


def test_the_store_start_is_bounded_by_sites_timeout_never_under_a_minute():
    from zeroband.tools.launch import store_start_bound

    assert store_start_bound(600.0) == 600.0 and store_start_bound(4.0) == 60.0


def test_a_signalled_torchrun_job_exits_0_only_when_every_rank_did():
    from zeroband.torchrun import FIRST_FAILURE, signalled

    assert signalled("SIGTERM", [0, 0]) == ("zeroband.torchrun: SIGTERM: every rank (2) exited cleanly", 0)
    line, code = signalled("SIGTERM", [0, 2])
    assert line.startswith(f"{FIRST_FAILURE} rank 1 (local rank 1), exit code 2") and code == 2
    assert signalled("SIGTERM", [-9])[1] == 128 + 9
    assert signalled("SIGINT", [None])[1] == 128 + 2 and "still running after SIGINT" in signalled("SIGINT", [None])[0]
    assert signalled("SIGTERM", []) == ("zeroband.torchrun: SIGTERM before any rank started", 128 + 15)
