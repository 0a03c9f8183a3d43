"""The cross-site transport (zeroband/comm/transport.py) in one process over loopback: real sockets,
real threads, the real TLS handshake; the peers that misbehave are raw sockets driven from the test."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time

import pytest
import torch
import torch.distributed as dist

from zeroband.comm import transport as tp
from zeroband.comm.transport import HEADER, Transport, TransportError, dial, slices
from zeroband.trust.tls import group_tls
from zeroband.watchdog import PeerTimeout

KEY = b"k" * 32


def connected(size: int, streams: int | str = 1, key: bytes | None = KEY, timeout_s: float = 10,
              probe_s: float = 0.0) -> list[Transport]:
    group = [Transport(r, size, "test/gen0/", key, timeout_s, streams, host="127.0.0.1", probe_s=probe_s)
             for r in range(size)]
    addresses = {r: t.address for r, t in enumerate(group)}
    threads = [threading.Thread(target=t.connect, args=(addresses,)) for t in group]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(len(t.peers) == size - 1 for t in group)
    return group


def exchange(a: Transport, b: Transport, payload: torch.Tensor, tag: int = 7) -> torch.Tensor:
    out = torch.zeros_like(payload)
    got, sent = b.recv([out], a.rank, tag), a.send([payload], b.rank, tag)
    sent.wait(), got.wait()
    return out


def test_messages_match_fifo_per_tag_whatever_order_receives_are_posted():
    """Receives are matched by (peer, tag), first posted first served, in whatever order they are
    posted (a message waits on the wire until its receive is posted: zeroband posts every receive
    of a call before it waits on any)."""
    a, b = connected(2)
    bufs = {name: torch.zeros(3) for name in ("only_9", "first_5", "second_5")}
    works = [b.recv([bufs["only_9"]], 0, 9), b.recv([bufs["first_5"]], 0, 5), b.recv([bufs["second_5"]], 0, 5)]
    msgs = [(5, torch.full((3,), 1.0)), (9, torch.full((3,), 2.0)), (5, torch.full((3,), 3.0))]
    works += [a.send([m], 1, tag) for tag, m in msgs]
    for w in works:
        w.wait(5)
    assert [bufs[k].tolist() for k in ("first_5", "only_9", "second_5")] == [[1.0] * 3, [2.0] * 3, [3.0] * 3]


@pytest.mark.parametrize("total", [0, 1, 1000, (1 << 16) * 4 + 3, 3 << 20])
def test_slices_cover_the_message_in_order(total):
    for streams in (1, 2, 4, 7):
        cuts = slices(total, streams)
        assert len(cuts) == streams and sum(n for _, n in cuts) == total
        assert all(off == prev_off + prev_n for (prev_off, prev_n), (off, _) in zip(cuts, cuts[1:]))


def test_four_streams_deliver_the_same_bytes_as_one():
    payload = torch.randint(0, 256, (5_000_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    one = exchange(*connected(2, streams=1), payload)
    a, b = connected(2, streams=4)
    assert all(len(p.socks) == 4 for p in a.peers.values())
    four = [exchange(a, b, payload, tag=3), exchange(b, a, payload[:70_000], tag=3)]
    assert torch.equal(one, payload) and torch.equal(four[0], payload) and torch.equal(four[1], payload[:70_000])


def test_allreduce_and_broadcast_are_bitwise_identical_on_every_member():
    group = connected(3, streams=2)
    values = [torch.tensor([1e16, 1.0, -3.5], dtype=torch.float64) * (r + 1) + r for r in range(3)]
    works = [t.allreduce([v]) for t, v in zip(group, values)]
    for w in works:
        w.wait()
    assert all(torch.equal(values[0], v) for v in values)
    opts = dist.BroadcastOptions()
    opts.rootRank = 2
    bufs = [torch.full((100_000,), float(r)) for r in range(3)]
    for w in [t.broadcast([b], opts) for t, b in zip(group, bufs)]:
        w.wait()
    assert all(torch.equal(b, torch.full((100_000,), 2.0)) for b in bufs)


def _listener_alone() -> tuple[Transport, threading.Thread]:
    """Member 0 of a 2-member group, connecting in the background; the test plays member 1."""
    t = Transport(0, 2, "test/gen0/", KEY, 10, host="127.0.0.1")

    def connect() -> None:
        try:
            t.connect({0: t.address})
        except PeerTimeout:  # the tests that refuse the only peer end before it would have come
            pass

    th = threading.Thread(target=connect, daemon=True)
    th.start()
    return t, th


def _address(t: Transport) -> tuple[str, int]:
    host, port = t.address.rsplit(":", 1)
    return host, int(port)


def test_a_dialer_without_the_groups_key_is_refused():
    """TLS 1.3 with the group's certificate on both ends: another secret, or the right secret for
    another group (incarnation, generation), fails the handshake on both sides; a client that
    trusts anything and shows no certificate completes its side, then reads the refusal."""
    t, _ = _listener_alone()
    for key in (tp.group_key(b"w" * 32, "test/gen0/"), tp.group_key(KEY, "test/gen1/")):
        with pytest.raises(ssl.SSLCertVerificationError):
            dial(_address(t), group_tls(key), 1, 0, 0, 1)
    anything = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anything.check_hostname, anything.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(_address(t)) as raw, anything.wrap_socket(raw) as stranger:
        stranger.sendall(tp.make_hello(1, 0, 0, 1))
        with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
            stranger.recv(100)
    assert t.peers == {} and _refused(t, 3) == 3


def _refused(t: Transport, expected: int, within_s: float = 5.0) -> int:
    """The acceptor's count of refused connections once it reaches `expected` (or the deadline): its
    thread counts a refusal after sending the alert the dialer has already read."""
    deadline = time.monotonic() + within_s
    while t.acceptor.refused < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return t.acceptor.refused


def test_plaintext_is_refused_by_a_tls_listener_and_tls_is_refused_by_an_insecure_one():
    t, _ = _listener_alone()
    with pytest.raises(TransportError, match="closed by the peer"):
        dial(_address(t), None, 1, 0, 0, 1)  # a plain hello is no TLS record
    insecure = Transport(0, 2, "test/gen0/", None, 10, host="127.0.0.1")
    with pytest.raises((TransportError, OSError)):
        dial(_address(insecure), t.tls, 1, 0, 0, 1)
    assert _refused(t, 1) == _refused(insecure, 1) == 1
    insecure.close()


def test_an_oversize_frame_fails_the_receive_without_allocating():
    t, th = _listener_alone()
    sock = dial(_address(t), t.tls, 1, 0, 0, 1)
    th.join(5)
    buf = torch.zeros(10, dtype=torch.uint8)
    work = t.recv([buf], 1, 4)
    sock.sendall(HEADER.pack(4, 1 << 40))  # a terabyte announced for a 10-byte buffer
    with pytest.raises(TransportError, match="connection to site 1: a message of 1099511627776 bytes for tag 4 where 10 bytes"):
        work.wait(5)
    with pytest.raises(TransportError):  # the peer is gone for good: nothing later is read from it
        t.recv([buf], 1, 5).wait(5)
    sock.close()


def test_a_silent_connection_is_closed_at_the_hello_deadline_and_no_tls_at_once(monkeypatch):
    monkeypatch.setattr(tp, "HELLO_DEADLINE_S", 0.5)
    t, _ = _listener_alone()
    for first, after in ((b"\x16", (0.3, 2.0)), (b"Z", (0.0, 0.3))):  # a TLS record's first byte; no TLS
        silent = socket.create_connection(_address(t))
        silent.sendall(first)  # then nothing
        silent.settimeout(5)
        start = time.monotonic()
        assert silent.recv(100) == b""  # closed by the listener
        assert after[0] <= time.monotonic() - start < after[1]


def test_stalled_connections_stay_bounded_and_never_keep_a_real_peer_out():
    """600 connections that send one byte and stall, then the real peer: it connects, and the
    listener never held more than MAX_PENDING unauthenticated connections (fds stay bounded)."""
    t, th = _listener_alone()
    fds_before = len(os.listdir("/proc/self/fd"))
    stalled = []
    for _ in range(600):
        s = socket.create_connection(_address(t))
        s.sendall(b"\x16")  # the first byte of a TLS record, then nothing
        stalled.append(s)
    time.sleep(0.3)
    assert len(t.acceptor.pending) <= tp.MAX_PENDING
    listener_fds = len(os.listdir("/proc/self/fd")) - fds_before - len(stalled)
    assert listener_fds <= tp.MAX_PENDING + 1, listener_fds
    sock = dial(_address(t), t.tls, 1, 0, 0, 1)
    th.join(5)
    assert not th.is_alive() and 1 in t.peers
    sock.sendall(HEADER.pack(2, 3) + b"abc")
    buf = torch.zeros(3, dtype=torch.uint8)
    t.recv([buf], 1, 2).wait(5)
    assert bytes(buf.numpy()) == b"abc"
    for s in stalled:
        s.close()
    sock.close()


def test_a_lost_peer_fails_pending_receives_at_once():
    a, b = connected(2)
    work = b.recv([torch.zeros(4)], 0, 1)
    a.close()
    with pytest.raises(TransportError):
        work.wait(5)


def test_auto_streams_probe_every_peer_at_connect_and_keep_what_the_link_needs():
    """"auto": 16 connections per peer to probe on (authenticated, the group's key), then the streams
    that cover the measured bandwidth-delay product: on loopback one window does, so 1 is kept and
    the other 15 are closed; both ends of every pair hold the same measurement and choice."""
    tp._LINKS.clear()  # links other tests of this process measured (they would be taken again)
    a, b = connected(2, "auto", probe_s=0.3)
    assert a.links[1] == b.links[0] and a.links[1].streams == 16 and a.links[1].bytes > 0
    assert a.links[1].chosen == 1 and a.peers[1].streams == b.peers[0].streams == 1
    # three members probe their pairs at once (on 2 shared cores a pair's pings may see the others'
    # transfers: the choice may differ per pair, never between the two ends of one)
    tp._LINKS.clear()
    group = connected(3, "auto", probe_s=0.3)
    for t in group:
        assert sorted(t.links) == [r for r in range(3) if r != t.rank]
        assert all(t.peers[p].streams == probe.chosen for p, probe in t.links.items())
    assert group[0].links[1] == group[1].links[0] and group[1].links[2] == group[2].links[1]
    payload = torch.randn(300_000)
    assert torch.equal(exchange(group[2], group[1], payload), payload)


def test_a_second_group_takes_the_last_probe_again_and_dials_only_the_streams_it_kept():
    """An elastic generation or a resume forms a new group in the same process: a link whose round
    trip has not moved is not probed again (no transfer: the initiator hands its last result
    over), and "auto" dials the streams that probe kept instead of 16."""
    tp._LINKS.clear()  # links other tests of this process measured
    first = connected(2, "auto", probe_s=0.3)
    assert not first[1].links[0].reused and first[1].links[0].streams == 16
    a, b = connected(2, "auto", probe_s=0.3)
    assert a.links[1] == b.links[0] and b.links[0].reused
    assert b.links[0].streams == first[1].links[0].streams and b.links[0].chosen == first[1].links[0].chosen
    assert len(b.rtts[0]) == b.links[0].chosen == a.peers[1].streams == b.peers[0].streams
    payload = torch.randn(300_000)
    assert torch.equal(exchange(b, a, payload), payload)


def test_a_given_stream_count_is_probed_and_kept():
    a, b = connected(2, 3, probe_s=0.2)
    assert a.links[1].streams == a.links[1].chosen == 3 and a.peers[1].streams == b.peers[0].streams == 3
