"""Helpers for the chaos suite (scripts/chaos.py, tests/integration/test_chaos.py): site processes, an etcd
cluster that can live inside the sites' network namespaces, and the post-mortem of a run
(membership decisions and outer checksums from the sites' metrics.jsonl records, checkpoints).

Nothing here is used by training itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from tests.inject import ENTRY, entry_env, inject_command
from zeroband.records import decode_record
from zeroband.tools.launch import children, is_running, site_command

# ---------------------------------------------------------------------------------- site processes


@dataclass
class Incarnation:
    number: int
    started: float
    faults: str
    proc: subprocess.Popen
    workers: list[int] = field(default_factory=list)
    ended: float | None = None
    returncode: int | None = None


@dataclass
class SiteProcess:
    """One site slot: restarted with the same command (with a per-incarnation fault schedule armed
    through tests/inject.py)."""

    site: int
    command: list[str]
    env: dict[str, str]
    log_path: Path
    incarnations: list[Incarnation] = field(default_factory=list)

    @property
    def current(self) -> Incarnation | None:
        return self.incarnations[-1] if self.incarnations else None

    @property
    def running(self) -> bool:
        inc = self.current
        return inc is not None and inc.proc.poll() is None

    def start(self, faults: str = "") -> Incarnation:
        command = inject_command(self.command, faults, self.site) if faults else self.command
        number = len(self.incarnations)
        with open(self.log_path, "a") as log:
            log.write(f"{_now_stamp()} chaos INFO incarnation {number} of site {self.site} faults={faults!r}\n")
            log.flush()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env=entry_env(self.env) if faults else self.env, start_new_session=True)
        inc = Incarnation(number, time.time(), faults, proc)
        self.incarnations.append(inc)
        return inc

    def workers(self) -> list[int]:
        """The training ranks of the current incarnation (cached once seen: they outlive a dead agent)."""
        inc = self.current
        if inc is None:
            return []
        if not inc.workers and inc.proc.poll() is None:
            inc.workers = children(inc.proc.pid)  # the torchrun agent's: the training ranks
        return inc.workers

    def poll(self) -> int | None:
        inc = self.current
        if inc is None:
            return None
        code = inc.proc.poll()
        if code is not None and inc.ended is None:
            inc.ended, inc.returncode = time.time(), code
        return code

    def signal_workers(self, sig: int) -> list[int]:
        pids = self.workers()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def stop(self, timeout: float = 10.0) -> None:
        """Tear the whole incarnation down (its own session), politely then not."""
        inc = self.current
        if inc is None or inc.proc.poll() is not None:
            self.poll()
            return
        for sig in (signal.SIGCONT, signal.SIGTERM):
            _killpg(inc.proc.pid, sig)
        try:
            inc.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _killpg(inc.proc.pid, signal.SIGKILL)
            inc.proc.wait()
        self.poll()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _now_stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def make_sites(config: str, sites: int, store: str, overrides: list[str], log_dir: Path,
               wrap: Callable[[int, list[str]], list[str]], site_env: Callable[[int], dict]) -> list[SiteProcess]:
    log_dir.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = []
    for s in range(sites):
        cmd = wrap(s, site_command(config, s, sites, 1, store, overrides))
        out.append(SiteProcess(s, cmd, {**base, **site_env(s)}, log_dir / f"site{s}.log"))
    return out


# ---------------------------------------------------------------------------------- post-mortem


@dataclass(frozen=True)
class LoggedDecision:
    time: float
    site: int
    round: int
    attempt: int
    members: tuple[int, ...]
    fresh: tuple[int, ...]
    generation: int


def read_records(path: Path, kind: str) -> list[dict[str, Any]]:
    """The `kind` records of one metrics.jsonl (a line cut short by a kill is skipped)."""
    if not path.is_file():
        return []
    return _parse_records(path.read_bytes(), kind)


def _parse_records(data: bytes, kind: str) -> list[dict[str, Any]]:
    records = []
    for line in data.decode(errors="replace").splitlines():
        try:
            rec = decode_record(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == kind:
            records.append(rec)
    return records


def _decision(rec: dict[str, Any]) -> LoggedDecision:
    return LoggedDecision(float(rec["time"]), int(rec["site"]), int(rec["round"]), int(rec["attempt"]),
                          tuple(rec["members"]), tuple(rec["fresh"]), int(rec["generation"]))


def membership_events(metrics_paths: Iterable[Path], event: str) -> list[dict[str, Any]]:
    """The `membership` records of one `event` the sites wrote (see notes: events.md), sorted by time."""
    found = [r for p in metrics_paths for r in read_records(p, "membership") if r.get("event") == event]
    return sorted(found, key=lambda r: r["time"])


def read_decisions(metrics_paths: Iterable[Path]) -> list[LoggedDecision]:
    """Every membership decision the sites recorded in their metrics.jsonl, sorted by time."""
    return [_decision(r) for r in membership_events(metrics_paths, "decision")]


class DecisionTail:
    """`read_decisions` for growing metrics files, reading only what was appended since last time."""

    def __init__(self, metrics_paths: list[Path]) -> None:
        self.paths, self.offsets = metrics_paths, [0] * len(metrics_paths)
        self.decisions: list[LoggedDecision] = []

    def read(self) -> list[LoggedDecision]:
        for i, path in enumerate(self.paths):
            if not path.is_file():
                continue
            with open(path, "rb") as f:
                if f.seek(0, 2) < self.offsets[i]:  # truncated by a restart that resumed earlier
                    self.offsets[i] = 0
                f.seek(self.offsets[i])
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self.offsets[i] += end
            self.decisions += [_decision(r) for r in _parse_records(chunk[:end], "membership")
                               if r.get("event") == "decision"]
        self.decisions.sort(key=lambda d: d.time)
        return self.decisions


def count_events(metrics_paths: Iterable[Path], event: str) -> int:
    return len(membership_events(metrics_paths, event))


def first_exclusion(decisions: list[LoggedDecision], victim: int, since: float, until: float | None = None
                    ) -> LoggedDecision | None:
    """The first decision logged by another site at or after `since` that leaves `victim` out."""
    for d in decisions:
        if d.time >= since and d.site != victim and victim not in d.members and (until is None or d.time <= until):
            return d
    return None


def first_inclusion(decisions: list[LoggedDecision], site: int, since: float) -> LoggedDecision | None:
    for d in decisions:
        if d.time >= since and site in d.members and d.site != site:
            return d
    return None


def outer_records(metrics_path: Path) -> list[dict[str, Any]]:
    return read_records(metrics_path, "outer")


def last_step(metrics_path: Path) -> int:
    """The last inner step a site logged (0 if none); cheap enough to poll."""
    if not metrics_path.is_file():
        return 0
    with open(metrics_path, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 4096))
        tail = f.read().decode(errors="replace").splitlines()
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError, ValueError):
            continue
    return 0


def crc_table(records: dict[int, list[dict[str, Any]]]) -> dict[int, dict[int, set[int]]]:
    """step -> site -> the outer_crc values that site logged at that step."""
    table: dict[int, dict[int, set[int]]] = {}
    for site, recs in records.items():
        for r in recs:
            if r.get("outer_crc") is not None:
                table.setdefault(r["step"], {}).setdefault(site, set()).add(r["outer_crc"])
    return table


def crc_mismatches(table: dict[int, dict[int, set[int]]]) -> list[int]:
    """Steps at which two sites (or two incarnations of one) logged different outer checksums."""
    return sorted(step for step, by_site in table.items() if len(set().union(*by_site.values())) > 1)


def verify_all_checkpoints(ckpt_root: Path) -> tuple[int, list[str]]:
    """verify_checkpoint on every step_* dir (not .tmp) under every site; (count, errors)."""
    from zeroband.checkpoint import CheckpointError, verify_checkpoint

    count, errors = 0, []
    for path in sorted(ckpt_root.glob("site*/step_*")):
        if not path.is_dir() or path.name.endswith(".tmp"):
            continue
        count += 1
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            errors.append(str(e))
    return count, errors


def final_checkpoint(ckpt_root: Path, site: int) -> Path | None:
    from zeroband.checkpoint import step_dirs  # newest first; a sealed step before its aside copy

    found = step_dirs(ckpt_root / f"site{site}")
    return found[0][0] if found else None


def load_weights(config_path: Path, checkpoint: Path) -> dict[str, Any]:
    """The model weights of a checkpoint via zeroband.export.load_for_export (proves it loads)."""
    from zeroband.config import load_config
    from zeroband.export import load_for_export

    cfg = load_config(str(config_path), [])
    return {k: v.detach().clone() for k, v in load_for_export(cfg, checkpoint).state_dict().items()}


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------- fixed-mode scenarios
# Faults of the default (non-elastic) mode, each carried out on real `zeroband launch` runs from the
# outside (signals to processes, files removed between launches, the existing NaN fault schedule):
# the run must never hang, must end with a message naming the cause, and a relaunch must resume
# from the newest step every site has, with every final checkpoint verified and identical.

RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")


@dataclass
class ScenarioResult:
    kind: str
    injected: int = 0  # faults carried out
    detected_s: float | None = None  # fault -> the first site's exit naming the cause
    hung: int = 0  # launches that did not end on their own within their bound
    data_lost: int = 0  # final checkpoints that fail verification or differ between sites
    lost_steps: int = 0  # inner steps trained before the fault and not in the resumed run
    note: str = ""
    message: str = ""  # the error line the first failing site printed


@dataclass
class FixedRun:
    """A fixed-mode run under `zeroband launch`, driven and inspected from outside."""

    config: str
    overrides: list[str]
    out: Path  # output_dir; the run's name is `name`
    name: str
    sites: int = 2
    launches: int = 0

    @property
    def run_dir(self) -> Path:
        return self.out / self.name

    def launch(self, faults: str = "") -> subprocess.Popen:
        """`zeroband launch`; with `faults`, through tests/inject.py, which arms them in every site."""
        self.launches += 1
        log = open(self.run_dir.parent / f"{self.name}-launch{self.launches}.log", "w")  # noqa: SIM115
        entry = [sys.executable, "-m", ENTRY, "--faults", faults, "--"] if faults else [sys.executable, "-m", "zeroband"]
        cmd = [*entry, "launch", self.config, "--sites", str(self.sites), "--grace", "20", *self.overrides]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=entry_env())
        log.close()
        return proc

    def step(self, site: int) -> int:
        return last_step(self.run_dir / f"site{site}" / "metrics.jsonl")

    def workers(self, launcher: subprocess.Popen, site: int) -> list[int]:
        """The training ranks of `site` (not its torchrun agent), found below the launcher."""
        from zeroband.tools.launch import descendants

        out = []
        for pid in descendants(launcher.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (b"zeroband.train" in argv or ENTRY.encode() in argv) and b"torch.distributed.run" not in argv and \
                    argv[argv.index(b"--sites.site_rank") + 1] == str(site).encode():
                out.append(pid)
        return out

    def site_log(self, site: int) -> str:
        path = self.run_dir / "logs" / f"site{site}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def resumed_step(self) -> int:
        found = RESUMED.findall(self.site_log(0))
        return int(found[-1]) if found else 0

    def finals_ok(self) -> bool:
        """Every checkpoint verifies and the sites' final weights are identical."""
        ckpts = self.run_dir / "checkpoints"
        count, errors = verify_all_checkpoints(ckpts)
        finals = [final_checkpoint(ckpts, s) for s in range(self.sites)]
        if errors or not count or None in finals:
            return False
        weights = [load_weights(self.run_dir / f"site{s}" / "config.toml", cast(Path, f))  # none is None
                   for s, f in enumerate(finals)]
        finite = all(bool(v.isfinite().all()) for v in weights[0].values() if v.is_floating_point())
        return finite and all(same_weights(weights[0], w) for w in weights[1:])


