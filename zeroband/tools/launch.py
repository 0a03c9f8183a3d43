"""Start S sites x W ranks on one machine: one torchrun job per site, as on real separate sites.

One torchrun spanning all sites would be wrong: its restarts and exit handling would couple the
sites' fates. Here each site is its own process tree; only the global groups join them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroband import seams, torchrun
from zeroband.config import Config, ConfigError, load_config


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_of(nproc: int | list[int], sites: int) -> list[int]:
    """Each site's rank count from `--nproc`: one count for every site, or one per site (sites of
    different shapes, issue 26). ConfigError naming the fix otherwise."""
    counts = [nproc] * sites if isinstance(nproc, int) else list(nproc)
    if len(counts) != sites or min(counts, default=0) < 1:
        raise ConfigError(f"--nproc {','.join(map(str, counts))} does not fit --sites {sites}: give one rank count "
                          f"for every site or {sites} comma-separated counts >= 1 (e.g. --nproc {','.join(['1'] * sites)})")
    return counts


def site_command(config: str, site: int, sites: int, nproc: int, store: str, overrides: list[str]) -> list[str]:
    return [
        *torchrun.command(nproc), "-m", "zeroband.train", config, *site_identity(site, sites), "--sites.store", store,
        "--sites.host_store", "false", *overrides,
    ]


@dataclass(frozen=True)
class WanLink:
    """An emulated link between the sites (see zeroband/wan): per-site uplink rate, one-way delay."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    mtu: int = 9000

    @classmethod
    def parse(cls, spec: str) -> WanLink:
        """`rate=100,delay=50,jitter=5,loss=0.1,mtu=9000` (Mbit/s, ms, ms, %, bytes)."""
        names = {"rate": "rate_mbit", "delay": "delay_ms", "jitter": "jitter_ms", "loss": "loss_pct", "mtu": "mtu"}
        values: dict[str, Any] = {}  # floats, and mtu an int
        for item in filter(None, spec.split(",")):
            key, _, value = item.partition("=")
            if key not in names or not value:
                raise ValueError(f"--wan item {item!r}: expected one of {sorted(names)} as key=value")
            values[names[key]] = int(value) if key == "mtu" else float(value)
        return cls(**values)


@contextmanager
def site_network(sites: int, wan: WanLink | None, store_env: dict[str, str] | None = None, timeout_s: float = 60.0,
                 ) -> Iterator[tuple[str, Callable[[int, list[str]], list[str]], Callable[[int], dict], subprocess.Popen]]:
    """(store address, command wrapper, extra env, the store's process) for plain loopback or an
    emulated WAN.

    The coordination store runs in its own process (not in a site), so any site may die; `store_env`
    hands it the run's secret (its guard then admits only connections that prove it). It must be up
    within `timeout_s` (`store_start_bound`).
    """
    if wan is None:
        port = free_port()
        # gloo listens on the address the host name resolves to unless told an interface.
        gloo = {} if "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": "lo"}
        with store_process(["127.0.0.1", port], lambda cmd: cmd, store_env, timeout_s) as store:
            yield f"tcp://127.0.0.1:{port}", lambda site, cmd: cmd, lambda site: gloo, store
        return
    from zeroband.wan import WanEmulator

    with WanEmulator(sites, wan.rate_mbit, wan.delay_ms, wan.jitter_ms, wan.loss_pct, wan.mtu) as emu:
        with store_process([emu.site_ip(0), 29600], lambda cmd: emu.wrap(0, cmd), store_env, timeout_s) as store:
            yield emu.store_url(29600), emu.wrap, emu.env, store


class StoreDidNotStart(RuntimeError):
    """The launcher's coordination store did not start; the message is one line naming why."""


STORE_START_MIN_S = 60.0  # the store imports torch: seconds, more on a loaded machine, whatever the network


def store_start_bound(timeout_s: float) -> float:
    """How long the launcher waits for its store to listen: sites.timeout_s (600 s by default), never
    under STORE_START_MIN_S: a run's short network bound must not fail a slow import."""
    return max(timeout_s, STORE_START_MIN_S)


