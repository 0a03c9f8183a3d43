"""The all-reduce schedule every wire format uses: direct reduce-scatter + all-gather, pipelined.

Why not gloo's all-reduce: over a long link its ring sends a segment and waits for the next one,
so the pipe sits idle for a round trip between segments (how much of a long link it reaches, and
how much this schedule does: benchmarks/allreduce.md). Here every message of the whole
exchange is posted at once, so the link never waits on a round trip:

1. every receive of the call is posted first (so no message ever waits for its buffer);
2. reduce-scatter: the flat fp32 contribution is cut into pieces of `piece_bytes` of fp32 values (diloco.piece_mb), each piece
   into S block-aligned chunks, chunk c of every piece owned by site c. Piece by piece, every site
   encodes its slice of each peer's chunk ONCE and sends it straight to the owner; encoding piece
   k+1 overlaps sending piece k;
3. as a piece's slices arrive, the owner decodes them and sums in fp32 in site order (its own
   slice exact, it never crosses the wire), encodes the sum ONCE, sends the same bytes to every
   peer and replaces its own copy by the decoded bytes; these all-gather sends queue behind the
   scatter, so the uplink stays busy until the last byte;
4. every other chunk is decoded from its owner's bytes.

Every site decodes identical bytes with identical arithmetic, so all sites end bitwise identical
(a ring that re-encodes partial sums at every hop leaves replicas drifting apart), and each value
is encoded once per phase, so errors do not compound with S. Bytes sent per site: 2(S-1)/S of the
encoded payload, the same as a ring.

Error feedback (optional): `error_feedback[i]` holds, in the units of the output, what encoding
lost from this site's share of tensor i: the scatter loss of the slices it sent plus, for the
chunks it owns, the gather loss of the reduced sum. The next call adds it to this site's
contribution, so over many calls the outputs sum to the exact sums up to the last residual.
"""

from __future__ import annotations

from typing import Protocol

import torch

# Tag = phase base + piece index: a fast site's all-gather never matches a scatter receive.
from zeroband.comm.group import AG_TAG, MAX_PIECES, RS_TAG, GlobalGroup
from zeroband.comm.kernels import Row, kernels, streams
from zeroband.comm.timing import Parts
from zeroband.comm.work import Work

DEFAULT_PIECE_BYTES = 4 << 20  # 4 MB of fp32 values per piece (diloco.piece_mb)


class WireCodec(Protocol):
    """How a 1-D fp32 chunk travels: `block` is the alignment of chunk boundaries (values that
    share a scale stay in one chunk); `nbytes(n)` is the exact encoded size of n values, of which
    `header` bytes are per-message framing."""

    @property
    def block(self) -> int: ...
    @property
    def header(self) -> int: ...

    def nbytes(self, n: int) -> int: ...

    def encode(self, x: torch.Tensor, tail: int = 0, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None, weight: float = 1.0, stats: Row = None,
               decoded: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor: ...  # + what peers decode

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None,
               stats: Row = None, stream: bool = False) -> torch.Tensor: ...  # fp32; stats += (sum sq, non-finite)

    def add_decoded(self, total: torch.Tensor, buf: torch.Tensor, n: int, first: bool, scratch: torch.Tensor,
                    stats: Row = None) -> None: ...  # total = (+0 if first else total) + decoded


