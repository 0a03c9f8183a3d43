"""Start S sites x W ranks on one machine: one torchrun job per site, as on real separate sites.

One torchrun spanning all sites would be wrong: its restarts and exit handling would couple the
sites' fates. Here each site is its own process tree; only the global groups join them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def site_command(config: str, site: int, sites: int, nproc: int, store: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "zeroband.train", config,
        "--diloco.site_rank", str(site), "--diloco.site_count", str(sites), "--diloco.store", store,
        *overrides,
    ]


def launch_sites(
    config: str, sites: int, nproc: int, overrides: list[str], log_dir: Path, timeout_s: float | None = None
) -> list[int]:
    """Run every site to completion; returns their exit codes. Site logs go to log_dir/site{s}.log."""
    store = f"tcp://127.0.0.1:{free_port()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting threads starve the other sites
    procs = []
    for site in range(sites):
        log_file = open(log_dir / f"site{site}.log", "w")
        cmd = site_command(config, site, sites, nproc, store, overrides)
        procs.append((subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True), log_file))
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
