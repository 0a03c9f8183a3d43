"""The link between two sites as one model: round trip, rate, parallel streams and the kernel's window.

One TCP stream keeps at most one window of bytes in flight: about two thirds of its sender's send
buffer (tcp_wmem's maximum under autotuning) or what the receiver advertises, whichever is smaller
(`kernel_window`). It therefore delivers at most window / RTT, whatever the link's rate: with the
usual 4 MB send buffer, 112 Mbit/s at 200 ms, 224 Mbit/s at 100 ms. N streams to the same peer keep N windows in flight, so

    throughput = min(rate, streams x window / RTT)

and the streams that fill a link are those that cover its bandwidth-delay product (rate x RTT) with
windows (`streams_for`). `zeroband plan`, the WAN benchmark and the cross-site transport all read
the link through these functions, so a prediction, a measurement and a timeout use one arithmetic.

`probe` measures a link between two peers that already hold connected streams (the transport's,
at admission and after each membership change, inside their TLS sessions; or the emulator's, in tests): small
ping-pongs for the RTT, then a timed transfer over every stream for the throughput. `wait_bound`
turns the measured link and a payload into the bound of one cross-site wait.

Units: rates in bits per second, windows and payloads in bytes, times in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

MAX_STREAMS = 16  # more streams per peer buy nothing a bigger window would not, and cost a thread each
LINUX_WMEM_MAX = 4 << 20  # Linux's default tcp_wmem maximum: the fallback where /proc is unreadable
LINUX_RMEM_MAX = 6 << 20  # Linux's default tcp_rmem maximum
SNDBUF_IN_FLIGHT_NUM, SNDBUF_IN_FLIGHT_DEN = 2, 3  # the part of the send buffer in flight (kernel_window)
DEFAULT_WINDOW = LINUX_WMEM_MAX * SNDBUF_IN_FLIGHT_NUM // SNDBUF_IN_FLIGHT_DEN  # kernel_window on Linux's defaults
WAIT_RTTS = 4  # round trips every wait adds to its transfer time (see wait_bound)
AUTO = "auto"  # sites.streams: chosen per peer from the probe (choose_streams)
MIN_PROBE_S, PROBE_RTTS = 0.2, 15  # the timed transfer: 15 round trips (slow start, then steady), at least 0.2 s


@dataclass(frozen=True)
class Link:
    rtt_s: float  # round trip between the two sites
    rate_bps: float  # the link's rate (what the sender's uplink can carry), bits per second
    streams: int = 1  # TCP connections per peer pair
    window_bytes: int = DEFAULT_WINDOW  # bytes one stream keeps in flight at most (kernel_window)

    @property
    def bdp_bytes(self) -> float:
        """Bandwidth-delay product: the bytes in flight that keep the link busy."""
        return self.rate_bps / 8 * self.rtt_s


def throughput(link: Link) -> float:
    """Bits per second the streams deliver: the link's rate, or their windows per round trip."""
    if link.rtt_s <= 0:
        return link.rate_bps
    return min(link.rate_bps, link.streams * link.window_bytes * 8 / link.rtt_s)


def streams_for(rate_bps: float, rtt_s: float, window_bytes: int | None = None) -> int:
    """The streams whose windows cover the bandwidth-delay product, clamped to [1, MAX_STREAMS]."""
    window = window_bytes or kernel_window()
    need = math.ceil(rate_bps / 8 * rtt_s / window - 1e-9)  # 1e-9: an exact multiple needs no extra stream
    return max(1, min(MAX_STREAMS, need))


PROC_IPV4 = Path("/proc/sys/net/ipv4")