@contextmanager
def store_process(where: list, wrap: Callable[[list[str]], list[str]], env: dict[str, str] | None = None,
                  timeout_s: float = 60.0) -> Iterator[subprocess.Popen]:
    """The store server, up (StoreDidNotStart after `timeout_s` otherwise), stopped on the way out.
    In a session of its own: a signal to the launcher's process group (a terminal's ^C, SLURM) must
    not end it while the sites still leave through it; it exits with the launcher (ppid poll)."""
    host, port = where
    cmd = wrap([sys.executable, "-m", "zeroband.store.server", "--host", str(host), "--port", str(port)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        _wait_for_line(proc, "store listening", timeout_s, f"the coordination store on {host}:{port}")
        yield proc
    finally:
        for sig in (signal.SIGTERM, signal.SIGCONT):  # SIGCONT: a stopped store acts on it
            _killpg(proc.pid, sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_line(proc: subprocess.Popen, marker: str, timeout_s: float, what: str) -> None:
    """Read the process's output until `marker` (warnings may come first), EOF or the deadline;
    a line every LOG_EVERY_S while it waits."""
    from zeroband.watchdog import LOG_EVERY_S

    start, out = time.monotonic(), proc.stdout
    seen: list[str] = []
    deadline, next_log = start + timeout_s, start + LOG_EVERY_S
    assert out is not None  # started with stdout=PIPE
    while (now := time.monotonic()) < deadline:
        if now >= next_log:
            _say(f"zeroband launch: waiting {now - start:.0f} s for {what} (pid {proc.pid}) to start")
            next_log = now + LOG_EVERY_S
        ready, _, _ = select.select([out], [], [], max(0.0, min(deadline, next_log) - now))
        if not ready:
            continue
        line = out.readline()
        if not line:  # EOF: the server died
            raise StoreDidNotStart(f"{what} (pid {proc.pid}) exited ({exit_text(proc.wait())}) before it listened"
                                   + (f": {seen[-1]}" if seen else ", printing nothing"))
        if marker in line:
            return
        seen.append(line.strip())
    said = f"its last line: {seen[-1]}" if seen else "it printed nothing yet (a loaded machine: still importing torch?)"
    raise StoreDidNotStart(f"{what} (pid {proc.pid}) did not start within {timeout_s:g} s (max(sites.timeout_s, "
                           f"{STORE_START_MIN_S:g} s)); {said}. Fix: raise sites.timeout_s, or give the machine fewer jobs")


def site_cpus(sites: int) -> list[str]:
    """This process's CPUs dealt into `sites` disjoint sets (taskset lists), as separate machines
    would have them: co-located sites that share cores run at different speeds, and the faster
    one's wait for the slower would be counted as communication."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < sites:
        raise ValueError(f"--pin-cpus needs at least one CPU per site: {len(cpus)} CPUs for {sites} sites")
    per = len(cpus) // sites
    return [",".join(str(c) for c in cpus[s * per : (s + 1) * per]) for s in range(sites)]


class Stopped(RuntimeError):
    """The launcher got SIGTERM/SIGINT/SIGHUP; every site was stopped before this was raised."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}; every site was shut down")


def launch_sites(
    config: str, sites: int, nproc: int | list[int], overrides: list[str], log_dir: Path, timeout_s: float | None = None,
    wan: WanLink | None = None, on_started: Callable[[list[subprocess.Popen]], None] | None = None,
    pin_cpus: bool = False, progress: Path | None = None, grace_s: float = 40.0,
    policy: SupervisePolicy | None = None, site_env: dict[str, str] | None = None,
    store_env: dict[str, str] | None = None,
) -> Outcome:
    """Run every site to completion; returns their exit codes. Site logs go to log_dir/site{s}.log.
    `nproc`: ranks per site, one count or one per site (`ranks_of`). `pin_cpus` gives each site its own share of the CPUs (`site_cpus`). `progress`: a metrics.jsonl
    (site 0's) printed as it grows. A site that fails (or freezes) ends the others as `policy` says
    (default: `SupervisePolicy.from_config` of this config). `site_env`: extra environment of every
    site (the run-local secret: never on argv); `store_env` the store's (default: `site_env`).
    SIGTERM/SIGINT/SIGHUP are forwarded to every site, which get `grace_s` to exit before SIGKILL, then
    `Stopped` is raised (the store is stopped on the way out)."""
    if policy is None:
        policy = SupervisePolicy.from_config(load_config(config, [*overrides, *site_identity(0, sites)]))
    cpus = site_cpus(sites) if pin_cpus else None
    store_env = store_env if store_env is not None else site_env
    start_s = store_start_bound(policy.finish_grace_s)  # finish_grace_s is sites.timeout_s
    with site_network(sites, wan, store_env, start_s) as (store, wrap, net_env, store_proc):
        def pinned(site: int, cmd: list[str]) -> list[str]:
            return wrap(site, cmd if cpus is None else ["taskset", "-c", cpus[site], *cmd])

        def env(site: int) -> dict:
            return {**(site_env or {}), **net_env(site)}

        procs, tees = _start_sites(config, sites, ranks_of(nproc, sites), overrides, log_dir, store, pinned, env)
        if on_started is not None:
            on_started(procs)
        return Supervisor(procs, log_dir, progress, grace_s, policy, store_proc, tees).run(timeout_s)


def site_identity(site: int, sites: int) -> list[str]:
    return ["--sites.site_rank", str(site), "--sites.site_count", str(sites)]


def _start_sites(config, sites, nproc, overrides, log_dir, store, wrap, site_env,
                 ) -> tuple[list[subprocess.Popen], list[LogTee]]:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting threads starve the other sites
    procs, tees = [], []
    for site in range(sites):
        command = site_command(config, site, sites, nproc[site], store, overrides)
        cmd = wrap(site, seams.current().site_command(command, site))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env={**env, **site_env(site)}, start_new_session=True))
        tees.append(LogTee(procs[-1], log_dir / f"site{site}.log"))
    return procs, tees


