"""The global group: rank i of every site (axis "site"), and every point-to-point tag used on it.

FSDP rank i holds the same shard on every site, so rank i only ever exchanges its own shard: S-way
groups, W of them in parallel. Only these groups cross the WAN. They are built from a separate
coordination store, never from torchrun's rendezvous, because each site is its own torchrun job.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from zeroband import seams
from zeroband.comm.link import LinkPolicy, LinkProbe, bound_note, wait_bound
from zeroband.comm.transport import Transport
from zeroband.comm.work import ProcessGroupLike, Work
from zeroband.trust.auth import ADMIT_REFUSE_S, PeerRefused, Verdict, frame
from zeroband.trust.mac import NO_AUTH, WireAuth
from zeroband.trust.secret import RunSecret
from zeroband.trust.signed import ForgedValue, SealedStore, SignedStore, exchange, remember, track_refusals
from zeroband.watchdog import PeerTimeout, Ticker, Watch, _sites, read_by_all, wait_keys

T = TypeVar("T")
OPEN, SECRET = "without a shared secret", "with a shared secret"  # how a site admits peers (rendezvous)
# Point-to-point tags of the global group, one place for all of them so none collide. comm/direct.py
# adds the piece number (< MAX_PIECES) to RS_TAG / AG_TAG.
MAX_PIECES = 1 << 24
RS_TAG, AG_TAG = 1 << 24, 2 << 24  # reduce-scatter and all-gather pieces (comm/direct.py)
STATS_TAG = 3 << 24  # post_scalars rows


class GlobalGroup:
    """Rank `rank` of `size` sites; every collective is bounded by the group's timeout.

    Every wait goes through `self.watch` (zeroband/watchdog.py), which records whom it waits for;
    `watched(fn, what)` runs blocking cross-site work on a helper thread so that the caller logs
    while it waits and gives up at the deadline with a message naming the phase and the site.

    On nccl, `auth` seals the messages of `post_scalars`, the broadcasts and comm/direct.py
    (trust/mac.py; on the TLS transport it adds no tag: TLS authenticates every byte) under the session key this group's admission agreed (zeroband/membership/base.py
    `admit_group`: new at every start and generation); `prefix` (the group's store prefix: run,
    generation, shard) and the call counter `next_call()` bind each message to this group and this
    call, so a message from an earlier round or incarnation does not verify.
    """

    def __init__(self, pg: ProcessGroupLike, rank: int, size: int, store: dist.Store | None = None,
                 watch: Watch | None = None, prefix: str = "", auth: WireAuth = NO_AUTH,
                 links: dict[int, LinkProbe] | None = None, policy: LinkPolicy | None = None) -> None:
        self.pg = pg
        self.store = store  # keeps the store client (and on site 0 its server) alive with the group
        self.rendezvous: dist.Store | None = None  # the store the C++ group reads (new_global_group)
        self.rank = rank
        self.size = size
        self.watch = watch or Watch(float("inf"))
        self.prefix, self.context, self.auth = prefix, prefix.encode(), auth
        self.calls = 0
        # The link to each peer as the transport's probe measured it at connect (none: nccl, or no probe):
        # a wait for a payload from that peer is bounded by wait_bound (`bound`), not only the timeout.
        self.links, self.policy = links or {}, policy or LinkPolicy()
        self.bound_s = 0.0  # the longest bound chosen since `take_bound` (the round's, in the outer record)
        self.largest_bytes = 0.0  # the largest payload any wait of this group was bounded for (`settle_bound`)
        self.closer: Callable[[], Any] | None = None  # ends the transport's sockets and threads (new_global_group)

    def close(self) -> None:
        """End the group's connections and join its threads, now (mesh.shutdown; idempotent). Without it
        they end when the group is collected, which at exit may be during the interpreter's finalization."""
        if self.closer is not None:
            self.closer()

    def bound(self, peer: int | str, nbytes: float | None) -> tuple[float, str] | None:
        """The bound of a wait for `nbytes` from `peer`: wait_bound of the measured link, clamped to
        [sites.timeout_floor_s, sites.timeout_s]; None where nothing was measured or no size given."""
        probe = self.links.get(peer) if isinstance(peer, int) and nbytes is not None else None
        if probe is None or nbytes is None:
            return None
        p, ceiling = self.policy, self.watch.timeout_s
        seconds = wait_bound(nbytes, probe.link(), p.factor, p.floor_s, ceiling)
        self.bound_s, self.largest_bytes = max(self.bound_s, seconds), max(self.largest_bytes, nbytes)
        return seconds, bound_note(nbytes, probe.link(), p.factor, p.floor_s, ceiling)

    def settle_bound(self) -> float | None:
        """How long the other members may take to finish once this one completed its exchanges (the
        vote wait, membership/rounds.py `overdue`): the bound of the largest payload this group's
        waits carried (an all-reduce's whole uplink: its "sends to drain"), over the slowest measured
        link, so at least sites.timeout_floor_s; None where no link was measured."""
        if not self.links:
            return None
        p, ceiling = self.policy, self.watch.timeout_s
        return max(wait_bound(self.largest_bytes, probe.link(), p.factor, p.floor_s, ceiling)
                   for probe in self.links.values())

    def take_bound(self) -> float:
        """The longest wait bound since the last call (0: none derived from the link)."""
        seconds, self.bound_s = self.bound_s, 0.0
        return seconds

    def link_records(self) -> list[dict[str, Any]]:
        """One `link` metrics record per peer: what the probe measured and the streams kept."""
        return [{"peer": peer, **probe.record()} for peer, probe in sorted(self.links.items())]

    def next_call(self) -> int:
        """Number of this sealed collective: every member calls the group in the same order."""
        self.calls += 1
        return self.calls

    def watched(self, fn: Callable[[], T], what: str) -> T:
        return self.watch.run(fn, what)

    def wait(self, work: Work, peer: int | str, phase: str, nbytes: float | None = None) -> None:
        """Wait for `work` with `peer`; `nbytes`: what the peer's uplink carries before it completes
        (the wait is then bounded by the measured link, `bound`)."""
        self.watch.wait(work, peer, phase, self.bound(peer, nbytes))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op  # type: ignore[assignment]  # torch's stub: ReduceOp.SUM is a RedOpType, reduceOp a ReduceOp
        self.wait(self.pg.allreduce([tensor], opts), "every site", "all-reduce")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.wait(self.pg.broadcast([tensor], opts), src if src != self.rank else "every site", "broadcast")

    def broadcast_sealed(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s `buf` (uint8, ending with `auth.tag_bytes` spare bytes that receive the tag) on every
        member; returns the payload once its tag verified, or raises WireAuthError on a member that
        received it altered. The same bytes go to every member: one message identity, sealed once."""
        fields = (self.next_call(), "broadcast", src, "all")
        if self.rank == src:
            self.auth.seal_tail(buf, self.context, fields)
        self.broadcast(buf, src)
        if self.rank == src:
            return buf[: buf.numel() - self.auth.tag_bytes]
        return self.auth.open(buf, self.context, fields)

    def broadcast_bytes(self, payload: bytes | None, src: int) -> bytes:
        """`src`'s bytes on every member, sealed with the group's key (`payload` is read on `src` only)."""
        size = torch.zeros(8 + self.auth.tag_bytes, dtype=torch.uint8)  # the size is sealed too
        if self.rank == src:
            assert payload is not None, "the source of a broadcast holds its payload"
            size[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        n = int(self.broadcast_sealed(size, src).view(torch.int64).item())
        buf = torch.empty(n + self.auth.tag_bytes, dtype=torch.uint8)
        if self.rank == src and payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return bytes(self.broadcast_sealed(buf, src).numpy())

    def peers(self) -> list[int]:
        """The other sites, starting after this one: rotating the order spreads the load instead of
        every site sending to site 0 first."""
        return [(self.rank + k) % self.size for k in range(1, self.size)]

    def gather_scalars(self, values: list[float], nbytes: float | None = None) -> torch.Tensor:
        """Every site's `values` as a [size, len(values)] float64 table, identical on all sites."""
        return self.post_scalars(values, nbytes)()

    def post_scalars(self, values: list[float], nbytes: float | None = None) -> Callable[[], torch.Tensor]:
        """Start `gather_scalars`; the returned function waits for and returns the table.

        Each site sends its row straight to every peer: one round trip (gloo sends after the
        receiver announced its buffer), where gloo's all-reduce of even a few bytes takes two.
        Work done before waiting hides that round trip.
        `nbytes`: bound the waits by the link as for that payload (None: by the timeout only, where
        a peer may still be computing, e.g. the first exchange of a round).
        """
        table = torch.zeros(self.size, len(values), dtype=torch.float64)
        table[self.rank] = torch.tensor(values, dtype=torch.float64)
        call, peers, row = self.next_call(), self.peers(), table[self.rank].view(torch.uint8)
        inbox = {src: torch.empty(row.numel() + self.auth.tag_bytes, dtype=torch.uint8) for src in peers}
        works = [(self.pg.recv([inbox[src]], src, STATS_TAG), src) for src in peers]
        outbox = [self.auth.seal(row, self.context, (call, STATS_TAG, self.rank, dst)) for dst in peers]
        works += [(self.pg.send([buf], dst, STATS_TAG), dst) for dst, buf in zip(peers, outbox)]

        def wait() -> torch.Tensor:
            for work, peer in works:
                self.wait(work, peer, "statistics", nbytes)
            outbox.clear()  # gloo reads a send buffer until the send completes: kept alive until here
            for src, buf in inbox.items():
                table[src].view(torch.uint8).copy_(self.auth.open(buf, self.context, (call, STATS_TAG, src, self.rank)))
            return table

        return wait


def digest48(tensors: list[torch.Tensor], auth: WireAuth) -> int:
    """The first 48 bits of the keyed replica digest (trust/mac.py): a value a float64 carries exactly,
    for the per-step replica check (SiteStats.crc) and the `outer_crc` metric."""
    return int.from_bytes(auth.replica_digest(tensors)[:6], "big")


def checksum_table(tensors: list[torch.Tensor], group: GlobalGroup) -> list[str]:
    """The keyed digest (trust/mac.py, never CRC32) of this rank's tensors on every member of the group,
    as hex: 16 bytes sent as three 48-bit words, which float64 carries exactly."""
    digest = group.auth.replica_digest(tensors)
    words = [float(int.from_bytes(digest[i : i + 6], "big")) for i in range(0, len(digest), 6)]
    return ["".join(f"{int(w):012x}" for w in row) for row in group.gather_scalars(words).tolist()]


def new_global_group(
    store: dist.Store, prefix: str, site_rank: int, site_count: int, timeout: timedelta, backend: str = "gloo",
    watch: Watch | None = None, mark: str = OPEN, auth: WireAuth = NO_AUTH, streams: int = 1,
    policy: LinkPolicy | None = None,
) -> GlobalGroup:
    """The group of rank i of every site, after a named, logged, bounded rendezvous (`rendezvous`).
    On CPU it runs on zeroband's own transport (comm/transport.py: authenticated, bounded against
    strangers, `streams` connections per peer), never on gloo's listener. `policy` (from [sites],
    in place of `streams`): the streams ("auto": chosen per peer), and the probe of each peer's link
    at connect whose measurement bounds the group's waits (comm/link.py)."""
    policy = policy or LinkPolicy(streams)
    watch = watch or Watch(timeout.total_seconds())
    rendezvous(store, prefix, site_rank, site_count, timeout.total_seconds(), mark, auth.subkey("arrive"))
    # With a secret, the addresses are signed: no process without it can take a site's slot.
    sealed = SealedStore(store, auth.subkey("rendezvous")) if auth.key else store

    def build() -> ProcessGroupLike:
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # torch's stub: Backend (so ProcessGroupNCCL) lacks the send/recv/allreduce/broadcast it has
            return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, sealed), site_rank, site_count, opts)  # type: ignore[return-value]
        return connect_transport(store, sealed, prefix, site_rank, site_count, timeout.total_seconds(),
                                 auth.subkey("transport"), policy)

    watch.current = "every site (connecting the group)"
    built = watch.run(build, "rendezvous")
    links = built.links if isinstance(built, Transport) else {}
    if isinstance(built, Transport) and built.tls is not None:
        auth = replace(auth, tags=False)  # TLS 1.3 authenticates (and encrypts) every byte already
    pg = seams.current().pg(built, site_rank)  # as built, unless a test wraps it (zeroband/seams.py)
    group = GlobalGroup(pg, site_rank, site_count, store, watch, prefix, auth, links, policy)
    group.rendezvous = sealed  # a Python store must outlive the C++ group that may call it (nccl)
    if isinstance(built, Transport):
        group.closer = built.close  # the transport's weakref.finalize: runs once
    return group