def _proc_max(proc: Path, name: str, fallback: int) -> int:
    """The maximum (last field) of <proc>/<name>, as this process's network namespace sees it."""
    try:
        return int((proc / name).read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return fallback


def kernel_window(proc: Path = PROC_IPV4) -> int:
    """Bytes one autotuned stream keeps in flight at most: two thirds of the sender's tcp_wmem
    maximum, or half the receiver's tcp_rmem maximum, whichever is smaller. Both read here: the
    peer is assumed to run the same kernel settings.

    Two thirds, not all of the send buffer: it holds the bytes not yet sent beside those in
    flight, charged at their buffer size rather than their payload, and a writer is woken only once
    a third of it is free; the emulator's rates per stream count agree (benchmarks/wan.md, "Emulator
    ceiling"). Half of tcp_rmem: the receiver keeps the rest for its own overhead (tcp_adv_win_scale = 1)."""
    wmem, rmem = _proc_max(proc, "tcp_wmem", LINUX_WMEM_MAX), _proc_max(proc, "tcp_rmem", LINUX_RMEM_MAX)
    return min(wmem * SNDBUF_IN_FLIGHT_NUM // SNDBUF_IN_FLIGHT_DEN, rmem // 2)


def transfer_s(payload_bytes: float, link: Link) -> float:
    """Seconds the payload's bytes take at the streams' throughput (no latency)."""
    return payload_bytes * 8 / throughput(link)


def wait_bound(payload_bytes: float, link: Link, factor: float = 3.0, floor_s: float = 10.0,
               ceiling_s: float = 600.0, rtts: int = WAIT_RTTS) -> float:
    """How long one cross-site wait for `payload_bytes` may take before the peer is declared stalled:

        clamp(factor x payload / throughput + rtts x RTT, floor_s, ceiling_s)

    - payload / throughput is the transfer at the measured rate; `factor` (sites.wait_factor,
      default 3) absorbs what a probe of a few seconds does not see: cross traffic that halves the
      rate, a retransmission burst, the peer's CPU busy with its own sealing and reduction;
    - `rtts` round trips (default 4): the statistics exchange before the payload, the last byte's
      delivery and its acknowledgement, and one loss recovery (a fast retransmit costs about one
      RTT); a window that restarted slow start costs log2(window / initial window) RTTs more,
      which `factor` covers for payloads above a few windows;
    - the floor (sites.timeout_floor_s) keeps a tiny payload on a fast link from being cut off by
      a scheduler hiccup or a garbage-collection pause of the peer;
    - the ceiling (sites.timeout_s) is the bound every wait had before the link was measured: the
      link model only ever shortens a wait.
    A live link at its measured rate finishes in 1/factor of the bound; a frozen peer is declared
    dead after it (SIGSTOP in the middle of an all-reduce: within factor x transfer + rtts x RTT)."""
    bound = factor * transfer_s(payload_bytes, link) + rtts * link.rtt_s
    return min(ceiling_s, max(floor_s, bound))


@dataclass(frozen=True)
class LinkPolicy:
    """What a cross-site group does with its link (from [sites]): `streams` per peer (a number, or
    "auto": chosen from the probe), `probe_s` the longest timed transfer of the probe (0: no probe,
    and waits keep the group's timeout), and the wait bounds' `factor` and `floor_s`."""

    streams: int | str = 1
    probe_s: float = 0.0
    factor: float = 3.0
    floor_s: float = 10.0

    @classmethod
    def of(cls, sites: Any) -> LinkPolicy:
        """From a SitesConfig (config.py sits below this layer's callers, not below this module)."""
        return cls(sites.streams, sites.probe_s, sites.wait_factor, sites.timeout_floor_s)


def dial_streams(streams: int | str, probe_s: float, known: LinkProbe | None = None) -> int:
    """Connections to dial per peer: the given number; for "auto", those an earlier probe of the
    link kept (`known`), else MAX_STREAMS to probe on (the probe then keeps those that cover the
    link, `choose_streams`), or 1 when nothing is probed."""
    if streams != AUTO:
        return int(streams)
    if probe_s <= 0:
        return 1
    return known.chosen if known is not None and known.chosen else MAX_STREAMS


REPROBE_RATIO = 2.0  # a link whose round trip moved by more than this factor since its last probe is probed again
REPROBE_FLOOR_S = 0.005  # ... and by more than this (a loopback's or LAN's round trip is mostly noise)


def still_measured(known: LinkProbe | None, rtt_s: float | None, streams: int) -> bool:
    """Whether the last probe of a link still describes it, so the group skips the probe: it was
    made on the `streams` connections held now, and the round trip seen when dialing them
    (`rtt_s`, the fastest TCP connect) is within a factor REPROBE_RATIO of its minimum (or within
    REPROBE_FLOOR_S of it). A factor, not a share: a connect made while the group's other
    handshakes queue on the same uplinks, or on a busy host, reads high; the wait bounds'
    sites.wait_factor (3) covers a link that is up to that much slower than measured."""
    if known is None or rtt_s is None or (known.chosen or known.streams) != streams:
        return False
    low, high = known.rtt_min_s / REPROBE_RATIO, known.rtt_min_s * REPROBE_RATIO
    return low - REPROBE_FLOOR_S <= rtt_s <= high + REPROBE_FLOOR_S


def probe_seconds(rtt_s: float, cap_s: float) -> float:
    """Length of the probe's timed transfer: PROBE_RTTS round trips (TCP's slow start reaches a
    4 MB window in about 8 from 14 kB, and `steady` reads the second half), at least MIN_PROBE_S
    (a loopback or LAN link), at most `cap_s` (sites.probe_s)."""
    return min(cap_s, max(MIN_PROBE_S, PROBE_RTTS * rtt_s))


def choose_streams(streams: int | str, measured: LinkProbe) -> int:
    """Streams kept per peer after a probe on `measured.streams` connections: the given number, or
    for "auto" those whose windows cover the measured bandwidth-delay product (never more than
    were probed). The initiator decides and tells the responder (`probe`), so both use the same."""
    if streams != AUTO:
        return int(streams)
    rate = measured.steady_bps or measured.throughput_bps
    if rate <= 0:
        return measured.streams
    # the least RTT: the link's own, where the median may include queues of other pairs' probes
    return min(measured.streams, streams_for(rate, measured.rtt_min_s, measured.window_bytes))


def bound_note(payload_bytes: float, link: Link, factor: float, floor_s: float, ceiling_s: float) -> str:
    """`wait_bound`'s arithmetic in words, for the line that declares a peer stalled."""
    bound = wait_bound(payload_bytes, link, factor, floor_s, ceiling_s)
    clamp = (", raised to sites.timeout_floor_s" if bound == floor_s else
             ", cut to sites.timeout_s" if bound == ceiling_s else "")
    return (f"{factor:g} x {transfer_s(payload_bytes, link):.2f} s for {payload_bytes / 1e6:.2f} MB at "
            f"{throughput(link) / 1e6:.0f} Mbit/s + {WAIT_RTTS} x {1e3 * link.rtt_s:.0f} ms RTT{clamp}")


# ------------------------------------------------------------------------------------ the probe


class Stream(Protocol):
    """What the probe needs of a connected stream: a `socket.socket` is one."""

    def sendall(self, data: bytes | memoryview, /) -> None: ...
    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int: ...


class ProbeError(ConnectionError):
    """The peer answered a probe with another message than the protocol's next one, or hung up."""


NONCE_BYTES = 16
CHUNK = 256 << 10  # bytes per framed piece of the timed transfer
PING = struct.Struct("!cQ16s")  # kind, sequence, session nonce
REPORT = struct.Struct("!cQddd16s")  # kind, bytes, seconds, median RTT, steady bits/s, session nonce
TIMES = struct.Struct("!dd")  # the initiator's median and minimum RTT, told to the responder
KNOWN = struct.Struct("!ddIIQQdddI")  # an earlier probe's LinkProbe fields, sent in place of a new probe
FRAME = struct.Struct("!I")  # length of a transfer piece; 0 ends the stream's transfer
SEND_AHEAD = 64 << 10  # bytes per piece sent, and unsent bytes a stream may hold (_send_for)
NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's value where Python lacks the name


@dataclass(frozen=True)
class LinkProbe:
    """What one probe measured; `link()` is the model it implies."""

    rtt_s: float  # median of the ping-pongs
    rtt_min_s: float
    pings: int
    streams: int
    window_bytes: int
    bytes: int  # payload bytes of the timed transfer (all streams)
    seconds: float  # its first byte to last byte, at the receiver
    throughput_bps: float  # bytes / seconds (includes slow start)
    steady_bps: float  # over the transfer's second half, once TCP has ramped up
    chosen: int = 0  # streams kept afterwards (choose_streams; 0: no choice was made)
    reused: bool = False  # an earlier probe of this link, taken again (`still_measured`) without a transfer

    def link(self) -> Link:
        """The measured link: its rate is the steady throughput (a lower bound of the link's rate
        when streams x window / RTT is what limited it; then more streams would get more), on the
        streams kept after it (`chosen`) where a choice was made."""
        return Link(self.rtt_s, self.steady_bps, self.chosen or self.streams, self.window_bytes)

    def record(self, payload_bytes: float | None = None, factor: float = 3.0, floor_s: float = 10.0,
               ceiling_s: float = 600.0) -> dict[str, Any]:
        """Fields of a `link` metrics record: the measurement, the streams it would choose, and with a
        payload the wait bound it derives. The transport, after each admission:
            rec = result.record(payload, s.wait_factor, s.timeout_floor_s, s.timeout_s)  # s = cfg.sites
            logger.log(step, {"peer": peer, "generation": gen, **rec}, kind="link")"""
        rec: dict[str, Any] = {
            "rtt_ms": 1e3 * self.rtt_s, "rtt_min_ms": 1e3 * self.rtt_min_s, "pings": self.pings,
            "streams": self.streams, "window_bytes": self.window_bytes, "probe_bytes": self.bytes,
            "probe_s": self.seconds, "throughput_mbit": self.throughput_bps / 1e6, "steady_mbit": self.steady_bps / 1e6,
            "streams_needed": streams_for(self.steady_bps, self.rtt_s, self.window_bytes),
        }
        if self.chosen:
            rec["streams_used"] = self.chosen
        if self.reused:
            rec["reused"] = True
        if payload_bytes is not None:
            rec["payload_bytes"] = payload_bytes
            rec["wait_bound_s"] = wait_bound(payload_bytes, self.link(), factor, floor_s, ceiling_s)
        return rec




def _recv_exact(stream: Stream, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = stream.recv_into(view[got:], n - got)
        if k == 0:
            raise ProbeError("link probe: the peer closed the connection")
        got += k
    return bytes(buf)


def _recv(stream: Stream, size: int, kind: bytes) -> bytes:
    """One message of `size` bytes; raises ProbeError unless it is of the `kind` expected."""
    body = _recv_exact(stream, size)
    if body[:1] != kind:
        raise ProbeError(f"link probe: the peer sent something else than a {kind.decode()!r} message "
                         "(not a zeroband peer, or another version)")
    return body


def _pings(stream: Stream, nonce: bytes, count: int, initiator: bool) -> list[float]:
    """`count` ping-pongs on one stream; the initiator times them. Each message is bound to the
    session nonce and its sequence number, so a recorded answer cannot stand in for a fresh one."""
    rtts = []
    for seq in range(count):
        if initiator:
            t0 = time.perf_counter()
            stream.sendall(PING.pack(b"P", seq, nonce))
            if PING.unpack(_recv(stream, PING.size, b"Q"))[1:] != (seq, nonce):
                raise ProbeError("link probe: the peer answered another ping")
            rtts.append(time.perf_counter() - t0)
        else:
            if PING.unpack(_recv(stream, PING.size, b"P"))[1:] != (seq, nonce):
                raise ProbeError("link probe: out-of-order ping")
            stream.sendall(PING.pack(b"Q", seq, nonce))
    return rtts


def _send_for(stream: Stream, seconds: float, errors: list[BaseException]) -> None:
    """Framed pieces until `seconds` have passed, then the end frame.

    The bytes written but not yet sent are held to SEND_AHEAD (TCP_NOTSENT_LOWAT, restored after):
    what is in flight stays the kernel's choice (the window being measured), but the tail left
    in the send buffer at the deadline stays small. Without it 16 streams on a 5 Mbit/s link
    queued megabytes each and the transfer outlived its deadline by tens of seconds."""
    piece, header = bytes(SEND_AHEAD), FRAME.pack(SEND_AHEAD)
    deadline = time.perf_counter() + seconds
    setsockopt = getattr(stream, "setsockopt", None)
    try:
        before = stream.getsockopt(socket.IPPROTO_TCP, NOTSENT_LOWAT) if setsockopt else None  # type: ignore[attr-defined]
        if setsockopt:
            setsockopt(socket.IPPROTO_TCP, NOTSENT_LOWAT, SEND_AHEAD)
    except OSError:  # not TCP (a socketpair in tests)
        setsockopt = before = None
    try:
        while time.perf_counter() < deadline:
            stream.sendall(header)
            stream.sendall(piece)
        stream.sendall(FRAME.pack(0))
        if setsockopt:
            setsockopt(socket.IPPROTO_TCP, NOTSENT_LOWAT, before)
    except BaseException as e:  # reported by the caller's thread
        errors.append(e)


def _recv_frames(stream: Stream, events: list[tuple[float, int]], errors: list[BaseException]) -> None:
    """Reads pieces until the end frame, noting (arrival time, bytes) per read."""
    buf = memoryview(bytearray(CHUNK))
    try:
        while (n := FRAME.unpack(_recv_exact(stream, FRAME.size))[0]) > 0:
            if n > CHUNK:
                raise ProbeError(f"link probe: a transfer piece of {n} bytes (at most {CHUNK})")
            got = 0
            while got < n:
                k = stream.recv_into(buf[got:], n - got)
                if k == 0:
                    raise ProbeError("link probe: the peer closed the connection")
                got += k
                events.append((time.perf_counter(), k))
    except BaseException as e:  # reported by the caller's thread
        errors.append(e)


def _in_threads(target: Any, args_per_stream: list[tuple[Any, ...]]) -> None:
    threads = [threading.Thread(target=target, args=args, daemon=True) for args in args_per_stream]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def transfer_rates(events: list[tuple[float, int]]) -> tuple[int, float, float]:
    """(bytes, seconds first to last arrival, steady bits/s over the second half of that time)."""
    events = sorted(events)
    total = sum(n for _, n in events)
    if len(events) < 2:
        return total, 0.0, 0.0
    t0, t1 = events[0][0], events[-1][0]
    mid = (t0 + t1) / 2
    late = sum(n for t, n in events if t > mid)
    return total, t1 - t0, late * 8 / (t1 - mid) if t1 > mid else 0.0


def probe(streams: Sequence[Stream], initiator: bool, seconds: float = 2.0, pings: int = 5,
          window_bytes: int | None = None, cap_s: float | None = None,
          choose: Callable[[LinkProbe], int] | None = None, known: LinkProbe | None = None) -> LinkProbe:
    """Measure the link to one peer; both peers call it at once on the same connected `streams`.

    The initiator pings `pings` times on the first stream (RTT), then sends framed pieces on every
    stream for `seconds`; the responder answers the pings, receives, and returns the transfer's
    timing in a report, so both sides return the same measurement. Over the transport the streams
    are TLS sessions, which authenticate every message; the session nonce only ties the answers to
    this probe. The caller bounds each stream's blocking with its socket timeout.

    `cap_s`: the initiator sends for `probe_seconds(RTT, cap_s)` instead of `seconds`. `choose`
    (both sides pass one, or neither): the initiator's choice of streams from the measurement,
    sent to the responder in a last message; both return it as `chosen`.
    `known` (initiator only): an earlier probe of this link that still holds (`still_measured`):
    sent instead of measuring, in one message, and returned by both sides as `reused`."""
    first, window = streams[0], window_bytes or kernel_window()
    if initiator:
        nonce = secrets.token_bytes(NONCE_BYTES)
        if known is not None:
            first.sendall(PING.pack(b"K", len(streams), nonce) + KNOWN.pack(*astuple(known)[:-1]))
            return replace(known, reused=True)
        first.sendall(PING.pack(b"H", len(streams), nonce))
    else:
        kind, count, nonce = PING.unpack(_recv_exact(first, PING.size))
        if kind not in (b"H", b"K"):
            raise ProbeError(f"link probe: the peer sent something else than a 'H' or 'K' message (got {kind!r})")
        if count != len(streams):
            raise ProbeError(f"link probe: the peer probes {count} streams, this side holds {len(streams)}")
        if kind == b"K":
            return replace(LinkProbe(*KNOWN.unpack(_recv_exact(first, KNOWN.size))), reused=True)
    rtts = _pings(first, nonce, pings, initiator)
    if initiator:
        rtt, rtt_min = statistics.median(rtts), min(rtts)
        seconds = seconds if cap_s is None else probe_seconds(rtt, cap_s)
        first.sendall(PING.pack(b"T", pings, nonce) + TIMES.pack(rtt, rtt_min))
        errors: list[BaseException] = []
        _in_threads(_send_for, [(s, seconds, errors) for s in streams])
        if errors:
            raise errors[0]
        kind, nbytes, secs, _, steady, got_nonce = REPORT.unpack(_recv(first, REPORT.size, b"R"))
        if got_nonce != nonce:
            raise ProbeError("link probe: the report answers another probe")
    else:
        rtt, rtt_min = TIMES.unpack(_recv(first, PING.size + TIMES.size, b"T")[PING.size:])
        events: list[tuple[float, int]] = []
        errors = []
        _in_threads(_recv_frames, [(s, events, errors) for s in streams])
        if errors:
            raise errors[0]
        nbytes, secs, steady = transfer_rates(events)
        first.sendall(REPORT.pack(b"R", nbytes, secs, rtt, steady, nonce))
    mean = nbytes * 8 / secs if secs else 0.0
    result = LinkProbe(rtt, rtt_min, pings, len(streams), window, nbytes, secs, mean, steady)
    if choose is None:
        return result
    if initiator:
        chosen = choose(result)
        first.sendall(PING.pack(b"C", chosen, nonce))
    else:
        kind, chosen, got_nonce = PING.unpack(_recv(first, PING.size, b"C"))
        if got_nonce != nonce or not 1 <= chosen <= len(streams):
            raise ProbeError(f"link probe: the peer chose {chosen} of {len(streams)} streams, or answered another probe")
    return replace(result, chosen=chosen)


# ------------------------------------------------------------------ command line (inside a namespace)


def _connect_all(role: str, host: str, port: int, streams: int, timeout_s: float) -> list[socket.socket]:
    """`streams` connections between the two ends: the server accepts, the client connects, in order."""
    if role == "client":
        conns = [socket.create_connection((host, port), timeout=timeout_s) for _ in range(streams)]
    else:
        with socket.create_server((host, port)) as srv:
            print("ready", flush=True)
            srv.settimeout(timeout_s)
            conns = [srv.accept()[0] for _ in range(streams)]
    for c in conns:
        c.settimeout(timeout_s)
    return conns


def main(argv: list[str] | None = None) -> None:
    """`python -m zeroband.comm.link server|client HOST PORT [--streams N --seconds S]`: one probe
    between two processes (e.g. two sites of the WAN emulator); prints the measurement as JSON."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("role", choices=["server", "client"], help="the client initiates (it sends the timed transfer)")
    p.add_argument("host", help="server: address to bind; client: the server's address")
    p.add_argument("port", type=int)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--seconds", type=float, default=2.0, help="length of the timed transfer")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    conns = _connect_all(args.role, args.host, args.port, args.streams, args.timeout)
    try:
        result = probe(conns, initiator=args.role == "client", seconds=args.seconds)
    finally:
        for c in conns:
            c.close()
    print(json.dumps({**asdict(result), **result.record()}), flush=True)


if __name__ == "__main__":
    main()
