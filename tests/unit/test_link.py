"""The link model (zeroband/comm/link.py): throughput, streams, wait bounds, and the probe over real
sockets. The emulated-WAN probe is in test_wan.py."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from zeroband.comm.link import (
    MAX_STREAMS,
    PROC_IPV4,
    Link,
    LinkPolicy,
    LinkProbe,
    ProbeError,
    bound_note,
    choose_streams,
    dial_streams,
    kernel_window,
    probe,
    probe_seconds,
    still_measured,
    streams_for,
    throughput,
    transfer_rates,
    wait_bound,
)
from zeroband.config import ConfigError, load_config

MB4 = 4 << 20  # tcp_wmem max on these machines


def test_throughput_is_the_rate_or_the_windows_per_round_trip() -> None:
    # one 4 MB window per 200 ms: 4194304 x 8 / 0.2 = 167.77 Mbit/s, a third of a 500 Mbit/s link
    assert throughput(Link(0.2, 500e6, 1, MB4)) == pytest.approx(167_772_160)
    assert throughput(Link(0.2, 500e6, 4, MB4)) == 500e6  # 4 windows: 671 Mbit/s > the rate
    assert throughput(Link(0.1, 20e6, 1, MB4)) == 20e6  # a slow link is never window-bound
    assert Link(0.2, 500e6).bdp_bytes == pytest.approx(12.5e6)


def test_streams_cover_the_bandwidth_delay_product() -> None:
    assert streams_for(500e6, 0.2, MB4) == 3  # 12.5 MB / 4.19 MB = 2.98
    assert streams_for(500e6, 0.2, MB4 * 2 // 3) == 5  # 12.5 MB / 2.80 MB = 4.47
    assert streams_for(20e6, 0.1, MB4) == 1  # 250 kB
    assert streams_for(2 * MB4 * 8 / 0.2, 0.2, MB4) == 2  # exactly two windows: no third stream
    assert streams_for(100e9, 0.2, MB4) == MAX_STREAMS == 16  # 2.5 GB / 4.19 MB = 596, clamped
    assert streams_for(1e3, 0.001, MB4) == 1


def test_wait_bound_follows_payload_rate_and_rtt() -> None:
    payload = 50e6
    # 20 Mbit/s, 100 ms: 50 MB takes 20 s; 3 x 20 + 4 x 0.1 = 60.4 s
    assert wait_bound(payload, Link(0.1, 20e6, 1, MB4)) == pytest.approx(60.4)
    # 500 Mbit/s on 5 streams: 0.8 s; 3 x 0.8 + 4 x 0.2 = 3.2 s, lifted to the floor
    fast = Link(0.2, 500e6, 5, MB4 * 2 // 3)
    assert wait_bound(payload, fast) == 10.0
    assert wait_bound(payload, fast, floor_s=1.0) == pytest.approx(3.2)
    # the same link on one stream: 167.77 Mbit/s, 2.384 s; 3 x 2.384 + 0.8 = 7.95 s
    assert wait_bound(payload, Link(0.2, 500e6, 1, MB4), floor_s=1.0) == pytest.approx(7.952, abs=1e-3)
    # 5 Mbit/s: 80 s; 3 x 80 + 0.4 = 240.4 s, under the 600 s ceiling; 1 GB would be 4800 s: the ceiling
    slow = Link(0.1, 5e6, 1, MB4)
    assert wait_bound(payload, slow) == pytest.approx(240.4)
    assert wait_bound(1e9, slow, ceiling_s=600.0) == 600.0
    assert wait_bound(payload, slow, factor=2.0, rtts=0) == pytest.approx(160.0)


def test_kernel_window_reads_the_namespace_settings_with_a_fallback(tmp_path: Path) -> None:
    (tmp_path / "tcp_wmem").write_text("4096\t16384\t4194304\n")
    (tmp_path / "tcp_rmem").write_text("4096\t131072\t6291456\n")
    assert kernel_window(tmp_path) == 4194304 * 2 // 3  # 2796202 < 6291456 / 2
    (tmp_path / "tcp_rmem").write_text("4096\t87380\t4194304\n")
    assert kernel_window(tmp_path) == 2097152  # the receiver's half of 4 MB is smaller
    assert kernel_window(tmp_path / "absent") == min(4194304 * 2 // 3, 6291456 // 2)  # Linux's defaults
    wmem = int((PROC_IPV4 / "tcp_wmem").read_text().split()[-1])
    rmem = int((PROC_IPV4 / "tcp_rmem").read_text().split()[-1])
    assert kernel_window() == min(wmem * 2 // 3, rmem // 2)


def test_transfer_rates_use_the_second_half_of_the_time() -> None:
    # 1 MB at t = 0..1 (slow start), then 4 MB over t = 1..2: the steady half carries 4 MB in 1 s
    events = [(0.0, 1)] + [(0.5, 500_000), (1.0, 500_000 - 1)] + [(1.25 + 0.25 * i, 1_000_000) for i in range(4)]
    nbytes, seconds, steady = transfer_rates(events)
    assert (nbytes, seconds) == (5_000_000, 2.0)
    assert steady == pytest.approx(4e6 * 8 / 1.0)
    assert transfer_rates([(1.0, 10)]) == (10, 0.0, 0.0)


def _pair(streams: int, seconds: float = 0.2,
          choose: Callable[[LinkProbe], int] | None = None) -> dict[str, Any]:
    """Both ends of a probe over real connected sockets, each end in its own thread."""
    socks = [socket.socketpair() for _ in range(streams)]
    for a, b in socks:
        a.settimeout(10)
        b.settimeout(10)
    out: dict[str, Any] = {}

    def run(side: str, initiator: bool) -> None:
        mine = [s[0] if initiator else s[1] for s in socks]
        try:
            out[side] = probe(mine, initiator, seconds=seconds, pings=3, choose=choose)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[side] = e
            for s in mine:
                s.close()  # as the transport does: the peer sees the close, not a hang

    threads = [threading.Thread(target=run, args=("init", True)), threading.Thread(target=run, args=("resp", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for a, b in socks:
        a.close()
        b.close()
    return out


def test_probe_measures_both_sides_alike_on_every_stream() -> None:
    out = _pair(3)
    init, resp = out["init"], out["resp"]
    assert isinstance(init, LinkProbe) and isinstance(resp, LinkProbe), out
    assert init == resp
    assert init.streams == 3 and init.pings == 3 and init.bytes > 0
    assert 0 < init.rtt_min_s <= init.rtt_s < 0.5
    assert init.steady_bps > 0 and init.throughput_bps == pytest.approx(init.bytes * 8 / init.seconds)
    rec = init.record(50e6, factor=2.0, floor_s=1.0, ceiling_s=30.0)
    assert rec["wait_bound_s"] == wait_bound(50e6, init.link(), 2.0, 1.0, 30.0)
    assert rec["streams"] == 3 and rec["rtt_ms"] == pytest.approx(1e3 * init.rtt_s)


def test_probe_refuses_a_stranger_that_sends_garbage() -> None:
    a, b = socket.socketpair()
    b.settimeout(5)
    a.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(100))
    with pytest.raises(ProbeError, match="the peer sent something else than a 'H' or 'K' message"):
        probe([b], initiator=False)
    a.close()
    b.close()


def test_wait_keys_are_checked_in_one_line() -> None:
    cfg = load_config("configs/demo_diloco.toml", ["--sites.timeout_floor_s", "5", "--sites.wait_factor", "2"])
    assert (cfg.sites.timeout_floor_s, cfg.sites.wait_factor) == (5.0, 2.0)
    # a floor above timeout_s is not an error: the ceiling wins (wait_bound clamps to timeout_s), so a
    # short timeout_s in a dumped config reloads as it was written
    assert load_config("configs/demo_diloco.toml", ["--sites.timeout_floor_s", "700"]).sites.timeout_floor_s == 700
    with pytest.raises(ConfigError, match=r"sites.wait_factor: Input should be greater than or equal to 1"):
        load_config("configs/demo_diloco.toml", ["--sites.wait_factor", "0.5"])


def test_auto_streams_dial_enough_to_probe_and_keep_what_covers_the_link() -> None:
    assert dial_streams("auto", 3.0) == MAX_STREAMS and dial_streams("auto", 0.0) == 1 and dial_streams(4, 3.0) == 4
    # 500 Mbit/s measured at 200 ms on 16 streams: 12.5 MB in flight / 2.8 MB windows -> 5 streams
    measured = LinkProbe(0.2, 0.2, 5, MAX_STREAMS, 2_796_202, 10**8, 2.0, 4e8, 500e6)
    assert choose_streams("auto", measured) == 5 and choose_streams(2, measured) == 2
    # a loopback-like link: one window covers it; a 10 Gbit/s link cannot get more than was probed
    assert choose_streams("auto", replace(measured, rtt_s=1e-3, rtt_min_s=1e-4, steady_bps=5e9)) == 1
    assert choose_streams("auto", replace(measured, steady_bps=10e9)) == MAX_STREAMS


def test_the_probe_lasts_fifteen_round_trips_within_its_cap() -> None:
    assert probe_seconds(1e-4, 3.0) == 0.2  # loopback: the floor
    assert probe_seconds(0.1, 3.0) == pytest.approx(1.5) and probe_seconds(0.2, 3.0) == 3.0
    assert probe_seconds(0.2, 1.0) == 1.0  # sites.probe_s caps it


def test_bound_note_spells_out_the_arithmetic() -> None:
    link = Link(0.2, 500e6, 5, 2_796_202)
    note = bound_note(50e6, link, 3.0, 1.0, 600.0)
    assert note == "3 x 0.80 s for 50.00 MB at 500 Mbit/s + 4 x 200 ms RTT"  # 3.2 s
    assert bound_note(1e3, link, 3.0, 10.0, 600.0).endswith("RTT, raised to sites.timeout_floor_s")
    assert bound_note(1e12, link, 3.0, 10.0, 600.0).endswith("RTT, cut to sites.timeout_s")


def test_the_vote_wait_is_the_bound_of_the_largest_payload_over_the_slowest_link() -> None:
    from zeroband.comm.group import GlobalGroup
    from zeroband.watchdog import Watch

    fast = LinkProbe(0.01, 0.01, 5, 1, 2_796_202, 10**8, 1.0, 1e9, 1e9)
    slow = replace(fast, rtt_s=0.1, steady_bps=1e8)
    policy = LinkPolicy("auto", 3.0, 3.0, 1.0)
    group = GlobalGroup(None, 0, 3, watch=Watch(600.0), links={1: fast, 2: slow}, policy=policy)  # type: ignore[arg-type]
    assert group.settle_bound() == 1.0  # nothing waited for yet: the floor
    group.bound(1, 4e6)
    group.bound(1, 50e6)  # an all-reduce's "sends to drain": its whole uplink
    assert group.settle_bound() == wait_bound(50e6, slow.link(), 3.0, 1.0, 600.0) == pytest.approx(12.4)
    assert GlobalGroup(None, 0, 2, watch=Watch(600.0)).settle_bound() is None  # type: ignore[arg-type]  # not measured


def test_probe_agrees_on_the_streams_the_initiator_chose() -> None:
    out = _pair(4, choose=lambda r: 3)
    assert out["init"].chosen == out["resp"].chosen == 3, out
    assert out["init"].record()["streams_used"] == 3


def test_streams_auto_is_the_default_and_a_bad_value_is_one_line() -> None:
    cfg = load_config("configs/demo_diloco.toml", [])
    assert cfg.sites.streams == "auto" and cfg.sites.probe_s == 3.0
    assert load_config("configs/demo_diloco.toml", ["--sites.streams", "4"]).sites.streams == 4
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo_diloco.toml", ["--sites.streams", "many"])
    problems = str(e.value).splitlines()[1:]
    assert len(problems) == 1 and 'sites.streams: Value error, use "auto"' in problems[0], e.value


def test_a_probe_is_taken_again_only_while_the_round_trip_holds_on_the_same_streams() -> None:
    known = LinkProbe(0.2, 0.2, 5, 16, 4 << 20, 10 << 20, 2.0, 5e7, 6e7, chosen=4)
    assert still_measured(known, 0.21, 4) and still_measured(known, 0.11, 4) and still_measured(known, 0.39, 4)
    assert not still_measured(known, 0.45, 4) and not still_measured(known, 0.09, 4)  # moved by more than 2x
    assert not still_measured(known, 0.2, 3)  # other streams than the probe kept
    assert not still_measured(None, 0.2, 4) and not still_measured(known, None, 4)
    lan = replace(known, rtt_s=1e-4, rtt_min_s=1e-4)
    assert still_measured(lan, 4e-3, 4) and not still_measured(lan, 8e-3, 4)  # a floor for tiny round trips
    assert dial_streams("auto", 3.0, known) == 4 and dial_streams("auto", 3.0) == 16 and dial_streams(2, 3.0, known) == 2
