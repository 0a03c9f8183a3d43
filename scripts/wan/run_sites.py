#!/usr/bin/env python
"""Run one command per site, each inside its own emulated-WAN network namespace.

    python scripts/wan/run_sites.py --sites 2 --rate-mbit 100 --delay-ms 50 -- \\
        python -m zeroband.train cfg.toml --sites.site_rank {site} --sites.site_count {sites} \\
        --sites.store {store}

Placeholders in the command: {site} (0..S-1), {sites}, {store} (tcp://<site 0 ip>:<port>, a
TCPStore that site 0's process hosts inside its namespace) and {ip} (this site's address). Each
site process gets GLOO_SOCKET_IFNAME=wan0 so gloo binds to the emulated link.

    python scripts/wan/run_sites.py --selftest --rate-mbit 100 --delay-ms 50

measures RTT and TCP throughput between two sites and prints them next to the configuration.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from zeroband.wan import WanEmulator, cleanup_stale
from zeroband.wan.measure import measure_loss, measure_rtt, measure_throughput


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=None, help="per-site uplink cap (default: none)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay; RTT is twice this")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss-pct", type=float, default=0.0)
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--backend", choices=["auto", "veth", "netem", "tun"], default="auto")
    p.add_argument("--store-port", type=int, default=29500)
    p.add_argument("--timeout", type=float, default=None, help="seconds before the sites are killed")
    p.add_argument("--selftest", action="store_true", help="measure the emulated link and exit")
    p.add_argument("--selftest-mbytes", type=float, default=30.0)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the per-site command template")
    args = p.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.selftest and not args.command:
        p.error("give a command after `--`, or --selftest")
    return args


def render(template: list[str], wan: WanEmulator, site: int, store_port: int) -> list[str]:
    """str.replace, not str.format: the command may contain other braces (JSON, shell)."""
    values = {"{site}": str(site), "{sites}": str(wan.sites), "{store}": wan.store_url(store_port), "{ip}": wan.site_ip(site)}
    out = []
    for arg in template:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each still-running site's process group (its own session), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_sites(wan: WanEmulator, template: list[str], store_port: int, timeout_s: float | None) -> list[int]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for site in range(wan.sites):
            cmd = wan.wrap(site, render(template, wan, site, store_port))
            env = {**os.environ, **wan.env(site)}
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if deadline is not None and time.monotonic() > deadline:
                print(f"run_sites: sites still running after {timeout_s:.0f} s, stopping them", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        stop(procs)
    return [p.returncode for p in procs]


def selftest(wan: WanEmulator, mbytes: float) -> None:
    rtt = measure_rtt(wan, 1, 0, count=20)
    tput = measure_throughput(wan, 1, 0, nbytes=int(mbytes * 1e6))
    rate = "unlimited" if wan.rate_mbit is None else f"{wan.rate_mbit:g}"
    print(f"backend={wan.backend} mtu={wan.mtu} jitter={wan.jitter_ms:g} ms loss={wan.loss_pct:g} %")
    print(f"{'metric':<28}{'configured':>14}{'measured':>14}")
    print(f"{'RTT median (min) ms':<28}{2 * wan.delay_ms:>14g}{rtt.median_ms:>8.2f} ({rtt.min_ms:.2f})")
    print(f"{'TCP Mbit/s, whole transfer':<28}{rate:>14}{tput.mbit:>14.1f}")
    print(f"{'TCP Mbit/s, second half':<28}{rate:>14}{tput.steady_mbit:>14.1f}")
    print(f"{'payload / wire MB':<28}{'':>14}{tput.payload_bytes / 1e6:>7.1f} / {tput.wire_tx_bytes / 1e6:.1f}")
    if wan.loss_pct:
        loss = measure_loss(wan, 1, 0)
        print(f"{'one-way UDP loss %':<28}{wan.loss_pct:>14g}{loss.loss_pct:>14.1f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cleanup_stale()
    sites = max(args.sites, 2) if args.selftest else args.sites
    with WanEmulator(sites, args.rate_mbit, args.delay_ms, args.jitter_ms, args.loss_pct, args.mtu, backend=args.backend) as wan:
        if args.selftest:
            selftest(wan, args.selftest_mbytes)
            return 0
        codes = run_sites(wan, args.command, args.store_port, args.timeout)
    print(f"run_sites: exit codes {codes}", file=sys.stderr)
    return max((abs(c) for c in codes), default=0)


if __name__ == "__main__":
    sys.exit(main())