class LogTee:
    """A site's output into its log file, its last lines also kept here: the launcher names a failed
    rank's own error from them even when the log's disk is full (the error may be ENOSPC)."""

    KEEP = 400  # lines: a traceback and torchrun's report after it fit

    def __init__(self, proc: subprocess.Popen, path: Path) -> None:
        self.tail: deque[str] = deque(maxlen=self.KEEP)
        path.write_bytes(b"")
        self.thread = threading.Thread(target=self._copy, args=(proc.stdout, path), name="zeroband-site-log",
                                       daemon=True)
        self.thread.start()

    def _copy(self, stream: Any, path: Path) -> None:
        with open(path, "ab", buffering=0) as log_file:
            for raw in iter(stream.readline, b""):
                self.tail.append(raw.decode(errors="replace"))
                try:
                    log_file.write(raw)
                except OSError:  # a full or read-only disk: the tail here still has it
                    pass

    def text(self, wait_s: float = 2.0) -> str:
        """The last lines, once the site's output ended (or after wait_s: a helper holds it open)."""
        self.thread.join(wait_s)
        return "".join(self.tail)


@dataclass(frozen=True)
class SupervisePolicy:
    """When the launcher gives up on sites. `from_config` derives it; the bounds are stated there."""

    frozen_after_s: float  # a site with a stopped process (state T) for this long has failed
    failure_grace_s: float | None  # after a failure the others get this long to exit (None: they go on)
    finish_grace_s: float  # once every other site has exited, the rest get this long

    @classmethod
    def from_config(cls, cfg: Config) -> SupervisePolicy:
        """bound = min(sites.timeout_s, diloco.dead_after_s) (10 s by default): elastic sites drop a
        silent peer after dead_after_s, and a fixed site notices a dead peer within ~3 s (a closed
        socket), so a site stopped for `bound` is frozen and the others of a fixed run, which cannot
        go on without the failed site, get `bound` to exit on their own. Elastic sites go on without
        it. A site still running when all others have exited gets sites.timeout_s, the bound of each
        of its cross-site waits (it may be writing its last checkpoint)."""
        d = cfg.diloco
        bound = min(cfg.sites.timeout_s, d.dead_after_s if d is not None else cfg.sites.timeout_s)
        elastic = d is not None and d.elastic
        return cls(frozen_after_s=bound, failure_grace_s=None if elastic else bound, finish_grace_s=cfg.sites.timeout_s)


@dataclass(frozen=True)
class SiteSeen:
    """What the launcher sees of one site now."""

    code: int | None = None  # exit code, once it has exited
    since: float | None = None  # when it exited, or since when a process of it has been stopped
    stopped: bool = False  # a process of the site is stopped (SIGSTOP: /proc state T) now
    error: str = ""  # after a failed exit: the line of its log that says why


@dataclass(frozen=True)
class Decision:
    stop: tuple[int, ...]  # running sites to stop now (SIGTERM, SIGKILL after --grace)
    failed: tuple[int, ...]  # sites that failed, the first first
    why: str  # one line: who failed first and why the others are stopped


