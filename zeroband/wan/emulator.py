"""Emulate a WAN between S sites on one Linux machine with network namespaces.

Every site gets its own network namespace `<name>-<pid>-<k>-s<i>` holding `lo` and one interface
`wan0` with address 10.77.<i>.1/16; processes started through `wrap(i, cmd)` see only that
namespace, so anything they send to another site's address crosses the emulated link. Nothing
is added to the root namespace except, briefly, the TUN devices before they are moved (tun
backend); the 10.77/16 addresses exist only inside our namespaces.

Packet paths, by backend (`backend="auto"` picks the first that can emulate the request):

- **veth** (rate only, no delay/jitter/loss): site `wan0` --veth--> `s<i>` on bridge `br0` in a
  hub namespace `<...>-hub` --veth--> other site's `wan0`. Kernel-only, so no throughput ceiling.
- **netem** (kernel has sch_netem): same veth/bridge topology; each `wan0` egress gets
  `netem delay D [J] loss L rate R`, so the round trip between two sites is 2 x D.
- **tun** (no sch_netem, as on this machine): each `wan0` is a TUN device whose other end is a
  file descriptor in one forwarder process (`zeroband.wan.forwarder`): site A's stack -> tbf on
  A's `wan0` (rate cap of A's uplink) -> forwarder (loss, then a heap releasing packets at
  now + D +- J, order kept per link) -> write into B's TUN -> B's stack. The forwarder is
  user-space Python, one packet per system call, so it has a ceiling of its own (benchmarks/wan.md,
  "Emulator ceiling"); at MTU 1500 six times the packets per byte, so keep the MTU large for fast links.

In all cases the rate limit is per site egress: each site's uplink is capped at `rate_mbit`.
Teardown (normal exit, exception, SIGINT, SIGTERM) stops the forwarder, which destroys the TUN
devices, kills what still runs inside our namespaces and deletes the namespaces (which deletes
the veths). A run killed with SIGKILL leaves namespaces behind: `cleanup_stale()` removes those
whose owner PID is gone (the forwarder exits by itself when its owner's pipe closes).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
from types import FrameType, TracebackType

IFNAME = "wan0"
SUBNET_PREFIX = 16
_instances = itertools.count()  # several emulators in one process must not share names
_netem_ok: bool | None = None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_namespace(ns: str) -> None:
    """Kill what still runs inside `ns` (only our runs start processes there), then delete it."""
    pids = ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    ip("netns", "del", ns, check=False)


def cleanup_stale(prefix: str = "zb") -> list[str]:
    """Delete namespaces `<prefix>-<pid>-...` whose owner PID is dead; returns their names."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    stale = [ns for ns in list_namespaces() if (m := pattern.match(ns)) and not _pid_alive(int(m.group(1)))]
    for ns in stale:
        delete_namespace(ns)
    return stale


def netem_available(prefix: str = "zb") -> bool:
    """Whether `tc ... netem` works, probed once in a throwaway namespace (never the root one)."""
    global _netem_ok
    if _netem_ok is None:
        ns = f"{prefix}-{os.getpid()}-{next(_instances)}-probe"
        ip("netns", "add", ns)
        try:
            _netem_ok = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False).returncode == 0
        finally:
            delete_namespace(ns)
    return _netem_ok