def wait_exit(proc: subprocess.Popen, bound_s: float) -> int | None:
    try:
        return proc.wait(bound_s)
    except subprocess.TimeoutExpired:
        return None


def wait_for(cond: Callable[[], bool], bound_s: float, tick: float = 0.2) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(tick)
    return cond()


def _kill_tree(proc: subprocess.Popen) -> None:
    from zeroband.tools.launch import descendants

    for pid in [proc.pid, *descendants(proc.pid)]:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    proc.wait()


def finish(run: FixedRun, result: ScenarioResult, before: int, bound_s: float) -> ScenarioResult:
    """Relaunch to the end; account for hangs, lost steps and the final checkpoints."""
    import shutil

    if (run.run_dir / "logs").is_dir():  # keep the faulty launch's site logs for the post-mortem
        shutil.copytree(run.run_dir / "logs", run.run_dir / f"logs-launch{run.launches}", dirs_exist_ok=True)
    proc = run.launch()
    code = wait_exit(proc, bound_s)
    if code is None:
        result.hung += 1
        _kill_tree(proc)
        result.note += f"; relaunch still running after {bound_s:.0f} s"
        return result
    if code != 0:
        result.note += f"; relaunch exited {code}"
    result.lost_steps += max(0, before - run.resumed_step())
    result.data_lost += 0 if run.finals_ok() else 1
    return result


