"""Measure what the emulated WAN delivers: TCP throughput, round-trip time and one-way loss.

Each measurement runs a small probe (this module as `python -m zeroband.wan.measure <role>`,
no torch import, starts in ~50 ms) inside the two site namespaces: the server in `dst` prints
`ready` once bound, then the client runs in `src`. Results come back as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

CHUNK = 1 << 20


class Sites(Protocol):
    """What the helpers need from a `WanEmulator`."""

    def site_ip(self, i: int) -> str: ...
    def wrap(self, i: int, cmd: list[str]) -> list[str]: ...
    def iface_bytes(self, i: int) -> dict[str, int]: ...


@dataclass
class Throughput:
    mbit: float  # payload bits over the whole transfer, first byte to last (includes slow start)
    steady_mbit: float  # over the second half of the transfer: the rate once TCP has ramped up
    seconds: float
    payload_bytes: int
    wire_tx_bytes: int  # bytes the sender's interface counted, headers and retransmits included


@dataclass
class Rtt:
    min_ms: float
    median_ms: float
    mean_ms: float
    max_ms: float
    lost: int


@dataclass
class Loss:
    sent: int
    received: int

    @property
    def loss_pct(self) -> float:
        return 100.0 * (1 - self.received / self.sent)


# ----- probes (run inside a namespace) --------------------------------------------------------
def tcp_recv(port: int, nbytes: int) -> dict[str, Any]:
    with socket.create_server(("0.0.0.0", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(CHUNK)
            got, t0, t_half = 0, 0.0, 0.0
            while got < nbytes:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                t0 = t0 or time.perf_counter()
                got += n
                t_half = t_half or (time.perf_counter() if got >= nbytes // 2 else 0.0)
            t1 = time.perf_counter()
    return {"bytes": got, "seconds": t1 - t0, "half_seconds": t1 - t_half, "half_bytes": got - got // 2}


def tcp_send(host: str, port: int, nbytes: int) -> dict[str, Any]:
    payload = bytes(CHUNK)
    with socket.create_connection((host, port), timeout=60) as s:
        sent = 0
        while sent < nbytes:
            n = min(CHUNK, nbytes - sent)
            s.sendall(payload[:n])
            sent += n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # wait for the receiver to close: all bytes have arrived
    return {"sent": sent}


def udp_echo(port: int, idle_s: float = 10.0) -> dict[str, Any]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("0.0.0.0", port))
        s.settimeout(idle_s)
        print("ready", flush=True)
        echoed = 0
        while True:
            try:
                data, addr = s.recvfrom(2048)
            except TimeoutError:
                break
            if data == b"quit":
                break
            s.sendto(data, addr)
            echoed += 1
    return {"echoed": echoed}


def udp_ping(host: str, port: int, count: int, timeout_s: float) -> dict[str, Any]:
    rtts, lost = [], 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        for seq in range(count):
            t0 = time.perf_counter()
            s.sendto(struct.pack("!Q", seq), (host, port))
            try:
                while struct.unpack("!Q", s.recv(64)[:8])[0] != seq:
                    pass  # a late reply to an earlier probe
                rtts.append((time.perf_counter() - t0) * 1e3)
            except TimeoutError:
                lost += 1
        s.sendto(b"quit", (host, port))
    return {"rtts_ms": rtts, "lost": lost}


def udp_sink(port: int, idle_s: float = 2.0) -> dict[str, Any]:
    seen: set[int] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind(("0.0.0.0", port))
        s.settimeout(idle_s)
        print("ready", flush=True)
        while True:
            try:
                data = s.recv(2048)
            except TimeoutError:
                break
            if data.startswith(b"end"):
                break
            seen.add(struct.unpack("!Q", data[:8])[0])
    return {"received": len(seen)}


def udp_blast(host: str, port: int, count: int, interval_s: float, size: int = 200) -> dict[str, Any]:
    pad = bytes(max(0, size - 8))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for seq in range(count):
            s.sendto(struct.pack("!Q", seq) + pad, (host, port))
            time.sleep(interval_s)  # paced: we measure the link's loss, not socket-buffer overflow
        for _ in range(20):  # several end markers: any one of them may be lost too
            s.sendto(b"end", (host, port))
            time.sleep(0.01)
    return {"sent": count}


# ----- helpers (run by the parent, outside the namespaces) ------------------------------------
def _probe(*args: object) -> list[str]:
    return [sys.executable, "-m", "zeroband.wan.measure", *map(str, args)]


def run_pair(sites: Sites, src: int, dst: int, server: list[str], client: list[str], timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Server probe in `dst`, client probe in `src`; returns both JSON results."""
    srv = subprocess.Popen(sites.wrap(dst, server), stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        if srv.stdout.readline().strip() != "ready":
            raise RuntimeError("measurement server failed to start")
        cli = subprocess.run(sites.wrap(src, client), capture_output=True, text=True, timeout=timeout_s, check=True)
        out, _ = srv.communicate(timeout=timeout_s)
        return json.loads(out.strip().splitlines()[-1]), json.loads(cli.stdout.strip().splitlines()[-1])
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def measure_throughput(sites: Sites, src: int, dst: int, nbytes: int = 20_000_000, port: int = 5201) -> Throughput:
    tx0 = sites.iface_bytes(src)["tx_bytes"]
    srv, _ = run_pair(sites, src, dst, _probe("tcp-recv", port, nbytes),
                      _probe("tcp-send", sites.site_ip(dst), port, nbytes), timeout_s=300)
    wire = sites.iface_bytes(src)["tx_bytes"] - tx0
    return Throughput(
        mbit=srv["bytes"] * 8 / srv["seconds"] / 1e6, steady_mbit=srv["half_bytes"] * 8 / srv["half_seconds"] / 1e6,
        seconds=srv["seconds"], payload_bytes=srv["bytes"], wire_tx_bytes=wire,
    )


def measure_rtt(sites: Sites, src: int, dst: int, count: int = 20, port: int = 5202, timeout_s: float = 2.0) -> Rtt:
    _, cli = run_pair(sites, src, dst, _probe("udp-echo", port),
                      _probe("udp-ping", sites.site_ip(dst), port, count, timeout_s), timeout_s=60 + count * timeout_s)
    rtts = cli["rtts_ms"] or [float("nan")]
    return Rtt(min(rtts), statistics.median(rtts), statistics.fmean(rtts), max(rtts), cli["lost"])


def measure_loss(sites: Sites, src: int, dst: int, count: int = 2000, interval_s: float = 0.0002, port: int = 5203) -> Loss:
    """One-way datagram loss src -> dst (an echo would compound both directions' loss)."""
    srv, cli = run_pair(sites, src, dst, _probe("udp-sink", port),
                        _probe("udp-blast", sites.site_ip(dst), port, count, interval_s), timeout_s=120)
    return Loss(sent=cli["sent"], received=srv["received"])


def measure_link(sites: Sites, src: int, dst: int, streams: int = 1, seconds: float = 2.0, port: int = 5204) -> dict[str, Any]:
    """zeroband.comm.link's probe from `src` (it sends) to `dst` on `streams` connections: its JSON
    (LinkProbe fields and its `link` record)."""
    def cmd(role: str) -> list[str]:
        return [sys.executable, "-m", "zeroband.comm.link", role, sites.site_ip(dst), str(port),
                "--streams", str(streams), "--seconds", str(seconds)]
    _, cli = run_pair(sites, src, dst, cmd("server"), cmd("client"), timeout_s=60 + 2 * seconds)
    return cli


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="WAN measurement probes (run inside a site namespace)")
    sub = p.add_subparsers(dest="role", required=True)
    for role, fields in {
        "tcp-recv": ["port", "nbytes"], "tcp-send": ["host", "port", "nbytes"], "udp-echo": ["port"],
        "udp-ping": ["host", "port", "count", "timeout_s"], "udp-sink": ["port"],
        "udp-blast": ["host", "port", "count", "interval_s"],
    }.items():
        sp = sub.add_parser(role)
        for f in fields:
            sp.add_argument(f, type={"host": str, "timeout_s": float, "interval_s": float}.get(f, int))
    args = vars(p.parse_args(argv))
    role = args.pop("role")
    probes: dict[str, Callable[..., Any]] = {"tcp-recv": tcp_recv, "tcp-send": tcp_send, "udp-echo": udp_echo,
                                             "udp-ping": udp_ping, "udp-sink": udp_sink, "udp-blast": udp_blast}
    fn = probes[role]
    print(json.dumps(fn(**args)), flush=True)


if __name__ == "__main__":
    main()