def tbf_args(rate_mbit: float, mtu: int, delay_ms: float) -> list[str]:
    """tbf with a queue of about one bandwidth-delay product (at least 50 ms): the usual router
    buffer rule, so TCP can fill a long pipe without the queue itself adding seconds of delay."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(4 * mtu, int(rate_bytes * 0.004))
    limit = max(burst + 4 * mtu, int(rate_bytes * max(0.05, 2 * delay_ms / 1e3)))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


class WanEmulator:
    """`with WanEmulator(2, rate_mbit=100, delay_ms=50) as wan: subprocess.run(wan.wrap(0, cmd), env=...)`."""

    ifname = IFNAME

    def __init__(
        self, sites: int, rate_mbit: float | None, delay_ms: float = 0, jitter_ms: float = 0,
        loss_pct: float = 0, mtu: int = 9000, name: str = "zb", backend: str = "auto",
        slow_start_after_idle: bool = False, congestion: str | None = None,
    ) -> None:
        if not 1 <= sites <= 250:
            raise ValueError("sites must be in 1..250")
        self.sites, self.rate_mbit, self.mtu, self.name = sites, rate_mbit, mtu, name
        self.delay_ms, self.jitter_ms, self.loss_pct = delay_ms, jitter_ms, loss_pct
        self.requested_backend = backend
        # TCP inside the sites' namespaces: net.ipv4.tcp_slow_start_after_idle (Linux's default is 1;
        # off by default here, as a tuned WAN site sets it) and tcp_congestion_control (None: the host's)
        self.slow_start_after_idle, self.congestion = slow_start_after_idle, congestion
        self.backend = ""
        self._k = next(_instances)
        self.tag = f"{name}-{os.getpid()}-{self._k}"
        self._namespaces: list[str] = []
        self._forwarder: subprocess.Popen[str] | None = None
        self._saved_handlers: dict[int, object] = {}
        self.forwarder_stats = ""  # the tun forwarder's packet counts, once it has stopped

    # ----- addressing and process helpers -------------------------------------------------
    def site_ns(self, i: int) -> str:
        return f"{self.tag}-s{i}"

    def site_ip(self, i: int) -> str:
        return f"10.77.{i}.1"

    def store_url(self, port: int = 29500) -> str:
        """A TCPStore address hosted in site 0's namespace (its namespace is fresh: any port is free)."""
        return f"tcp://{self.site_ip(0)}:{port}"

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.site_ns(i), *cmd]

    def env(self, i: int) -> dict[str, str]:
        """Variables to add to a site process's environment (merge with os.environ)."""
        return {
            "GLOO_SOCKET_IFNAME": IFNAME,  # gloo would otherwise pick an address by hostname lookup
            "TP_SOCKET_IFNAME": IFNAME,
            "NCCL_SOCKET_IFNAME": IFNAME,
            "ZB_WAN_SITE": str(i),
            "ZB_WAN_SITE_IP": self.site_ip(i),
            "ZB_WAN_STORE": self.store_url(),
        }

    def iface_bytes(self, i: int) -> dict[str, int]:
        """Bytes counted by site i's `wan0` (IP packets as they cross the emulated link)."""
        out = ip("-n", self.site_ns(i), "-j", "-s", "link", "show", "dev", IFNAME).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"]}

    def tcp_settings(self, i: int = 0) -> dict[str, str]:
        """The TCP settings site i's connections run with, read back from inside its namespace."""
        keys = ("net.ipv4.tcp_congestion_control", "net.ipv4.tcp_slow_start_after_idle")
        out = _run(["ip", "netns", "exec", self.site_ns(i), "sysctl", *keys], check=False).stdout
        return dict(line.replace(" ", "").split("=", 1) for line in out.splitlines() if "=" in line)

    # ----- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> WanEmulator:
        self._install_signal_handlers()
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def choose_backend(self) -> str:
        if self.requested_backend != "auto":
            return self.requested_backend
        if not (self.delay_ms or self.jitter_ms or self.loss_pct):
            return "veth"
        return "netem" if netem_available(self.name) else "tun"

    def start(self) -> None:
        self.backend = self.choose_backend()
        for i in range(self.sites):
            self._add_namespace(self.site_ns(i))
            ip("-n", self.site_ns(i), "link", "set", "lo", "up")
        if self.backend == "tun":
            self._start_tun()
        else:
            self._start_veth()
        for i in range(self.sites):
            self._configure_site(i)

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)  # recorded at once so a failure later still deletes it

    def _start_veth(self) -> None:
        hub = f"{self.tag}-hub"
        self._add_namespace(hub)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "mtu", str(self.mtu), "up")
        for i in range(self.sites):
            port = f"s{i}"
            # both ends are created in our namespaces directly: the root namespace never sees them
            _run(["ip", "-n", hub, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", IFNAME, "netns", self.site_ns(i)])
            ip("-n", hub, "link", "set", port, "master", "br0", "up")

    def _start_tun(self) -> None:
        tuns = [f"zt{os.getpid():x}_{self._k % 100}_{i}" for i in range(self.sites)]
        cmd = [sys.executable, "-m", "zeroband.wan.forwarder", "--delay-ms", str(self.delay_ms),
               "--jitter-ms", str(self.jitter_ms), "--loss-pct", str(self.loss_pct)]
        for i, tun in enumerate(tuns):
            cmd += ["--tun", tun, "--ip", self.site_ip(i)]
        # own session: a terminal's Ctrl-C reaches us, and we tear the forwarder down in order
        self._forwarder = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True, start_new_session=True)
        assert self._forwarder.stdout is not None
        if self._forwarder.stdout.readline().strip() != "ready":
            raise RuntimeError(f"WAN forwarder failed to start (exit code {self._forwarder.wait(5)})")
        for i, tun in enumerate(tuns):
            ip("link", "set", tun, "netns", self.site_ns(i))
            ip("-n", self.site_ns(i), "link", "set", tun, "name", IFNAME)

    def _configure_site(self, i: int) -> None:
        ns = self.site_ns(i)
        # no IPv6: router solicitations would otherwise show up in the byte counters
        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{IFNAME}.disable_ipv6=1"], check=False)
        # Long-haul tuning a WAN site would apply (unless asked for Linux's default): an idle connection
        # between outer steps keeps its congestion window instead of slow-starting again every round.
        # Both settings are per namespace: the host's own are never touched.
        ssai = f"net.ipv4.tcp_slow_start_after_idle={int(self.slow_start_after_idle)}"
        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", ssai], check=False)
        if self.congestion:
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.congestion}"])
        ip("-n", ns, "addr", "add", f"{self.site_ip(i)}/{SUBNET_PREFIX}", "dev", IFNAME)
        ip("-n", ns, "link", "set", IFNAME, "mtu", str(self.mtu), "up")
        qdisc = self._qdisc()
        if qdisc:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *qdisc])

    def _qdisc(self) -> list[str]:
        if self.backend == "netem":
            args = ["netem", "limit", "1000000", "delay", f"{self.delay_ms}ms"]
            args += [f"{self.jitter_ms}ms"] if self.jitter_ms else []
            args += ["loss", f"{self.loss_pct}%"] if self.loss_pct else []
            return args + (["rate", f"{self.rate_mbit}mbit"] if self.rate_mbit else [])
        return tbf_args(self.rate_mbit, self.mtu, self.delay_ms) if self.rate_mbit else []

    def close(self) -> None:
        """Idempotent teardown; SIGINT/SIGTERM are held off meanwhile so it cannot be cut short."""
        blocked = self._block_signals()
        try:
            self._stop_forwarder()
            while self._namespaces:
                delete_namespace(self._namespaces.pop())
        finally:
            self._restore_signals(blocked)

    def _stop_forwarder(self) -> None:
        proc, self._forwarder = self._forwarder, None
        if proc is None:
            return
        try:
            _, err = proc.communicate(timeout=5)  # closing its stdin is its signal to exit
            self.forwarder_stats = err.strip()
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # ----- signals: turn SIGTERM into an exception so `with` blocks unwind and clean up -----
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._saved_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, _raise_sigterm)

    def _block_signals(self) -> set[int | signal.Signals]:
        if threading.current_thread() is not threading.main_thread():
            return set()
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

    def _restore_signals(self, previous: set[int | signal.Signals]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._saved_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._saved_handlers.clear()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _raise_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
