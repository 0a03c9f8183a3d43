"""WAN emulator: teardown, and that the links deliver the configured delay, rate and loss."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from zeroband.comm.link import Link, wait_bound
from zeroband.wan import WanEmulator, cleanup_stale
from zeroband.wan.emulator import list_namespaces
from zeroband.wan.measure import measure_link, measure_loss, measure_rtt, measure_throughput


def _netns_usable() -> str | None:
    """Why the emulator cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` unavailable"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    return None


REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(_netns_usable() is not None, reason=str(_netns_usable())), pytest.mark.serial]  # times the emulated link


def _leftovers(tag_prefix: str, tun_prefix: str) -> list[str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [ns for ns in list_namespaces() if ns.startswith(tag_prefix)] + [
        line for line in links.splitlines() if tun_prefix in line
    ]


def _assert_clean(wan: WanEmulator, forwarder_pid: int | None) -> None:
    assert _leftovers(wan.tag, f"zt{os.getpid():x}_{wan._k % 100}_") == []
    if forwarder_pid is not None:
        with pytest.raises(ProcessLookupError):
            os.kill(forwarder_pid, 0)


@pytest.mark.parametrize("backend,delay", [("tun", 1.0), ("veth", 0.0)])
def test_teardown_normal_and_on_exception(backend: str, delay: float) -> None:
    with WanEmulator(2, rate_mbit=100, delay_ms=delay, backend=backend) as wan:
        assert wan.backend == backend
        assert {wan.site_ns(0), wan.site_ns(1)} <= set(list_namespaces())
        pid = wan._forwarder.pid if wan._forwarder else None
        assert measure_rtt(wan, 0, 1, count=3).lost == 0
    _assert_clean(wan, pid)

    with pytest.raises(RuntimeError, match="boom"), WanEmulator(2, rate_mbit=None, delay_ms=delay, backend=backend) as wan:
        pid = wan._forwarder.pid if wan._forwarder else None
        raise RuntimeError("boom")
    _assert_clean(wan, pid)


# SIGINT restored to Python's handler: a shell without job control (CI in the background) starts
# children with SIGINT ignored, and then there is no KeyboardInterrupt to unwind the with-block.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from zeroband.wan import WanEmulator
    with WanEmulator(2, rate_mbit=10, delay_ms=5, name=sys.argv[1]) as wan:
        print(wan._forwarder.pid, flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_teardown_when_killed(signum: int) -> None:
    """SIGTERM/SIGINT unwind the with-block; after SIGKILL the forwarder exits by itself and
    cleanup_stale() removes the namespaces left behind."""
    name = f"zbt{signum}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, name], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    forwarder = int(proc.stdout.readline())
    proc.send_signal(signum)
    proc.wait(15)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{forwarder}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{forwarder}")
    mine = [ns for ns in list_namespaces() if ns.startswith(f"{name}-{proc.pid}-")]
    if signum == signal.SIGKILL:
        assert len(mine) == 2
        assert sorted(cleanup_stale(name)) == sorted(mine)
    assert [ns for ns in list_namespaces() if ns.startswith(f"{name}-{proc.pid}-")] == []


def test_rtt_is_twice_the_delay() -> None:
    with WanEmulator(2, rate_mbit=100, delay_ms=20) as wan:
        rtt = measure_rtt(wan, 1, 0, count=10)
    assert abs(rtt.median_ms - 40) <= 0.2 * 40 + 2, rtt


@pytest.mark.parametrize("delay", [0.0, 5.0])  # 0: kernel-only veth path; 5: through the forwarder
def test_throughput_is_capped_at_rate(delay: float) -> None:
    with WanEmulator(2, rate_mbit=50, delay_ms=delay) as wan:
        r = measure_throughput(wan, 1, 0, nbytes=10_000_000)
    assert 40 <= r.mbit <= 55, r
    assert r.wire_tx_bytes >= r.payload_bytes  # the counter sees payload plus headers


@pytest.mark.parametrize("streams", [1, 4])
def test_link_probe_reports_the_emulated_rate_and_rtt(streams: int) -> None:
    """zeroband.comm.link's probe, on 1 and 4 streams, sees 20 Mbit/s and 100 ms."""
    with WanEmulator(2, rate_mbit=20, delay_ms=50) as wan:
        r = measure_link(wan, 1, 0, streams=streams, seconds=3.0)
    assert r["streams"] == streams and r["pings"] == 5
    assert abs(r["rtt_ms"] - 100) <= 20, r
    assert abs(r["steady_mbit"] - 20) <= 4, r
    assert r["streams_needed"] == 1  # 250 kB in flight: one window covers it


def test_loss_is_measurable() -> None:
    with WanEmulator(2, rate_mbit=None, delay_ms=1, loss_pct=10) as wan:
        loss = measure_loss(wan, 1, 0, count=2000)
    assert 5 <= loss.loss_pct <= 15, loss


GLOO_WORKER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    rank, host, port, numel = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    timeout = timedelta(seconds=60)
    store = dist.TCPStore(host, port, 2, rank == 0, timeout=timeout)
    pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
    t = torch.full((numel,), float(rank + 1))
    pg.allreduce([t]).wait()
    assert bool((t == 3).all()), t[:4]
    print("ok", flush=True)
""")


def test_gloo_all_reduce_crosses_the_link() -> None:
    numel = 2_000_000  # 8 MB of float32
    with WanEmulator(2, rate_mbit=400, delay_ms=2) as wan:
        before = [wan.iface_bytes(i)["tx_bytes"] for i in range(2)]
        procs = [
            subprocess.Popen(
                wan.wrap(i, [sys.executable, "-c", GLOO_WORKER, str(i), wan.site_ip(0), "29500", str(numel)]),
                env={**os.environ, **wan.env(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        sent = [wan.iface_bytes(i)["tx_bytes"] - b for i, b in zip(range(2), before)]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(sent) >= numel * 4, sent
    assert min(sent) >= numel * 4 // 2, sent  # both directions carried half the tensor or more


def _link_allreduce() -> Any:
    spec = importlib.util.spec_from_file_location("link_allreduce", REPO / "scripts/wan/link_allreduce.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_slow_live_link_is_never_declared_dead() -> None:
    """5 Mbit/s, 50 ms RTT, floor 0.5 s: every piece takes ~1.7 s on the wire, three times the floor,
    so only bounds derived from the measured link (3 x 1.7 s + 4 RTT) let the all-reduce finish. The
    probe at connect sees the rate; the rounds' bounds are in their records."""
    with WanEmulator(2, rate_mbit=5, delay_ms=25) as wan:
        out = _link_allreduce().run_pair(wan, ["--numel", "1000000", "--rounds", "2", "--probe-s", "1",
                                               "--floor-s", "0.5", "--timeout-s", "60"], timeout_s=100)
    for site in out:
        rounds, link = site[:-1], site[-1]["link"][0]
        assert [r["round"] for r in rounds] == [0, 1], site
        assert 3.5 <= link["steady_mbit"] <= 5.5 and 40 <= link["rtt_ms"] <= 80 and link["streams_used"] == 1, link
        measured = Link(link["rtt_ms"] / 1e3, link["steady_mbit"] * 1e6, link["streams_used"], link["window_bytes"])
        for r in rounds:  # each piece took ~1.7 s, more than 3x the floor: the bound followed the link
            # the round's longest wait: the review's statistics, bounded as for the whole scatter at fp32
            assert r["seconds"] > 2.0 and r["wait_bound_s"] == pytest.approx(wait_bound(4e6, measured, 3.0, 0.5, 60)), r
            assert r["wait_bound_s"] > 10.0, r


def test_site_tcp_settings_are_per_namespace() -> None:
    """The sites run with tcp_slow_start_after_idle 0 unless asked for Linux's default 1; the host's own
    setting is left as it was (both are per namespace)."""
    host = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip()
    with WanEmulator(2, rate_mbit=None) as wan:
        assert wan.tcp_settings(1)["net.ipv4.tcp_slow_start_after_idle"] == "0"
    with WanEmulator(2, rate_mbit=None, slow_start_after_idle=True) as wan:
        tcp = wan.tcp_settings(0)
        assert tcp["net.ipv4.tcp_slow_start_after_idle"] == "1" and tcp["net.ipv4.tcp_congestion_control"]
    assert Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip() == host
