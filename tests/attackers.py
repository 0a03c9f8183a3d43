"""Rogue behaviour for tests/integration/test_attacks*.py, all on the test side: codecs that a malicious or
broken site would run, an on-path attacker on the transport's bytes (`Capture`), and a forger that writes
store values without the secret.
Nothing here is a hook in production code."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LyingCodec:
    """Encodes something else than it is given, in the same number of bytes: 'huge' multiplies
    every value by 1e30, 'nan' sends NaN. Its site still declares its honest statistics.
    `as_owner` False: only the slices it sends as a source lie, which are the ones encoded while
    measuring what their owner will decode (`stats`, comm/direct.py `_scatter`); the sums it
    shares for its own chunk (encoded without) stay honest."""

    base: Any
    how: str
    as_owner: bool = True

    @property
    def block(self) -> int:
        return self.base.block

    @property
    def header(self) -> int:
        return self.base.header

    def nbytes(self, n: int) -> int:
        return self.base.nbytes(n)

    def encode(self, x: torch.Tensor, tail: int = 0, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None, weight: float = 1.0, stats: Any = None,
               decoded: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        if self.as_owner or stats is not None:
            x = x * 1e30 if self.how == "huge" else torch.full_like(x, float("nan"))
        return self.base.encode(x, tail, out, scratch, weight, stats, decoded, stream)

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None,
               stats: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        return self.base.decode(buf, n, out, stats, stream)

    def add_decoded(self, total: torch.Tensor, buf: torch.Tensor, n: int, first: bool, scratch: torch.Tensor,
                    stats: torch.Tensor | None = None) -> None:
        self.base.add_decoded(total, buf, n, first, scratch, stats)


def lie_on_the_wire(how: str) -> None:
    """Make this (forked) process a site that lies in everything it encodes, as a source and as the
    owner of a chunk (its shared sums): payloads are `how`, its claimed statistics stay honest.
    Through the codec seam (zeroband/seams.py): every all-reduce from now on encodes with it."""
    from zeroband import seams

    seams.use(replace(seams.current(), codec=lambda codec: LyingCodec(codec, how)))


def lie_as_source(how: str) -> None:
    """Make this (forked) process a site whose contributions are `how` ('huge': 1e30 x, or 'nan')
    while it declares the statistics of its honest pseudo-gradient; as an owner it plays fair."""
    from zeroband import seams

    seams.use(replace(seams.current(), codec=lambda codec: LyingCodec(codec, how, as_owner=False)))


def forge_round_keys(store: dist.Store, prefix: str, rounds: int, sites: int) -> int:
    """Squat every write-once slot of the first `rounds` rounds before the honest sites write them:
    abort verdicts, fail votes, member lists without site 1, a committed counter, all unsigned.
    Returns the number of forged keys."""
    forged = {f"{prefix}committed": "100"}
    for r in range(rounds):
        for a in range(2):
            key = f"{prefix}r{r}/a{a}/"
            forged[key + "verdict"] = "abort"
            forged[key + "members"] = json.dumps({"members": [0], "fresh": [0], "generation": 999})
            for site in range(sites):
                forged[key + f"vote/{site}"] = "fail"
    for key, value in forged.items():
        store.set(key, value)
    return len(forged)


def forge_leaves(store: dist.Store, prefix: str, sites: int, stop: Any) -> int:
    """Until `stop` is set, keep telling everyone that every site left (unsigned leave notices)."""
    writes = 0
    while not stop.wait(0.1):
        for site in range(sites):
            store.set(f"{prefix}leave/{site}", "0")
            writes += 1
    return writes


# ---------------------------------------------------------------------- on-path attacks on the transport's bytes
class Capture:
    """The path between sites, in this (forked) process until `close`: every connection a `Transport`
    dials crosses a relay (zeroband/wan/relay.py, no delay) that keeps each direction's bytes in
    `streams` and, with `rewrite(to_target, offset, chunk)`, sends what it returns in place of a
    chunk (None: the chunk as it is). `samples`: 32-byte windows of every message handed to a
    transport, inside each stream's slice (plaintext that would be readable if it crossed as is)."""

    WINDOW, PER_SLICE = 32, 4

    def __init__(self, rewrite: Callable[[bool, int, bytes], bytes | None] | None = None) -> None:
        from zeroband.comm.transport import Transport

        self.rewrite, self.transport = rewrite, Transport
        self.streams: dict[int, bytearray] = {}  # per (connection, direction): the bytes, in order
        self.samples: list[bytes] = []
        self.relays: list[Any] = []
        self.lock = threading.Lock()
        self.honest = Transport.connect, Transport.send
        Transport.connect = lambda t, addresses: self._connect(t, addresses)  # type: ignore[method-assign]
        Transport.send = lambda t, tensors, dst, tag: self._send(t, tensors, dst, tag)  # type: ignore[method-assign]

    def _tap(self, src: Any, data: bytes) -> bytes | None:
        if not data:  # the end of a stream
            return None
        with self.lock:
            stream = self.streams.setdefault(id(src), bytearray())
            offset = len(stream)
            stream.extend(data)
        if self.rewrite is None:
            return None
        try:
            to_target = src.getpeername() not in {r.target for r in self.relays}  # not from a dialed site
        except OSError:  # closed meanwhile
            return None
        return self.rewrite(to_target, offset, data)

    def _connect(self, transport: Any, addresses: dict[int, str]) -> None:
        from zeroband.wan.relay import DelayRelay

        tapped = dict(addresses)
        for dst in range(transport.rank):  # the lower ranks are those this member dials
            host, port = addresses[dst].rsplit(":", 1)
            self.relays.append(DelayRelay((host, int(port)), 0.0, tap=self._tap))
            tapped[dst] = "{}:{}".format(*self.relays[-1].address)
        self.honest[0](transport, tapped)

    def _send(self, transport: Any, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        from zeroband.comm.transport import as_bytes, slices

        data, w, k = bytes(as_bytes(tensors[0])), self.WINDOW, self.PER_SLICE
        with self.lock:
            for offset, n in slices(len(data), transport.peers[dst].streams):
                if n >= w:
                    spots = {offset + (n - w) * j // (k - 1) for j in range(k)}
                    self.samples += [data[at : at + w] for at in sorted(spots)]
        return self.honest[1](transport, tensors, dst, tag)

    def wire(self) -> list[bytes]:
        with self.lock:
            return [bytes(s) for s in self.streams.values()]

    def close(self) -> None:
        self.transport.connect, self.transport.send = self.honest
        for relay in self.relays:
            relay.close()


def seen(samples: list[bytes], wire: list[bytes]) -> int:
    """How many samples appear somewhere in the captured bytes."""
    return sum(any(s in stream for stream in wire) for s in samples)


def on_path(how: str, to_target: bool, after: int, recorded: bytes = b"") -> Callable[[bool, int, bytes], bytes | None]:
    """A `Capture` rewrite: once, on the first chunk in the given direction (to the dialed site, or
    back) that starts at or past byte `after` of its connection (past the TLS handshake), "alter"
    flips one byte, "replay" sends the chunk twice, "drop" loses it, "inject" sends `recorded` (bytes
    of another connection: an earlier incarnation's) before it."""
    done: list[bool] = []

    def rewrite(towards: bool, offset: int, chunk: bytes) -> bytes | None:
        if done or towards != to_target or offset < after:
            return None
        done.append(True)
        if how == "alter":
            return chunk[:-1] + bytes([chunk[-1] ^ 0x01])
        return {"replay": chunk + chunk, "drop": b"", "inject": recorded + chunk}[how]

    return rewrite


class ReplayingStore(dist.Store):
    """A store as one site sees it through an on-path attacker: reads of the keys in `replay` return
    the recorded values instead (e.g. an earlier incarnation's admission transcript)."""

    def __init__(self, inner: dist.Store, replay: dict[str, bytes]) -> None:
        super().__init__()  # required by the pybind trampoline
        self.inner, self.replay = inner, replay

    def get(self, key: str) -> bytes:
        return self.replay[key] if key in self.replay else self.inner.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)


# ---------------------------------------------------------------------- store attacks (issue 23, items 3-4)
class StoreForger:
    """An outsider who can write to the store, without the secret: every `period_s`, for every key that
    `targets(keys now in the store)` returns, writes its value (bytes) or deletes it (None). Runs on
    a thread of the test process until `stop()`; `writes` counts its operations.

    A store started with the run's secret admits only connections that prove it (store/guard.py),
    so the forger's connection is opened the way a site's is (the test process's $ZEROBAND_SECRET):
    it stands for an on-path attacker who injects into an authenticated store connection (plain TCP
    after the handshake), who still holds no key that signs a value."""

    def __init__(self, host: str, port: int, targets: Any, period_s: float = 0.25) -> None:
        import threading

        self.host, self.port, self.targets, self.period_s, self.writes = host, port, targets, period_s, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StoreForger:
        # imports here, in the caller's thread: a thread importing while the test forks its sites
        # leaves the child holding that module's import lock with no owner, and the site hangs
        from zeroband.store.client import connect_tcp_store

        self.connect = connect_tcp_store
        self.thread.start()
        return self

    def _run(self) -> None:
        from datetime import timedelta

        connect_tcp_store = self.connect
        store = None
        while not self.stopped.wait(self.period_s):
            try:
                store = store or connect_tcp_store(self.host, self.port, timedelta(seconds=2),
                                                   f"tcp://{self.host}:{self.port}")
                for key, value in self.targets(store.list_keys()).items():
                    store.delete_key(key) if value is None else store.set(key, value)
                    self.writes += 1
            except Exception:  # the store is not up yet, or gone: try again
                store = None

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join(timeout=10)
        return self.writes


class StoreOutsider:
    """Someone on the store's host or network without the run's secret who tries, every `period_s`,
    to list and delete every key of a `tcp://` store: with a client holding another secret, and
    with raw requests after a keyless answer (what a store without a secret admits). Runs on a
    thread of the test process until `stop()`, which returns (refused attempts, keys deleted)."""

    def __init__(self, url: str, period_s: float = 0.1) -> None:
        import threading

        self.url, self.period_s, self.refused, self.deleted = url, period_s, 0, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StoreOutsider:
        # imported in the caller's thread: StoreForger.start says why
        from zeroband.store import guard
        from zeroband.store.client import StoreUnreachable, connect_tcp_store

        self.guard, self.connect, self.unreachable = guard, connect_tcp_store, StoreUnreachable
        self.thread.start()
        return self

    def _run(self) -> None:
        import socket
        from datetime import timedelta

        host, port = self.url.removeprefix("tcp://").rsplit(":", 1)
        while not self.stopped.wait(self.period_s):
            try:
                store = self.connect(host, int(port), timedelta(seconds=1), self.url, b"not-the-run-secret-0123456789abc")
                self.deleted += sum(bool(store.delete_key(k)) for k in store.list_keys())
            except self.unreachable:
                self.refused += 1
            try:
                with socket.create_connection((host, int(port)), timeout=1) as s:
                    greeting = s.recv(self.guard.CHALLENGE_BYTES)
                    s.sendall(self.guard.answer(b"", greeting, int(port)) + self.guard.encode([b"list"]))
                    if s.recv(1) == self.guard.ADMITTED:
                        keys = self.guard.read_frame(s)[1:]
                        for key in keys:
                            s.sendall(self.guard.encode([b"del", key]))
                            self.deleted += self.guard.read_frame(s)[1] == b"1"
                    else:
                        self.refused += 1
            except OSError:
                self.refused += 1

    def stop(self) -> tuple[int, int]:
        self.stopped.set()
        self.thread.join(timeout=10)
        return self.refused, self.deleted
