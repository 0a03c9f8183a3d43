"""Rogue behaviour for tests/integration/test_attacks.py, all on the test side: wrapped process groups and codecs
that a malicious or broken site would run, and a forger that writes store values without the secret.
Nothing here is a hook in production code."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist


class ReplayingPG:
    """A process group that, once `replay` is set, re-sends the bytes it sent earlier on the same
    (destination, tag) instead of the new ones: a message replayed from an earlier round."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg, self.replay, self.recorded = pg, False, {}

    def send(self, bufs: list[torch.Tensor], dst: int, tag: int) -> Any:
        if self.replay and (dst, tag) in self.recorded:
            bufs = [self.recorded[dst, tag]]
        else:
            self.recorded.setdefault((dst, tag), bufs[0].clone())
        return self.pg.send(bufs, dst, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg, name)


class TruncatingPG:
    """A process group whose sends lose their last `drop` bytes: a short (wrong-size) message."""

    def __init__(self, pg: dist.ProcessGroup, drop: int = 8) -> None:
        self.pg, self.drop = pg, drop

    def send(self, bufs: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self.pg.send([bufs[0][: -self.drop].clone()], dst, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg, name)


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


# ---------------------------------------------------------------------- on-path attacks (issue 23, items 1-2)
def crc_neutral_delta(floats: int = 40) -> bytes:
    """A delta over `floats` fp32 values that flips the sign of some of them and leaves CRC32 unchanged
    wherever it is XORed into a message: CRC32 is linear over GF(2), crc(m ^ d) = crc(m) ^ crc(d) ^
    crc(0...0), so any set of sign bits whose CRC contributions XOR to zero will do; 40 candidates in
    a 32-bit space always contain one (Gaussian elimination). Its contribution is the polynomial of
    the delta times x^k modulo CRC32's generator, and shifting a multiple of it keeps it a multiple:
    the same delta at any offset, or at many, keeps the CRC."""
    n, zero = 4 * floats, zlib.crc32(bytes(4 * floats))

    def sign_flips(mask: int) -> bytes:
        d = bytearray(n)
        for i in range(floats):
            d[4 * i + 3] = 0x80 if mask >> i & 1 else 0  # the sign bit of little-endian fp32 value i
        return bytes(d)

    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (CRC contribution, which sign bits)
    for i in range(floats):
        c, mask = zlib.crc32(sign_flips(1 << i)) ^ zero, 1 << i
        while c:
            top = c.bit_length() - 1
            if top not in basis:
                basis[top] = (c, mask)
                break
            c, mask = c ^ basis[top][0], mask ^ basis[top][1]
        else:
            return sign_flips(mask)
    raise AssertionError("unreachable: more candidates than CRC bits")


class BroadcastTamperer:
    """On the path into a site: XORs `delta` into the first broadcast it receives of at least
    `len(delta)` bytes, once gloo delivered it (what a forwarder on the WAN link would rewrite).
    `report` gets the number of values changed and whether the region's CRC32 stayed the same."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, delta: bytes, report: dict) -> None:
        self.pg, self.rank, self.delta, self.report = pg, rank, delta, report

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        work = self.pg.broadcast(tensors, opts)
        buf = tensors[0].view(torch.uint8).view(-1)  # the bytes as they came off the wire
        if opts.rootRank == self.rank or "flipped" in self.report or buf.numel() < len(self.delta):
            return work
        return _ThenTamper(work, buf[: len(self.delta)], self.delta, self.report)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg, name)


@dataclass
class _ThenTamper:
    work: Any
    region: torch.Tensor
    delta: bytes
    report: dict

    def wait(self, *args: Any) -> Any:
        out = self.work.wait(*args)
        before = zlib.crc32(self.region.numpy())
        self.region.bitwise_xor_(torch.frombuffer(bytearray(self.delta), dtype=torch.uint8))
        self.report.update(flipped=sum(b != 0 for b in self.delta[3::4]), crc_kept=zlib.crc32(self.region.numpy()) == before)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def tamper_start_broadcast(repeats: int = 48) -> dict:
    """Make every global group this (forked) process builds receive broadcasts through a tamperer with
    `repeats` copies of `crc_neutral_delta()` back to back (the process-group seam, zeroband/seams.py).
    Returns its report (filled in later)."""
    from zeroband import seams

    report, delta = {}, crc_neutral_delta() * repeats
    seams.use(seams.Seams(pg=lambda pg, rank: BroadcastTamperer(pg, rank, delta, report)))
    return report


class WireTap:
    """On the path out of a site: keeps a copy of every message it sends, by (round, destination,
    tag) (`round` is set by the caller), and sends `swap(key, sealed bytes)` instead where that
    returns a tensor (a replayed or forged message)."""

    def __init__(self, pg: dist.ProcessGroup, swap: Any = None) -> None:
        self.pg, self.swap, self.round, self.sent, self.kept = pg, swap, 0, {}, []

    def send(self, bufs: list[torch.Tensor], dst: int, tag: int) -> Any:
        key = (self.round, dst, tag)
        self.sent[key] = bufs[0].clone()
        other = self.swap(key, bufs[0]) if self.swap else None
        if other is not None:
            self.kept.append(other)  # gloo reads it until the send completes
            bufs = [other]
        return self.pg.send(bufs, dst, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg, name)


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


class StoreDeleter:
    """An outsider with access to the store (on a guarded tcp:// store: on-path into an authenticated
    connection, as StoreForger), without the signing keys, that deletes every key under
    `prefix` every `period_s` (a deletion storm): through a TCPStore client (`tcp://host:port`) or
    straight through etcd's own API (`etcd://endpoints/root`), as anyone holding etcd credentials
    could. Runs on a thread of the test process until `stop()`; `deleted` counts the keys it deleted."""

    def __init__(self, url: str, prefix: str, period_s: float = 0.2) -> None:
        import threading

        self.url, self.prefix, self.period_s, self.deleted = url, prefix, period_s, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StoreDeleter:
        # built (and imported) in the caller's thread: StoreForger.start says why
        self.delete = self._etcd() if self.url.startswith("etcd://") else self._tcp()
        self.thread.start()
        return self

    def _run(self) -> None:
        delete = self.delete
        while not self.stopped.wait(self.period_s):
            try:
                self.deleted += delete()
            except Exception:  # the store is not up yet, or gone: try again
                pass

    def _tcp(self) -> Any:
        from datetime import timedelta

        from zeroband.store.client import connect_tcp_store

        host, port = self.url.removeprefix("tcp://").rsplit(":", 1)
        box: list[Any] = []

        def delete() -> int:
            # connected the way a site is (StoreForger's docstring says why), once the store is up
            box[:] = box or [connect_tcp_store(host, int(port), timedelta(seconds=2), self.url)]
            keys = [k for k in box[0].list_keys() if k.startswith(self.prefix)]
            return sum(bool(box[0].delete_key(k)) for k in keys)

        return delete

    def _etcd(self) -> Any:
        import base64

        from etcd3gw.client import Etcd3Client

        endpoints, root = self.url.removeprefix("etcd://").split("/", 1)
        host, port = endpoints.split(",")[0].rsplit(":", 1)
        client = Etcd3Client(host, int(port), api_path="/v3/")
        start = f"{root}/kv/{self.prefix}".encode()
        end = start[:-1] + bytes([start[-1] + 1])
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731

        def delete() -> int:
            reply = client.post(client.get_url("/kv/deleterange"), json={"key": b64(start), "range_end": b64(end)})
            return int(reply.get("deleted", 0))

        return delete

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join(timeout=10)
        return self.deleted
