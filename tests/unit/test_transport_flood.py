"""Admission under a connection flood (issue 35 item 2): no stranger can keep an honest peer out.

Before, the transport's listener held 64 unauthenticated connections and evicted the oldest, and
`dial` returned once it had sent CONFIRM: a peer stays pending for about a round trip, so more
than 64 empty connections per round trip (from one host, no secret) evicted it every time, after
its valid hello too, and the dialer never learnt it; the acceptor then blamed the honest site.
Now a connection proves the secret by its TLS handshake (trust/tls.py) and is admitted at once.

Loopback gives each party its own source address (127.0.0.2 floods, 127.0.0.3 is the honest peer;
bind before connect). The round trip is real: the honest peer crosses zeroband/wan/relay.py's
delaying relay, and the flood is a process of its own (tests/flood_store.py, stdlib only). The
deterministic tests drive the handshake by hand and wait for the listener to have refused the
flood before the honest side takes its next step, so they do not depend on timing.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.unit.test_transport import KEY, _address
from zeroband.comm import transport as tp
from zeroband.comm.transport import Transport, TransportError, dial, to_evict
from zeroband.trust.tls import group_tls
from zeroband.wan.relay import DelayRelay
from zeroband.watchdog import PeerTimeout

PREFIX = "test/gen0/"
FLOODER, HONEST = "127.0.0.2", "127.0.0.3"
FLOOD_STORE = Path(__file__).parents[1] / "flood_store.py"


def _connect_from(source: str, address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=5, source_address=(source, 0))


def _wait_refused(t: Transport, count: int, limit_s: float = 20) -> None:
    """Until the listener refused `count` connections in all: the flood was dealt with."""
    deadline = time.monotonic() + limit_s
    while t.acceptor.refused < count:
        assert time.monotonic() < deadline, f"the listener refused only {t.acceptor.refused} of {count}"
        time.sleep(0.02)


def _flood(t: Transport, n: int, source: str) -> int:
    """`n` empty connections from `source`, held open until the listener refused them all but the
    ones its caps let it keep; then closed. Returns the refusals they caused."""
    before, held = t.acceptor.refused, [_connect_from(source, _address(t)) for _ in range(n)]
    _wait_refused(t, before + n - tp.MAX_PENDING_PER_SOURCE)
    for s in held:
        s.close()
    _wait_refused(t, before + n)
    return t.acceptor.refused - before


def test_to_evict_takes_from_the_source_holding_the_most_never_from_a_small_one():
    cap, full = tp.MAX_PENDING_PER_SOURCE, tp.MAX_PENDING
    assert to_evict({}, "a") is None and to_evict({"a": cap - 1}, "a") is None
    assert to_evict({"a": cap, "b": 1}, "a") == "a" and to_evict({"a": cap, "b": 1}, "b") is None
    crowd = {f"10.0.0.{i}": cap for i in range(full // cap - 1)} | {"honest": 1, "small": cap - 1}
    assert sum(crowd.values()) == full
    assert to_evict(crowd, "new") == "10.0.0.0"  # the first of those holding the most
    assert to_evict(crowd, "10.0.0.2") == "10.0.0.2"  # at its own cap
    assert to_evict(crowd, "honest") == to_evict(crowd, "small") == "10.0.0.0"  # never the small ones
    even = {f"10.0.0.{i}": 1 for i in range(full)}  # a flood from as many hosts as there are slots
    assert to_evict(even, "10.0.0.5") == "10.0.0.5" and to_evict(even, "new") == "10.0.0.0"


class _HandDialer:
    """The dialer's side of a TLS handshake, one step at a time, from `source`."""

    def __init__(self, t: Transport, source: str) -> None:
        self.sock = _connect_from(source, _address(t))
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        assert t.tls is not None
        self.tls = t.tls.client.wrap_bio(self.incoming, self.outgoing)

    def client_hello(self) -> None:
        with pytest.raises(ssl.SSLWantReadError):
            self.tls.do_handshake()
        self.sock.sendall(self.outgoing.read())

    def server_flight(self) -> None:
        """Reads the acceptor's flight until the handshake is done on this side; its last flight
        (certificate, finished) stays unsent."""
        while True:
            self.incoming.write(self.sock.recv(1 << 14))
            try:
                return self.tls.do_handshake()
            except ssl.SSLWantReadError:
                pass

    def finish(self, src: int) -> bytes:
        """Sends the last flight and the hello; returns the acceptor's answer, decrypted."""
        self.tls.write(tp.make_hello(src, 0, 0, 1))
        self.sock.sendall(self.outgoing.read())
        while True:
            self.incoming.write(self.sock.recv(1 << 14))
            try:
                return self.tls.read(tp.ADMIT.size)
            except ssl.SSLWantReadError:
                pass