def failure_time(seen: SiteSeen, policy: SupervisePolicy) -> float | None:
    """When the site failed: its non-zero exit, or the moment its stop became a freeze; else None."""
    if seen.code is not None:
        return seen.since if seen.code != 0 else None
    if seen.stopped and seen.since is not None:
        return seen.since + policy.frozen_after_s
    return None


def decide(sites: list[SiteSeen], now: float, policy: SupervisePolicy, store: SiteSeen | None = None,
           ) -> Decision | None:
    """Whom to stop now (None: keep watching). `store`: the coordination store's process, seen as a
    site is (None: not the launcher's). Pure: the Supervisor acts on it."""
    fails = {s: t for s, v in enumerate(sites) if (t := failure_time(v, policy)) is not None and t <= now}
    failed = tuple(sorted(fails, key=lambda s: (fails[s], s)))
    alive = [s for s, v in enumerate(sites) if v.code is None]
    running = [s for s in alive if s not in fails]
    why = _failure_text(sites, failed[0], policy) if failed else ""
    if not alive:
        return None
    if store is not None and (lost := store_failure(store, now, policy)):  # no site can go on without it
        return Decision(tuple(alive), failed, lost)
    if not running:  # only frozen sites are left: nobody else will finish
        return Decision(tuple(alive), failed, why)
    # The grace runs from the moment the site exited or stopped: a fixed run cannot go on without it.
    since = sites[failed[0]].since if failed else None  # set for every failed site
    if since is not None and policy.failure_grace_s is not None and now >= since + policy.failure_grace_s:
        return Decision(tuple(alive), failed, f"{why}; the others did not exit within {policy.failure_grace_s:g} s "
                                              "(min(sites.timeout_s, diloco.dead_after_s))")
    finished = [v.since for v in sites if v.code == 0 and v.since is not None]
    if finished and now >= max([*finished, *fails.values()]) + policy.finish_grace_s:
        late = ", ".join(f"site {s}" for s in running)
        return Decision(tuple(alive), failed, (f"{why}; " if why else "") +
                        f"{late} still running {policy.finish_grace_s:g} s (sites.timeout_s) after the others ended")
    return None


def _failure_text(sites: list[SiteSeen], site: int, policy: SupervisePolicy) -> str:
    v = sites[site]
    if v.code is None:
        return f"site {site} failed: stopped (SIGSTOP) for {policy.frozen_after_s:g} s, frozen"
    return f"site {site} failed first ({exit_text(v.code)})" + (f": {v.error}" if v.error else "")


def store_failure(store: SiteSeen, now: float, policy: SupervisePolicy) -> str:
    """Why the coordination store has failed by `now` ("": it has not): it exited, or it has been
    stopped (SIGSTOP) for frozen_after_s; every site's store call waits on it."""
    if store.code is not None:
        return f"the coordination store exited ({exit_text(store.code)}); no site can go on without it"
    if store.stopped and store.since is not None and now >= store.since + policy.frozen_after_s:
        return (f"the coordination store is frozen: stopped (SIGSTOP) for {policy.frozen_after_s:g} s "
                "(min(sites.timeout_s, diloco.dead_after_s)); every site's store call waits on it")
    return ""