def frozen_peer(run: FixedRun, at_step: int, timeout_s: float, then: str, bound_s: float) -> ScenarioResult:
    """SIGSTOP site 1's ranks mid-run; site 0 must exit within timeout_s naming site 1; then SIGCONT
    (or SIGKILL) site 1, which must exit too; a relaunch resumes and finishes."""
    result = ScenarioResult(f"frozen_peer_{then}")
    proc = run.launch()
    if not wait_for(lambda: run.step(0) >= at_step, bound_s):
        _kill_tree(proc)
        result.note = "never reached the fault step"
        return result
    victims = run.workers(proc, 1)
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)
    t0, result.injected = time.monotonic(), 1
    if wait_for(lambda: "zeroband: error:" in run.site_log(0), timeout_s + 30):
        result.detected_s = time.monotonic() - t0
        result.message = next(x for x in run.site_log(0).splitlines() if x.startswith("zeroband: error:"))
    before = max(run.step(s) for s in range(run.sites))
    for pid in victims:
        os.kill(pid, signal.SIGCONT if then == "cont" else signal.SIGKILL)
    if wait_exit(proc, timeout_s + 40) is None:
        result.hung += 1
        _kill_tree(proc)
    return finish(run, result, before, bound_s)


def launcher_sigterm(run: FixedRun, at_step: int, bound_s: float) -> ScenarioResult:
    """SIGTERM to `zeroband launch` mid-run: every site must be gone within the grace; a relaunch resumes."""
    from zeroband.tools.launch import descendants

    result = ScenarioResult("launcher_sigterm")
    proc = run.launch()
    if not wait_for(lambda: run.step(0) >= at_step, bound_s):
        _kill_tree(proc)
        result.note = "never reached the fault step"
        return result
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    t0, result.injected = time.monotonic(), 1
    if wait_exit(proc, 60) is None:
        result.hung += 1
        _kill_tree(proc)
    result.detected_s = time.monotonic() - t0
    orphans = [p for p in tree if is_running(p)]
    if orphans:
        result.hung += 1
        result.note = f"orphans {orphans}"
        for p in orphans:
            os.kill(p, signal.SIGKILL)
    before = max(run.step(s) for s in range(run.sites))
    return finish(run, result, before, bound_s)