def connect_transport(store: dist.Store, sealed: dist.Store, prefix: str, rank: int, size: int, timeout_s: float,
                      subkey: bytes | None, policy: LinkPolicy) -> Transport:
    """Listen, publish this member's address (signed through `sealed`), read every member's and
    connect (probing each link, `policy.probe_s`). A forged address fails `sealed.get` with
    ForgedValue before any connection is made."""
    transport = Transport(rank, size, prefix, subkey, timeout_s, policy.streams, probe_s=policy.probe_s)
    try:
        keys = {s: f"{prefix}zeroband-transport/{s}" for s in range(size)}
        sealed.set(keys[rank], transport.address)
        wait_keys(store, keys, "connecting the group", timeout_s)  # present; verified by the get below
        transport.connect(dict(zip(keys, (v.decode() for v in sealed.multi_get(list(keys.values()))))))
    except BaseException:
        transport.close()
        raise
    return transport


def admission_mark(secret: RunSecret | None) -> str:
    """How this site admits peers: with the run's secret (resolved once, trust/secret.py) or without."""
    return OPEN if secret is None else SECRET


def rendezvous(store: dist.Store, prefix: str, site_rank: int, site_count: int, timeout_s: float,
               mark: str = OPEN, key: bytes | None = None) -> None:
    """Every site announces itself under the group's prefix and waits for the others, naming the
    missing ones in its log and error. `mark` says how the site admits peers: sites that disagree
    (one has a shared secret, one has none) would otherwise wait for each other in different
    protocols until the timeout, so they are refused here, at once, on both sides. With a secret
    (`key`), marks are signed: a forged or deleted mark reads as "not yet" (trust/signed.py
    `exchange`), never as a disagreement that would blame an honest site."""
    keys = {s: f"{prefix}zeroband-arrive/{s}" for s in range(site_count)}
    signed = SignedStore(store, key)
    if key is not None:
        # Every mark that verifies was written with our secret, so it is SECRET. One that keeps failing
        # (another secret) decides nothing here: the signed gloo rendezvous refuses that site by name.
        exchange(signed, keys, site_rank, mark, "rendezvous", timeout_s, ADMIT_REFUSE_S)
        return
    store.set(keys[site_rank], mark)
    wait_keys(store, keys, "rendezvous", timeout_s)
    marks = {s: store.get(k).decode() for s, k in keys.items()}
    if len(set(marks.values())) > 1:
        who = ", ".join(f"site {s} {m.split('.', 1)[-1]}" for s, m in sorted(marks.items()))
        read_by_all(store, f"{prefix}zeroband-marks/", site_rank, site_count, timeout_s)
        raise PeerRefused(site_rank, Verdict([], {site_rank: f"sites disagree on admission ({who}); set the same "
                                                             "sites.secret or ZEROBAND_SECRET on every site"}))