def exit_text(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class Outcome(list):
    """The sites' exit codes (a list, as before), and `failure`: who failed first and why, if anyone."""

    failure: str = ""


class Supervisor:
    """Watches the sites: prints site 0's progress, every site's "waiting for site N" lines, stops
    and exits as they happen (the store's too); applies `decide`; forwards SIGTERM/SIGINT/SIGHUP to
    every site's process group, and never leaves a site behind."""

    def __init__(self, procs: list[subprocess.Popen], log_dir: Path, progress: Path | None, grace_s: float,
                 policy: SupervisePolicy, store: subprocess.Popen | None = None, tees: list[LogTee] | None = None,
                 ) -> None:
        self.procs, self.log_dir, self.grace_s, self.policy = procs, log_dir, grace_s, policy
        self.tees = tees
        self.store, self.store_seen = store, None if store is None else SiteSeen()
        self.progress = progress
        self.offset = progress.stat().st_size if progress is not None and progress.is_file() else 0
        self.seen = [SiteSeen() for _ in procs]
        self.log_offsets = [0] * len(procs)
        self.signum: int | None = None
        self.decision: Decision | None = None
        self.stopping: set[int] = set()  # sites this launcher is stopping (their exit is no news)
        self.failure = ""  # why it stopped them: the first failure, as seen then

    def run(self, timeout_s: float | None) -> Outcome:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        previous = self._forward_signals()
        try:
            while self.decision is None and self.signum is None and any(v.code is None for v in self.seen):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"sites still running after {timeout_s:.0f} s")
                self._observe()
                self.decision = decide(self.seen, time.monotonic(), self.policy, self.store_seen)
                if self.decision is None:
                    time.sleep(0.5)
            if self.decision is not None:
                _say(f"zeroband launch: {self.decision.why}; stopping "
                     f"{', '.join(f'site {s}' for s in self.decision.stop)}")
                self.stopping = set(self.decision.stop)
                failed = self.decision.failed
                self.failure = _failure_text(self.seen, failed[0], self.policy) if failed else self.decision.why
        finally:
            if self.signum is not None:  # every running site's exit from here on is the launcher's doing
                self.stopping = {s for s, p in enumerate(self.procs) if p.poll() is None}
            # SIGHUP (a closed terminal) as SIGTERM: the ranks leave on SIGTERM, and die of SIGHUP
            self._stop_all(signal.SIGTERM if self.signum in (None, signal.SIGHUP) else self.signum)
            self._observe()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.signum is not None:
            raise Stopped(self.signum)
        return self._outcome()

    def _outcome(self) -> Outcome:
        out = Outcome(p.returncode for p in self.procs)
        failed = sorted((s for s in range(len(out)) if out[s]), key=lambda s: self.seen[s].since or 0)
        out.failure = self.failure or (_failure_text(self.seen, failed[0], self.policy) if failed else "")
        return out

    def _forward_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handle(signum: int, frame: Any) -> None:
            self.signum = signum

        # SIGHUP: the terminal closed; the sites must not go on unsupervised
        return {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def _observe(self) -> None:
        """Update `seen` and print what happened since the last look."""
        for line in self._new_progress():
            print(line, flush=True)
        now = time.monotonic()
        self._observe_store(now)
        for site, p in enumerate(self.procs):
            for line in self._new_waits(site):
                _say(f"site {site}: {line}")
            old, code = self.seen[site], p.poll()
            if old.code is not None:
                continue
            if code is not None:
                self.seen[site] = SiteSeen(code, now, error=self._report_exit(site, code))
                continue
            stopped = stopped_process(p.pid)
            if stopped is not None and not old.stopped:
                self.seen[site] = SiteSeen(None, now, True)
                _say(f"site {site} is stopped: process {stopped} is in state T (SIGSTOP); it has failed unless "
                     f"it resumes within {self.policy.frozen_after_s:g} s")
            elif stopped is None and old.stopped:
                self.seen[site] = SiteSeen()
                _say(f"site {site} resumed")

    def _observe_store(self, now: float) -> None:
        """The store's process, watched as a site's is: its exit, its stop and resumption, each said once."""
        old, store = self.store_seen, self.store
        if old is None or store is None or old.code is not None:
            return
        if (code := store.poll()) is not None:
            self.store_seen = SiteSeen(code, now)
            _say(f"the coordination store (pid {store.pid}) exited ({exit_text(code)})")
        elif (stopped := stopped_process(store.pid)) is not None and not old.stopped:
            self.store_seen = SiteSeen(None, now, True)
            _say(f"the coordination store (pid {store.pid}) is stopped: process {stopped} is in state T (SIGSTOP): every site's store call waits on it; "
                 f"it has failed unless it resumes within {self.policy.frozen_after_s:g} s")
        elif stopped is None and old.stopped:
            self.store_seen = SiteSeen()
            _say("the coordination store resumed")

    def _report_exit(self, site: int, code: int) -> str:
        """Print the exit; returns the error line of a failure."""
        if code == 0 or site in self.stopping:
            # a site that left cleanly when stopped exits 0 too: "stopped" says whose doing it was
            _say(f"site {site} {'stopped' if site in self.stopping else 'finished'} ({exit_text(code)})")
            return ""
        text = self.tees[site].text() if self.tees else (self.log_dir / f"site{site}.log").read_text(errors="replace")
        error = last_error_line(text) if text.strip() else ""  # killed before it wrote anything
        _say(f"site {site} failed ({exit_text(code)})" + (f": {error}" if error else ""))
        return error

    def _new_waits(self, site: int) -> list[str]:
        """The watchdog's "waiting N s for site K" lines that site's log gained (each rank's once)."""
        path = self.log_dir / f"site{site}.log"
        try:
            with open(path, "rb") as f:
                f.seek(self.log_offsets[site])
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1
        self.log_offsets[site] += end
        found = [m.group(1) for line in chunk[:end].decode(errors="replace").splitlines()
                 if (m := WAIT_LINE.search(line))]
        return list(dict.fromkeys(found))

    def _new_progress(self) -> list[str]:
        if self.progress is None or not self.progress.is_file():
            return []
        with open(self.progress, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        return [line for raw in chunk[:end].decode(errors="replace").splitlines() if (line := progress_line(raw))]

    def _stop_all(self, sig: int) -> None:
        """`sig` to every running site's process group (torchrun passes it on to its ranks, which
        run in sessions of their own), SIGCONT to any stopped process so that it can act on it, then
        SIGKILL to whatever of the tree is left after grace_s."""
        running = [p for p in self.procs if p.poll() is None]
        trees = [descendants(p.pid) for p in running]
        if self.store is not None:  # a stopped store resumes: the sites leave through it
            for pid in [self.store.pid, *descendants(self.store.pid)]:
                if proc_state(pid) == "T":
                    _kill(pid, signal.SIGCONT)
        for p, tree in zip(running, trees):
            _killpg(p.pid, sig)
            for pid in [p.pid, *tree]:
                if proc_state(pid) == "T":
                    _kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + self.grace_s
        for p, tree in zip(running, trees):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p.pid, signal.SIGKILL)
                p.wait()
            for pid in tree:  # ranks that outlived their torchrun agent
                _kill(pid, signal.SIGKILL)


# The watchdog (zeroband/watchdog.py) logs every cross-site wait as "waiting N s for site K (...)".
WAIT_LINE = re.compile(r"zeroband\.watchdog WARNING (waiting \d+ s for .*)$")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, T, Z...), None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def stopped_process(pid: int) -> int | None:
    """A process of the tree at `pid` that is stopped by a signal (state T), if any."""
    return next((p for p in [pid, *descendants(pid)] if proc_state(p) == "T"), None)