def test_a_connection_in_its_handshake_survives_a_flood_from_its_own_address_and_one_silent_another(monkeypatch):
    """Two honest handshakes by hand: one has sent its ClientHello and floods from its own address
    follow (they evict their own empty connections first); the other has only connected from
    another address while a flood from a third one fills the pool. Both then finish and are
    admitted, and the listener never held more unproven connections than its caps."""
    monkeypatch.setattr(tp, "HELLO_DEADLINE_S", 60.0)  # the honest steps wait for the flood: no deadline then
    t = Transport(0, 3, PREFIX, KEY, 10, host="127.0.0.1")
    started, waiting = _HandDialer(t, "127.0.0.1"), _HandDialer(t, HONEST)
    started.client_hello()
    started.server_flight()
    assert _flood(t, 300, "127.0.0.1") == _flood(t, 300, FLOODER) == 300
    assert started.finish(1) == tp.ADMIT.pack(tp.MAGIC, 0)
    waiting.client_hello()
    waiting.server_flight()
    assert waiting.finish(2) == tp.ADMIT.pack(tp.MAGIC, 0)
    with t.cond:  # handed over right after ADMIT was sent
        assert t.cond.wait_for(lambda: sorted(t.accepted) == [1, 2], 10)
    t.close()


def test_dial_fails_when_the_acceptor_drops_the_connection_after_the_hello():
    """Before, `dial` returned once CONFIRM was sent: a connection dropped then was waited for until
    sites.timeout_s. Now it waits for ADMIT, so it fails, and `Transport._dial` dials again."""
    server, tls = socket.create_server(("127.0.0.1", 0)), group_tls(tp.group_key(KEY, PREFIX))

    def accept_and_drop() -> None:
        conn, _ = server.accept()
        with tls.server.wrap_socket(conn, server_side=True) as wrapped:
            wrapped.recv(tp.HELLO.size)

    th = threading.Thread(target=accept_and_drop, daemon=True)
    th.start()
    with pytest.raises(TransportError, match="closed by the peer"):
        dial(server.getsockname()[:2], tls, 1, 0, 0, 1)
    th.join(5)
    server.close()


def test_the_connect_error_names_the_flood_not_only_the_missing_site():
    t = Transport(0, 2, PREFIX, KEY, 0.5, host="127.0.0.1")
    refused = _flood(t, 200, FLOODER)
    with pytest.raises(PeerTimeout) as e:
        t.connect({0: t.address})
    assert str(e.value).startswith(f"connecting the group under a connection flood: this listener refused {refused} "
                                   f"connections that did not authenticate (from {FLOODER}: {refused})")
    assert str(e.value).endswith("and site 1 did not connect within 0.5 s (sites.timeout_s)")
    t.close()


@pytest.mark.parametrize(("delay_s", "rate"), [(0.025, 3000), (0.1, 2000)])
def test_every_site_connects_across_a_real_round_trip_under_a_flood(delay_s, rate):
    """The reproduction: sites 1 and 2 reach site 0 through a relay adding `delay_s` each way (from
    127.0.0.3) while a process floods site 0's listener from 127.0.0.2 with `rate` empty connections
    a second, held in waves of 500: more than MAX_PENDING per round trip. Every site connects on its
    2 streams, and the group exchanges (an allreduce, bitwise identical everywhere)."""
    group = [Transport(r, 3, PREFIX, KEY, 15, streams=2, host="127.0.0.1") for r in range(3)]
    relay = DelayRelay(_address(group[0]), delay_s, source=HONEST)
    flood = subprocess.Popen([sys.executable, str(FLOOD_STORE), *map(str, _address(group[0])), "--conns", "0",
                              "--wave", "500", "--stall", "0", "--forever", "--seconds", "25", "--rate", str(rate),
                              "--source", FLOODER, "--empty"], stdout=subprocess.PIPE, text=True)
    try:
        _wait_refused(group[0], 2 * tp.MAX_PENDING)  # the flood is on
        start, refused = time.monotonic(), group[0].acceptor.refused
        addresses = {0: "{}:{}".format(*relay.address), 1: group[1].address, 2: group[2].address}
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_connect, args=(t, addresses, errors)) for t in group]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        connect_s, refused = time.monotonic() - start, group[0].acceptor.refused - refused
        assert not errors, errors
        assert connect_s >= 4 * delay_s  # the round trip was real: each dial to site 0 (the 2 run at once)
        # crosses the relay 4 times (ClientHello, the acceptor's flight, the dialer's with the hello, ADMIT)
        assert all(sorted(t.peers) == [r for r in range(3) if r != t.rank] for t in group)
        assert group[0].peers[1].streams == group[0].peers[2].streams == 2
        values = [torch.tensor([1e16, 1.0, -3.5], dtype=torch.float64) * (r + 1) for r in range(3)]
        for w in [t.allreduce([v]) for t, v in zip(group, values)]:  # still under the flood
            w.wait()
        assert all(torch.equal(values[0], v) for v in values)
    finally:
        flood.terminate()
        stats = json.loads(flood.communicate(timeout=20)[0])
        relay.close()
        for t in group:
            t.close()
    print(f"delay {delay_s * 1e3:g} ms each way, flood {stats}: {stats['opened'] / stats['seconds']:.0f} "
          f"connections/s; the group connected in {connect_s:.2f} s while site 0 refused {refused}")


def _connect(t: Transport, addresses: dict[int, str], errors: list[BaseException]) -> None:
    try:
        t.connect(addresses)
    except BaseException as e:  # reported by the test's thread
        errors.append(e)