def resume_mismatch(run: FixedRun, bound_s: float) -> ScenarioResult:
    """Site 1 loses its newest checkpoint: the relaunch must resume both sites from the newest
    common step (then site 1 loses every checkpoint: the relaunch must stop, naming who has what)."""
    result = ScenarioResult("resume_mismatch")
    ckpts = run.run_dir / "checkpoints"
    newest = final_checkpoint(ckpts, 1)
    if newest is None:
        result.note = "no checkpoint to remove"
        return result
    before = int(newest.name.split("_")[1])
    import shutil

    shutil.rmtree(newest)
    result.injected = 1
    return finish(run, result, before, bound_s)


def resume_refused(run: FixedRun, bound_s: float) -> ScenarioResult:
    """Site 1 has no checkpoint at all while site 0 has some: both stop with one message, no hang."""
    import shutil

    result = ScenarioResult("resume_refused", injected=1)
    shutil.rmtree(run.run_dir / "checkpoints" / "site1", ignore_errors=True)
    t0 = time.monotonic()
    proc = run.launch()
    code = wait_exit(proc, bound_s)
    if code is None:
        result.hung += 1
        _kill_tree(proc)
    elif "sites cannot resume together" in run.site_log(0) + run.site_log(1):
        result.detected_s = time.monotonic() - t0
    result.note = f"launcher exit {code}"
    return result


def nan_divergence(run: FixedRun, step: int, bound_s: float, inner_steps: int) -> ScenarioResult:
    """Site 1's pseudo-gradient turns NaN at one outer step (tests/faults.py schedule):
    it is excluded from that average on every site alike, the run ends, nothing non-finite is kept."""
    result = ScenarioResult("nan_divergence", injected=1)
    proc = run.launch(f"site1:step{step}:allreduce:nan")
    code = wait_exit(proc, bound_s)
    if code is None:
        result.hung += 1
        _kill_tree(proc)
        return result
    excluded = any(1 in r.get("excluded_sites", []) for r in outer_records(run.run_dir / "site0" / "metrics.jsonl"))
    result.detected_s = 0.0 if excluded else None
    result.lost_steps = inner_steps if excluded else 0  # site 1's round of local work was dropped
    result.data_lost += 0 if code == 0 and run.finals_ok() else 1
    result.note = f"exit {code}"
    return result