def chunk_bounds(n: int, sites: int, block: int) -> list[tuple[int, int]]:
    """S contiguous [start, end) ranges of whole blocks (some empty when n is tiny)."""
    blocks = -(-n // block)
    cuts = [min(n, (c * blocks // sites) * block) for c in range(sites + 1)]
    return [(cuts[c], cuts[c + 1]) for c in range(sites)]


def piece_chunks(n: int, sites: int, block: int, piece_bytes: int) -> list[list[tuple[int, int]]]:
    """Per piece of about `piece_bytes` of fp32 values (whole blocks), the S chunks as absolute ranges."""
    values = max(1, piece_bytes // 4)
    per_piece = max(block, values // block * block)
    pieces = []
    for start in range(0, max(n, 1), per_piece):
        end = min(n, start + per_piece)
        pieces.append([(start + a, start + b) for a, b in chunk_bounds(end - start, sites, block)])
    if len(pieces) > MAX_PIECES:
        raise ValueError(f"{len(pieces)} pieces exceed the tag space; raise diloco.piece_mb")
    return pieces


class Arena:
    """Memory that every exchange of one caller reuses: messages, sums and scratch. Fresh memory
    costs a page fault per 4 KB on first touch: at 100M parameters that was most of the outer step's
    local work (docs/results/outer_step.md). Each exchange takes what it needs in order; what did not fit is allocated fresh and
    the arena grows to it for the next exchange. One exchange at a time, and only after the last
    one completed: a failed or abandoned exchange's receives could still land (DiLoCo.reduce lends
    its arena to one exchange and takes it back only from one that completed)."""

    ALIGN = 64

    def __init__(self) -> None:
        self.buf, self.used, self.need = torch.empty(0, dtype=torch.uint8), 0, 0

    def start(self) -> None:
        if self.need > self.buf.numel():
            self.buf = torch.empty(self.need, dtype=torch.uint8)
        self.used = 0

    def take(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        start, self.used = self.used, self.used + -(-nbytes // self.ALIGN) * self.ALIGN
        self.need = max(self.need, self.used)
        if self.used > self.buf.numel():
            return torch.empty(nbytes, dtype=torch.uint8).view(dtype)
        return self.buf[start : start + nbytes].view(dtype)


class Review(Protocol):
    """What every site checks of what the others sent (comm/reduce.py). `use[s]` says which sources
    enter the sums. `decide(seen, sent)` gets [S, 2] tables of (sum of squares, non-finite count):
    of what each source sent to this site's chunk, and of what this site sent to each owner; it
    returns, identically on every site, the sources to keep and the factor to rescale their sum by
    (None: keep the sums as they are). `check_gathered(got)` gets the same statistics of each
    owner's shared sum and raises if an owner shared something its inputs cannot add up to."""

    use: list[bool]

    def decide(self, seen: torch.Tensor, sent: torch.Tensor) -> tuple[list[bool], float | None]: ...

    def check_gathered(self, got: torch.Tensor) -> None: ...


class DirectExchange:
    """One all-reduce of `numel` fp32 values. Construction posts every receive, so peers can start
    sending at once (gloo sends a message only after the receiver announced its buffer: posting
    early hides that round trip behind whatever the caller does next, e.g. the statistics
    exchange); `run` then scatters, reduces, shares and gathers.

    On the TLS transport every byte is authenticated by TLS (a forged, replayed or truncated record
    fails its connection). On nccl every message is sealed with the group's `auth` (trust/mac.py)
    and opened before it is decoded: such a message raises WireAuthError here, in Python.

    `parts` (comm/timing.py) receives the seconds spent encoding, sealing and opening (mac),
    waiting for peers and handing messages to the transport (network_wait), decoding and summing (decode) and checking what peers sent
    (review)."""

    def __init__(self, numel: int, group: GlobalGroup, codec: WireCodec, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 parts: Parts | None = None, arena: Arena | None = None) -> None:
        self._setup(numel, group, codec, parts, arena)
        self.chunks = piece_chunks(numel, self.size, codec.block, piece_bytes) if self.size > 1 else []
        self.own = torch.zeros(2, dtype=torch.float64)  # statistics of the chunks this site owns, as shared
        self.own_weight = 1.0  # what this site's own slices are multiplied by when it sums them
        self.stream = streams(4 * numel)  # results land in a vector larger than the cache: write past it
        self.scatter_in: dict[tuple[int, int], tuple[torch.Tensor, Work | None]] = {}
        self.gather_in: dict[tuple[int, int], tuple[torch.Tensor, Work | None]] = {}
        for p, chunk in enumerate(self.chunks):
            lo, hi = chunk[self.rank]
            for src in self.peers if hi > lo else []:
                self.scatter_in[p, src] = self._recv(hi - lo, src, RS_TAG + p)
            for src in self.peers:
                a, b = chunk[src]
                if b > a:
                    self.gather_in[p, src] = self._recv(b - a, src, AG_TAG + p)
        # decoded peer slices land here, not in fresh memory (reused: no page faults per piece)
        longest = max((b - a for chunk in self.chunks for a, b in chunk), default=0)
        self.scratch = self.arena.take(4 * longest, torch.float32)
        self.total = self.arena.take(4 * longest, torch.float32)  # an owner's sum, one piece at a time

    def _setup(self, numel: int, group: GlobalGroup, codec: WireCodec, parts: Parts | None,
               arena: Arena | None) -> None:
        """What every exchange of `numel` values on `group` holds (comm/gather.py's too): its call, keys, memory."""
        self.numel, self.codec, self.parts, self.arena = numel, codec, parts or Parts(), arena or Arena()
        self.arena.start()
        self.rank, self.size, self.pg, self.group = group.rank, group.size, group.pg, group
        self.auth, self.context, self.call = group.auth, group.context, group.next_call()
        self.peers = group.peers()
        self.sends: list[tuple[Work, torch.Tensor, int]] = []  # gloo reads a buffer until its send completes
        self.sent = 0
        self.sumsq: float | None = None  # of the whole result, when a review measured the others' chunks

    def run(
        self, tensors: list[torch.Tensor], weight: float, error_feedback: dict[int, torch.Tensor] | None = None,
        flat: torch.Tensor | None = None, review: Review | None = None, finite: bool = False,
    ) -> int:
        """In place: tensors <- sum over sites of (weight_site * tensors_site); bytes this site sent.
        `flat` may be `flatten(tensors)` made earlier (it is consumed). With `review`, owners sum only
        the sources it accepts after seeing what they sent, before any sum is shared. `finite`: the
        caller's own statistics of `tensors` found no NaN/inf, so the up-front check is skipped and
        the weight is applied piece by piece, while each piece is in cache for its encoding."""
        deferred = finite and error_feedback is None and weight != 0.0
        with self.parts("encode"):
            if deferred:
                flat, held = flatten(tensors) if flat is None else flat, None
            else:
                flat, held = _contribution(flatten(tensors) if flat is None else flat, tensors, weight, error_feedback)
            if flat.numel() != self.numel:
                raise ValueError(f"exchange was posted for {self.numel} values, got {flat.numel()}")
            if not deferred and not all_finite(flat):  # fail before any message is sent, not halfway through
                raise ValueError("all-reduce got a non-finite value; exclude the site (weight 0) instead")
        loss = None if held is None else torch.zeros_like(flat)
        sent = None if review is None else torch.zeros(self.size, 2, dtype=torch.float64)
        self.own_weight = weight if deferred else 1.0
        self._scatter(flat, loss, sent, weight if deferred and weight != 1.0 else None)
        if review is None:  # nothing to check: share each piece as soon as it is summed
            for p in range(len(self.chunks)):
                self._share(p, self._owned(p, flat, loss, None), flat)
        else:
            assert sent is not None  # made whenever there is a review
            self._reviewed(flat, loss, review, sent)
        self._gather(flat, review)
        with self.parts("decode"):
            for t, v in zip(tensors, _unflatten(flat, tensors)):
                if t.data_ptr() != v.data_ptr():  # tensors that are views of `flat` hold the result already
                    t.copy_(v)
        if error_feedback is not None and held is not None and loss is not None:
            for i, r in enumerate(_unflatten(held.add_(loss), tensors)):
                error_feedback[i] = r.clone()
        return self.sent

    def _recv(self, n: int, src: int, tag: int) -> tuple[torch.Tensor, Work]:
        buf = self.arena.take(self.codec.nbytes(n) + self.auth.tag_bytes)
        return buf, self.pg.recv([buf], src, tag)

    def _encode(self, x: torch.Tensor, weight: float = 1.0, stats: Row = None,
                decoded: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        with self.parts("encode"):
            tail = self.auth.tag_bytes  # room for the tag: sealing copies nothing
            buf = self.arena.take(self.codec.nbytes(x.numel()) + tail)
            return self.codec.encode(x, tail, buf, self.scratch, weight, stats, decoded, stream)

    def _send(self, buf: torch.Tensor, dst: int, tag: int, first: bool = True) -> None:
        """Seal and send `buf` (an `_encode` result); the first send of a buffer seals it in place,
        later ones (the same bytes to another peer, another tag) a copy, as gloo still reads it."""
        fields = (self.call, tag, self.rank, dst)
        with self.parts("mac"):
            if not first:
                buf = self.arena.take(buf.numel()).copy_(buf)
            sealed = self.auth.seal_tail(buf, self.context, fields)
        with self.parts("network_wait"):  # gloo may write into the socket on this thread: the transport's time
            self.sends.append((self.pg.send([sealed], dst, tag), sealed, dst))
        self.sent += sealed.numel()

    def _opened(self, inbox: dict, p: int, src: int, tag: int) -> torch.Tensor:
        """The payload of a received message, once it arrived and its tag verified (a gloo work is
        waited on only once: the verified payload replaces it in `inbox`)."""
        buf, work = inbox[p, src]
        if work is not None:
            with self.parts("network_wait"):  # src's uplink carries this message to each of its peers
                self.group.wait(work, src, f"{'reduce-scatter' if tag < AG_TAG else 'all-gather'} piece {p}",
                                nbytes=buf.numel() * (self.size - 1))
            with self.parts("mac"):
                buf = self.auth.open(buf, self.context, (self.call, tag, src, self.rank))
            inbox[p, src] = (buf, None)
        return buf

    def _scatter(self, flat: torch.Tensor, loss: torch.Tensor | None, sent: torch.Tensor | None,
                 weight: float | None = None) -> None:
        """Send each owner this site's slice of its chunk; `sent` accumulates the statistics of what the
        owners will decode, measured by the encoding pass. `weight` (deferred from `run`): the slices go
        out as the encoding of weight x slice (this site's own chunk gets it where it is summed)."""
        for p, chunk in enumerate(self.chunks):
            for dst in self.peers:
                a, b = chunk[dst]
                if b == a:
                    continue
                decoded = None if loss is None else self.scratch[: b - a]  # what the owner will decode
                buf = self._encode(flat[a:b], 1.0 if weight is None else weight,
                                   stats=None if sent is None else sent[dst], decoded=decoded)
                self._send(buf, dst, RS_TAG + p)
                if decoded is not None and loss is not None:  # decoded exists only beside loss
                    with self.parts("review"):
                        torch.sub(flat[a:b], decoded, out=loss[a:b])

    def _sum(self, p: int, flat: torch.Tensor, use: list[bool] | None,
             seen: torch.Tensor | None = None) -> torch.Tensor | None:
        """fp32 sum of the sources in `use` (all: None) of this site's chunk of piece p, in fixed
        site order so it depends only on the inputs; `seen` accumulates what each source sent (every
        source's, used or not: measured in the pass that decodes and adds it)."""
        lo, hi = self.chunks[p][self.rank]
        if hi == lo:
            return None
        n, k = hi - lo, kernels()
        total, first = self.total[:n], True
        for src in range(self.size):
            row, used = None if seen is None else seen[src], use is None or use[src]
            if src == self.rank:  # exact: its own slice never crosses the wire
                with self.parts("decode"):
                    into = total if used else self.scratch[:n]  # unused: only its statistics
                    k.add_f32(into, flat[lo:hi], self.own_weight, first or not used, self.scratch, row)
            else:
                buf = self._opened(self.scatter_in, p, src, RS_TAG + p)
                with self.parts("decode"):
                    if used:
                        self.codec.add_decoded(total, buf, n, first, self.scratch, row)
                    elif row is not None:
                        self.codec.decode(buf, n, self.scratch[:n], row)
            first = first and not used
        return total.zero_() if first else total

    def _reviewed(self, flat: torch.Tensor, loss: torch.Tensor | None, review: Review, sent: torch.Tensor) -> None:
        """Sum and encode every piece, let `review` judge the sources on what they sent, sum and encode
        again if it rejected one, and only then share: no sum that includes a rejected source ever
        leaves this site. What waits for the verdict is the encoded bytes, not the fp32 sums: half the
        memory, and the sums stay in cache (kept, they were the largest memory traffic of the step)."""
        seen = torch.zeros(self.size, 2, dtype=torch.float64)
        owned = [self._owned(p, flat, loss, review.use, seen) for p in range(len(self.chunks))]
        keep, scale = review.decide(seen, sent)
        for p, buf in enumerate(owned):
            if scale is not None and buf is not None:
                buf = self._owned(p, flat, loss, keep, scale=scale)
            self._share(p, buf, flat)

    def _owned(self, p: int, flat: torch.Tensor, loss: torch.Tensor | None, use: list[bool] | None,
               seen: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor | None:
        """This site's chunk of piece p summed over the sources in `use` (x `scale`) and encoded once;
        with error feedback, what the encoding lost goes into `loss`."""
        total = self._sum(p, flat, use, seen)
        if total is None:
            return None
        if scale is not None:
            total.mul_(scale)
        lo, hi = self.chunks[p][self.rank]
        decoded = None if loss is None else self.scratch[: hi - lo]
        buf = self._encode(total, decoded=decoded)
        if decoded is not None and loss is not None:  # decoded exists only beside loss
            torch.sub(total, decoded, out=loss[lo:hi])
        return buf

    def _share(self, p: int, buf: torch.Tensor | None, flat: torch.Tensor) -> None:
        """Send this site's encoded chunk of piece p, the same bytes to every peer, and keep exactly
        what they decode (not its fp32 sum), with its statistics."""
        if buf is None:
            return
        lo, hi = self.chunks[p][self.rank]
        for i, dst in enumerate(self.peers):
            self._send(buf, dst, AG_TAG + p, first=i == 0)
        with self.parts("decode"):
            self.codec.decode(buf, hi - lo, out=flat[lo:hi], stats=self.own, stream=self.stream)

    def _gather(self, flat: torch.Tensor, review: Review | None) -> None:
        got = torch.zeros(self.size, 2, dtype=torch.float64)
        for p, src in self.gather_in:
            a, b = self.chunks[p][src]
            buf = self._opened(self.gather_in, p, src, AG_TAG + p)
            with self.parts("decode"):
                self.codec.decode(buf, b - a, out=flat[a:b], stats=None if review is None else got[src],
                                  stream=self.stream)
        self._drain()
        if review is not None:
            review.check_gathered(got)
            self.sumsq = float(self.own[0] + got[:, 0].sum())


    def _drain(self) -> None:
        """Wait until every send of this exchange left (gloo reads a buffer until then)."""
        with self.parts("network_wait"):
            left = sum(buf.numel() for _, buf, _ in self.sends)  # what may still sit in this site's uplink
            for work, buf, dst in self.sends:
                self.group.wait(work, dst, "sends to drain", nbytes=left)
                left -= buf.numel()


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one fp32 vector that the caller may consume (cheap to start early: it does not
    depend on the weight). Tensors that already are consecutive views of one fp32 vector (the outer
    step's pseudo-gradient) give that vector itself, with no copy: the result lands in place."""
    base = flat_base(tensors)
    return base if base is not None else torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def flat_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D fp32 vector that `tensors` tile exactly, in order, as contiguous views; else None."""
    if not tensors or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    first, offset = tensors[0], tensors[0].storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    numel = offset - first.storage_offset()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def all_finite(flat: torch.Tensor) -> bool:
    """No NaN/inf in `flat`. The sum is much cheaper than an elementwise test (benchmarks/kernels.md,
    "finite check") and is finite whenever every value is; only a non-finite sum (NaN/inf, or finite
    values overflowing) needs the full test."""
    return bool(torch.isfinite(flat.sum())) or bool(torch.isfinite(flat).all())


def _contribution(
    flat: torch.Tensor, tensors: list[torch.Tensor], weight: float, error_feedback: dict | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This site's share, in place in `flat`: weight x tensors (+ fed-back residual); and the
    residual held back for later (weight 0: an excluded site sends exact zeros and keeps what it owes)."""
    if weight == 0.0:  # not 0 x t: a NaN in an excluded site's tensor must not reach the wire
        flat.zero_()
    else:
        flat.mul_(weight)
    if error_feedback is None:
        return flat, None
    residual = torch.cat(
        [error_feedback.get(i, torch.zeros_like(t)).reshape(-1).to(torch.float32) for i, t in enumerate(tensors)]
    )
    if weight == 0.0:
        return flat, residual
    return flat.add_(residual), torch.zeros_like(residual)


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def all_reduce_direct(
    tensors: list[torch.Tensor],
    group: GlobalGroup,
    codec: WireCodec,
    weight: float,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    error_feedback: dict[int, torch.Tensor] | None = None,
) -> int:
    """In place: tensors <- sum over sites of (weight_site * tensors_site), sent through `codec`.

    `weight` is this site's share (1/n for a plain average, 0 for an excluded site). Every site
    ends bitwise identical. Returns the bytes this site sent.
    """
    numel = sum(t.numel() for t in tensors)
    return DirectExchange(numel, group, codec, piece_bytes).run(tensors, weight, error_feedback)
