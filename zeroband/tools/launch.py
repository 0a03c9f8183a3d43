"""Start S sites x W ranks on one machine: one torchrun job per site, as on real separate sites.

One torchrun spanning all sites would be wrong: its restarts and exit handling would couple the
sites' fates. Here each site is its own process tree; only the global groups join them.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroband import torchrun


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def site_command(config: str, site: int, sites: int, nproc: int, store: str, overrides: list[str]) -> list[str]:
    return [
        *torchrun.command(nproc), "-m", "zeroband.train", config,
        "--sites.site_rank", str(site), "--sites.site_count", str(sites), "--sites.store", store,
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
        values: dict[str, float] = {}
        for item in filter(None, spec.split(",")):
            key, _, value = item.partition("=")
            if key not in names or not value:
                raise ValueError(f"--wan item {item!r}: expected one of {sorted(names)} as key=value")
            values[names[key]] = int(value) if key == "mtu" else float(value)
        return cls(**values)


@contextmanager
def site_network(sites: int, wan: WanLink | None) -> Iterator[tuple[str, Callable[[int, list[str]], list[str]], Callable[[int], dict]]]:
    """(store address, command wrapper, extra env) for plain loopback or an emulated WAN.

    The coordination store runs in its own process (not in a site), so any site may die.
    """
    if wan is None:
        port = free_port()
        # gloo listens on the address the host name resolves to unless told an interface.
        gloo = {} if "GLOO_SOCKET_IFNAME" in os.environ else {"GLOO_SOCKET_IFNAME": "lo"}
        with store_process(["127.0.0.1", port], lambda cmd: cmd):
            yield f"tcp://127.0.0.1:{port}", lambda site, cmd: cmd, lambda site: gloo
        return
    from zeroband.wan import WanEmulator

    with WanEmulator(sites, wan.rate_mbit, wan.delay_ms, wan.jitter_ms, wan.loss_pct, wan.mtu) as emu:
        with store_process([emu.site_ip(0), 29600], lambda cmd: emu.wrap(0, cmd)):
            yield emu.store_url(29600), emu.wrap, emu.env


@contextmanager
def store_process(where: list, wrap: Callable[[list[str]], list[str]], timeout_s: float = 60.0) -> Iterator[subprocess.Popen]:
    host, port = where
    cmd = wrap([sys.executable, "-m", "zeroband.membership.store_server", "--host", str(host), "--port", str(port)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_line(proc, "store listening", timeout_s)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_for_line(proc: subprocess.Popen, marker: str, timeout_s: float) -> None:
    """Read the process's output until `marker` (warnings may come first), EOF or the deadline."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:  # EOF: the server died
            break
        if marker in line:
            return
        seen.append(line.strip())
    raise RuntimeError(f"coordination store did not start within {timeout_s:.0f} s: {' | '.join(seen[-5:])}")


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
    """The launcher got SIGTERM/SIGINT; every site was stopped before this was raised."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}; every site was shut down")


def launch_sites(
    config: str, sites: int, nproc: int, overrides: list[str], log_dir: Path, timeout_s: float | None = None,
    wan: WanLink | None = None, on_started: Callable[[list[subprocess.Popen]], None] | None = None,
    pin_cpus: bool = False, progress: Path | None = None, grace_s: float = 40.0,
) -> list[int]:
    """Run every site to completion; returns their exit codes. Site logs go to log_dir/site{s}.log.
    `pin_cpus` gives each site its own share of the CPUs (`site_cpus`). `progress`: a metrics.jsonl
    (site 0's) printed as it grows. SIGTERM/SIGINT are forwarded to every site, which get `grace_s`
    to exit before SIGKILL, then `Stopped` is raised (the store is stopped on the way out)."""
    cpus = site_cpus(sites) if pin_cpus else None
    with site_network(sites, wan) as (store, wrap, site_env):
        def pinned(site: int, cmd: list[str]) -> list[str]:
            return wrap(site, cmd if cpus is None else ["taskset", "-c", cpus[site], *cmd])

        procs = _start_sites(config, sites, nproc, overrides, log_dir, store, pinned, site_env)
        if on_started is not None:
            on_started(procs)
        return Supervisor(procs, log_dir, progress, grace_s).run(timeout_s)


def _start_sites(config, sites, nproc, overrides, log_dir, store, wrap, site_env) -> list[subprocess.Popen]:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting threads starve the other sites
    procs = []
    for site in range(sites):
        with open(log_dir / f"site{site}.log", "w") as log_file:  # the child keeps its own descriptor
            cmd = wrap(site, site_command(config, site, sites, nproc, store, overrides))
            procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                          env={**env, **site_env(site)}, start_new_session=True))
    return procs


class Supervisor:
    """Watches the sites: prints site 0's progress and each failure as it happens, forwards
    SIGTERM/SIGINT to every site's process group, and never leaves a site behind."""

    def __init__(self, procs: list[subprocess.Popen], log_dir: Path, progress: Path | None, grace_s: float) -> None:
        self.procs, self.log_dir, self.grace_s = procs, log_dir, grace_s
        self.progress = progress
        self.offset = progress.stat().st_size if progress is not None and progress.is_file() else 0
        self.reported: set[int] = set()
        self.signum: int | None = None

    def run(self, timeout_s: float | None) -> list[int]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        previous = self._forward_signals()
        try:
            while any(p.poll() is None for p in self.procs) and self.signum is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"sites still running after {timeout_s:.0f} s")
                self._report()
                time.sleep(0.5)
            self._report()
        finally:
            self._stop_all(self.signum or signal.SIGTERM)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.signum is not None:
            raise Stopped(self.signum)
        return [p.returncode for p in self.procs]

    def _forward_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handle(signum: int, frame: Any) -> None:
            self.signum = signum

        return {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _report(self) -> None:
        for line in self._new_progress():
            print(line, flush=True)
        for site, p in enumerate(self.procs):
            code = p.poll()
            if code is not None and site not in self.reported:
                self.reported.add(site)
                if code:
                    text = (self.log_dir / f"site{site}.log").read_text(errors="replace")
                    print(f"site {site} exited with code {code}: {last_error_line(text)}", file=sys.stderr, flush=True)

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
        run in sessions of their own), then SIGKILL to whatever of the tree is left after grace_s."""
        running = [p for p in self.procs if p.poll() is None]
        trees = [descendants(p.pid) for p in running]
        for p in running:
            _killpg(p.pid, sig)
        deadline = time.monotonic() + self.grace_s
        for p, tree in zip(running, trees):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p.pid, signal.SIGKILL)
                p.wait()
            for pid in tree:  # ranks that outlived their torchrun agent
                _kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (empty where there is no /proc)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
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
    try:
        rec = json.loads(raw)
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
    return None


def last_error_line(log_text: str) -> str:
    """The line of a site's log that says why it failed: our one-line error if there is one, else
    the last exception line that is not torchrun's own wrapper, else the last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("zeroband: error:"):
            return line
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Timeout|Interrupted|Refused|Mismatch)\b", line) and \
                "ChildFailedError" not in line:
            return line
    return lines[-1] if lines else "(empty log)"