def is_running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (neither gone nor a zombie)."""
    return proc_state(pid) not in (None, "Z", "X")


def children(pid: int) -> list[int]:
    """The processes `pid` started (its threads' children), read from /proc (empty where there is none)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # it exited meanwhile (or there is no /proc): no children left to find
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (empty where there is no /proc)."""
    out, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        out += below
        todo += below
    return out


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def progress_line(raw: str) -> str | None:
    """One metrics.jsonl record as a short line for the launcher's terminal (None: not shown)."""
    from zeroband.records import decode_record

    try:
        rec = decode_record(raw)
    except json.JSONDecodeError:
        return None
    kind, step = rec.get("kind"), rec.get("step")
    if kind == "train" and "loss" in rec:
        return (f"site 0 step {step}: loss {rec['loss']:.4f}, {rec.get('tokens_per_s', 0):,.0f} tok/s, "
                f"lr {rec.get('lr', 0):.2e}, eta {rec.get('eta_s', 0):.0f} s")
    if kind == "outer":
        return (f"site 0 step {step}: outer step {rec.get('outer_step')}, {rec.get('sites_used')} sites, "
                f"all-reduce {rec.get('allreduce_s', 0):.2f} s")
    if kind == "val":
        return f"site 0 step {step}: val loss {rec.get('val_loss', float('nan')):.4f}, ppl {rec.get('val_ppl', 0):.2f}"
    if kind == "resumed":  # the settings a resume applied, as the site printed them in its log
        changes = "; ".join(f"{key}: {old} -> {new}" for key, (old, new) in rec.get("changed", {}).items())
        return f"site 0 resumed at step {step} from {rec.get('from')}" + (f" ({changes} from here on)" if changes else "")
    return None


def last_error_line(log_text: str) -> str:
    """The line of a site's log that says why it failed: our one-line error if there is one, else
    the last exception line that is not torchrun's own wrapper, else the last line; prefixed with
    the rank that failed first when zeroband.torchrun named it."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    first = next((line for line in reversed(lines) if line.startswith(torchrun.FIRST_FAILURE)), None)
    rank = re.match(r"rank \d+", first[len(torchrun.FIRST_FAILURE):].strip()) if first else None
    error = next((line for line in reversed(lines) if line.startswith("zeroband: error:")), None) or next(
        (line for line in reversed(lines) if re.match(r"^[\w.]*(Error|Exception|Fault|Timeout|Interrupted|Refused|"
                                                      r"Mismatch)\b", line) and "ChildFailedError" not in line), None)
    if error is None:
        return first or (lines[-1] if lines else "(empty log)")
    return f"{rank.group(0)}: {error}" if rank else error


# ------------------------------------------------------------------------------ the run-local secret
SECRET_FILE = "launch.secret"


def local_secret_env(cfg: Config) -> tuple[dict[str, str], Path | None]:
    """The environment that hands every site of a one-machine launch the run's secret, and its file.

    Nothing to add when a secret is configured (config, secret_file, ZEROBAND_SECRET) or the run is
    sites.insecure. Else the launcher, which starts every site itself, uses <run_dir>/launch.secret:
    made once (random, mode 0600) and reused by every later launch of the run, so its signed
    checkpoints still verify on resume. It travels in the environment only (never argv, no log)."""
    from zeroband.config import ConfigError, read_secret_file
    from zeroband.trust.secret import SECRET_ENV, resolve_secret

    if cfg.sites.insecure or resolve_secret(cfg.sites.secret) is not None:
        return {}, None
    path = cfg.run_dir / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    try:
        return {SECRET_ENV: read_secret_file(path)}, path
    except ValueError as e:
        raise ConfigError(f"{e} (the launcher's run-local secret; delete it to start the run afresh)") from None


def store_secret_env(cfg: Config, site_env: dict[str, str]) -> dict[str, str]:
    """The store process's secret: the one sites read from the config or a secret_file (not in any
    environment) if set, else `site_env`'s (the run-local one, or none: the store then inherits
    $ZEROBAND_SECRET if the launcher has it)."""
    from zeroband.trust.secret import SECRET_ENV

    return {**site_env, SECRET_ENV: cfg.sites.secret} if cfg.sites.secret else site_env


# ---------------------------------------------------------------- one torchrun job on this terminal
FAILURE_START = re.compile(rb"^(zeroband: error:|Traceback \(most recent call last\)|"
                           + re.escape(torchrun.FIRST_FAILURE.encode()) + rb"|E\d{4} \S+ \d+ torch/distributed/elastic/)")


class TerminalFilter:
    """What of a torchrun job's output reaches the terminal: all of it until the first sign of a
    failure (an error line, a traceback, torchrun's report), none after; the log file keeps it all
    and the caller ends with one line. Pieces end at \\n or \\r, so a progress bar still moves."""

    def __init__(self) -> None:
        self.pending: dict[int, bytes] = {}
        self.failed = False

    def feed(self, stream: int, data: bytes) -> bytes:
        pieces = re.split(rb"(?<=[\r\n])", self.pending.get(stream, b"") + data)
        self.pending[stream] = pieces.pop()  # no terminator yet (b"" when the data ended with one)
        shown = []
        for piece in pieces:
            self.failed = self.failed or bool(FAILURE_START.match(piece.strip()))
            if not self.failed:
                shown.append(piece)
        return b"".join(shown)


def run_job(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> tuple[int, bool]:
    """Run `cmd` (a torchrun job): its output goes to `log_path` and, through `TerminalFilter`, to
    this terminal. SIGTERM and SIGHUP (a closed terminal) are passed on as SIGTERM; SIGINT reaches
    the job from the terminal itself.
    Returns (exit status, whether output was held back)."""
    import selectors

    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, lambda *_: None),
                **{sig: signal.signal(sig, lambda *_: proc.terminate()) for sig in (signal.SIGTERM, signal.SIGHUP)}}
    filt, sel = TerminalFilter(), selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None  # both PIPE
    outs = {proc.stdout.fileno(): sys.stdout.buffer, proc.stderr.fileno(): sys.stderr.buffer}
    for fd in outs:
        sel.register(fd, selectors.EVENT_READ)
    try:
        with open(log_path, "wb") as log_file:
            while sel.get_map():
                for key, _ in sel.select():
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    log_file.write(data)
                    outs[key.fd].write(filt.feed(key.fd, data))
                    outs[key.fd].flush()
        return proc.wait(), filt.failed
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