def incarnation_prefix(store: dist.Store, base: str, site_rank: int, site_count: int, timeout_s: float,
                       key: bytes | None = None) -> str:
    """A store prefix of this start of a fixed run, the same on every site, fresh at every start:
    `base` + a hash of every site's fresh random nonce. A persistent store (etcd) keeps the keys of
    earlier starts (gloo addresses, admission values, resume offers); under a fresh prefix none of
    them is ever read again, so a restarted run does not connect to dead addresses.

    Each site publishes its nonce (signed with `key`), then the hash of the nonces it read; a site
    is done when every site's hash equals its own. A hash that holds this site's own fresh nonce
    was written in this start, so a stale or replayed value never matches: it only delays."""
    signed = SignedStore(store, key)
    own, tick = secrets.token_hex(16), Ticker("the start of the run")
    arrive = {s: f"{base}arrive/{s}" for s in range(site_count)}
    done = {s: f"{base}nonces/{s}" for s in range(site_count)}
    deadline, bad_since = time.monotonic() + timeout_s, dict[int, float]()
    seen_nonces: dict[int, bytes] = {}
    seen_hashes: dict[int, bytes] = {}
    while True:
        read = dict(zip(arrive, signed.lookup_many(list(arrive.values()))))  # value and presence of each
        if read[site_rank][0] != own.encode():  # not written yet, or deleted / overwritten since
            signed.set(arrive[site_rank], own)
        nonces = remember(seen_nonces, {s: v for s, (v, _) in read.items() if s != site_rank})
        nonces[site_rank] = own.encode()
        missing = {s for s, v in nonces.items() if v is None} | _mixed(signed, arrive, key, site_rank)
        now = time.monotonic()
        track_refusals({s: r for s, r in read.items() if s != site_rank}, bad_since, now)
        _foreign(missing, {s: t for s, t in bad_since.items() if s in missing}, now)
        if not missing:
            agreed = hashlib.sha256(frame(*(cast(bytes, nonces[s]) for s in range(site_count)))).hexdigest()[:32]  # none missing
            fresh = dict(zip(done, (v for v, _ in signed.lookup_many(list(done.values())))))
            if fresh.pop(site_rank) != agreed.encode():
                signed.set(done[site_rank], agreed)
            hashes = {**remember(seen_hashes, fresh), site_rank: agreed.encode()}
            missing = {s for s, v in hashes.items() if v != agreed.encode()}
            if not missing:
                for k, v in ((arrive[site_rank], own), (done[site_rank], agreed)):
                    signed.keeper.keep(k, v.encode(), timeout_s)  # for the sites that have not read them yet
                return f"{base}{agreed}/"
        if time.monotonic() > deadline:
            forged = sorted(k for k in [*arrive.values(), *done.values()] if k in signed.refused)
            why = f"; store keys {forged} held values without a valid HMAC" if forged else ""
            raise PeerTimeout(f"start of the run: {_sites(missing)} did not arrive within {timeout_s:g} s "
                              f"(sites.timeout_s){why}")
        tick.tick(_sites(missing))
        signed.wait_change([*arrive.values(), *done.values()], 0.02)


