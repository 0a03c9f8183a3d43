"""Start S sites x W ranks on one machine: one torchrun job per site, as on real separate sites.

One torchrun spanning all sites would be wrong: its restarts and exit handling would couple the
sites' fates. Here each site is its own process tree; only the global groups join them.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from zeroband import torchrun


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def site_command(config: str, site: int, sites: int, nproc: int, store: str, overrides: list[str]) -> list[str]:
    return [
        *torchrun.command(nproc), "-m", "zeroband.train", config,
        "--diloco.site_rank", str(site), "--diloco.site_count", str(sites), "--diloco.store", store,
        "--diloco.host_store", "false", *overrides,
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


def launch_sites(
    config: str, sites: int, nproc: int, overrides: list[str], log_dir: Path, timeout_s: float | None = None,
    wan: WanLink | None = None, on_started: Callable[[list[subprocess.Popen]], None] | None = None,
    pin_cpus: bool = False,
) -> list[int]:
    """Run every site to completion; returns their exit codes. Site logs go to log_dir/site{s}.log.
    `pin_cpus` gives each site its own share of the CPUs (`site_cpus`)."""
    cpus = site_cpus(sites) if pin_cpus else None
    with site_network(sites, wan) as (store, wrap, site_env):
        def pinned(site: int, cmd: list[str]) -> list[str]:
            return wrap(site, cmd if cpus is None else ["taskset", "-c", cpus[site], *cmd])

        return _run_sites(config, sites, nproc, overrides, log_dir, timeout_s, store, pinned, site_env, on_started)


def _run_sites(config, sites, nproc, overrides, log_dir, timeout_s, store, wrap, site_env, on_started) -> list[int]:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting threads starve the other sites
    procs = []
    for site in range(sites):
        log_file = open(log_dir / f"site{site}.log", "w")
        cmd = wrap(site, site_command(config, site, sites, nproc, store, overrides))
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**env, **site_env(site)},
                                start_new_session=True)
        procs.append((proc, log_file))
    if on_started is not None:
        on_started([p for p, _ in procs])
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p, _ in procs):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sites still running after {timeout_s:.0f} s")
            time.sleep(0.5)
    finally:
        for p, f in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            f.close()
    return [p.returncode for p, _ in procs]
