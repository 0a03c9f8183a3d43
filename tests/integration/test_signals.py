"""A real SIGTERM ends an elastic site cleanly whoever receives it: its torchrun agent, its
trainer's whole process group (as torchrun and SLURM signal), or `zeroband launch` (issue 34).
Each site then writes its checkpoint and leave notice and exits 0 without a traceback, through
its own store connection (no helper process in the trainer's group stands between them).
One real launch of three sites, one route per site."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from tests.helpers import outer_records, tiny_overrides
from zeroband.tools.launch import descendants, proc_state

DEAD_AFTER_S = 30.0  # a leave noticed only by its silence would stall the survivors this long


def _site_processes(launcher: int, site: int) -> tuple[int, int]:
    """(torchrun agent, trainer) of `site`, from their command lines."""
    tag = f"--sites.site_rank\0{site}\0".encode()
    found = {}
    for pid in descendants(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if tag in cmd:
            found[b"zeroband.torchrun" in cmd] = pid
    return found[True], found[False]


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc_state(pid) in (None, "Z"):
            return True
        time.sleep(0.2)
    return False


def _wait_for(path: Path, marker: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and marker in path.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise AssertionError(f"no {marker!r} in {path} within {timeout_s} s")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the site processes")
def test_sigterm_to_agent_process_group_or_launcher_leaves_cleanly(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 100_000}, log={"interval": 1, "progress_bar": False})
    tree["diloco"] = {"elastic": True, "inner_steps": 2, "heartbeat_s": 0.5, "dead_after_s": DEAD_AFTER_S,
                      "grace_s": 1.0, "start_grace_s": 30.0, "comm_dtype": "fp16"}
    tree["sites"] = {"timeout_s": 60}  # no secret: the launcher makes one, and the store demands it
    (tmp_path / "run.toml").write_text(tomli_w.dumps(tree))
    env = {k: v for k, v in os.environ.items() if k != "ZEROBAND_SECRET"}
    err_path = tmp_path / "launcher.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "zeroband", "launch", str(tmp_path / "run.toml"), "--sites", "3",
                                 "--grace", "60"], stdout=subprocess.DEVNULL, stderr=err, env=env)
    logs = tmp_path / "t" / "logs"
    try:
        for site in range(3):  # every site has taken part in a round
            _wait_for(tmp_path / "t" / f"site{site}" / "metrics.jsonl", '"kind": "outer"', 120)
        agent2, _ = _site_processes(proc.pid, 2)
        agent1, trainer1 = _site_processes(proc.pid, 1)
        t0 = time.monotonic()
        os.kill(agent2, signal.SIGTERM)  # as `kill <agent>`: torchrun passes it on to the trainer's group
        os.killpg(os.getpgid(trainer1), signal.SIGTERM)  # the trainer's whole group
        assert _gone_within(agent2, 60) and _gone_within(agent1, 60), "site 2 or site 1 did not leave"
        proc.send_signal(signal.SIGTERM)  # the launcher passes it on to site 0's agent
        proc.wait(90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    said = err_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, said
    for site, how in ((2, "finished"), (1, "finished"), (0, "stopped")):  # 0: by the launcher
        assert f"site {site} {how} (exit code 0)" in said, said
        text = (logs / f"site{site}.log").read_text(errors="replace")
        assert "SIGTERM: leaving at step" in text, text[-3000:]
        if site != 1:  # the agent got the signal too (site 1's agent only saw its rank exit 0)
            assert "zeroband.torchrun: SIGTERM: every rank (1) exited cleanly" in text, text[-3000:]
        for bad in ("Traceback", "Broken pipe", "SignalException", "stopped answering"):
            assert bad not in text, f"site {site}: {bad}\n{text[-3000:]}"
        sealed = sorted((tmp_path / "t" / "checkpoints" / f"site{site}").glob("step_*/manifest.json"))
        assert sealed, f"site {site} saved no checkpoint"
    # Their leave notices: no round of the survivors waited for a silent site (dead_after_s)
    assert max(r["outer_step_s"] for r in outer_records(tmp_path, 0)) < DEAD_AFTER_S / 2
    print(f"three SIGTERM routes handled in {took:.0f} s")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the rank")
def test_a_rank_outlives_no_agent_killed_outright(corpus, tmp_path):
    """kill -9 of a torchrun agent: its rank gets SIGTERM (PR_SET_PDEATHSIG), saves and leaves,
    and frees run.lock, so the site can be restarted. Before: it ran on in its own session."""
    import fcntl

    from zeroband import torchrun

    tree = tiny_overrides(corpus, tmp_path, train={"steps": 100_000}, log={"interval": 1, "progress_bar": False})
    (tmp_path / "run.toml").write_text(tomli_w.dumps(tree))
    with open(tmp_path / "agent.log", "w") as log:
        agent = subprocess.Popen([*torchrun.command(1), "-m", "zeroband.train", str(tmp_path / "run.toml")],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(tmp_path / "t" / "metrics.jsonl", '"kind": "train"', 90)
        (rank,) = [p for p in descendants(agent.pid) if b"zeroband.train" in Path(f"/proc/{p}/cmdline").read_bytes()]
        t0 = time.monotonic()
        agent.kill()
        agent.wait()
        assert _gone_within(rank, 30), "the rank outlived its agent"
        took = time.monotonic() - t0
    finally:
        if agent.poll() is None:
            agent.kill()
    text = (tmp_path / "agent.log").read_text(errors="replace")
    assert "SIGTERM: leaving at step" in text and "Traceback" not in text, text[-3000:]
    assert sorted((tmp_path / "t" / "checkpoints").glob("step_*/manifest.json")), "no checkpoint on the way out"
    with open(tmp_path / "t" / "run.lock") as lock:  # free: a restart of the site is not refused
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print(f"the rank left {took:.1f} s after its agent was killed")