def _foreign(missing: set[int], bad_since: dict[int, float], now: float) -> None:
    """Stop the start once every missing site's arrival has failed authentication for ADMIT_REFUSE_S
    (`bad_since`, signed.track_refusals: present and refused in one read) while its owner would have
    re-written it: another secret, or an outsider overwriting it all along. One forged write, or any
    number of deletions, only delays; this stops the start with one line naming both causes."""
    if missing and missing == set(bad_since) and all(now - t >= ADMIT_REFUSE_S for t in bad_since.values()):
        raise ForgedValue(f"start of the run: the arrival of {_sites(missing)} was written without the shared "
                          f"secret for {ADMIT_REFUSE_S:g} s (it holds another secret, or an outsider keeps overwriting "
                          "it); check ZEROBAND_SECRET on every site")


def _mixed(signed: SignedStore, keys: dict[int, str], key: bytes | None, me: int) -> set[int]:
    """Without a secret, a signed arrival is a site that has one: refused at once, on this side
    (an insecure site trusts the store anyway). With one, unsigned arrivals only read as absent."""
    if key is None and any(signed.refused.get(k) == "signed" for k in keys.values()):
        raise PeerRefused(me, Verdict([], {me: "sites disagree on admission (a site has a shared secret, this one "
                                               "has none); set the same sites.secret or ZEROBAND_SECRET on every site"}))
    return set()
