"""The all-reduce schedule every wire format uses: direct reduce-scatter + all-gather, pipelined.

Why not gloo's all-reduce: over a long link its ring sends a segment and waits for the next one,
so the pipe sits idle for a round trip between segments: a 50 MB all-reduce reached 58% of a
100 Mbit/s link at 100 ms RTT (benchmarks/allreduce.md). Here every message of the whole
exchange is posted at once, so the link never waits on a round trip:

1. every receive of the call is posted first (so no message ever waits for its buffer);
2. reduce-scatter: the flat fp32 contribution is cut into pieces (`piece_values`), each piece
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
import torch.distributed as dist

from zeroband.mesh import GlobalGroup

# Tag = phase base + piece index: a fast site's all-gather never matches a scatter receive.
RS_TAG, AG_TAG = 1 << 24, 2 << 24
MAX_PIECES = 1 << 24
DEFAULT_PIECE_VALUES = 1 << 20  # 4 MB of fp32 per piece (diloco.bucket_mb)


class WireCodec(Protocol):
    """How a 1-D fp32 chunk travels: `block` is the alignment of chunk boundaries (values that
    share a scale stay in one chunk); `nbytes(n)` is the exact encoded size of n values, of which
    `header` bytes are per-message framing."""

    block: int
    header: int

    def nbytes(self, n: int) -> int: ...

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...  # uint8, owns its memory

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor: ...  # fp32


def chunk_bounds(n: int, sites: int, block: int) -> list[tuple[int, int]]:
    """S contiguous [start, end) ranges of whole blocks (some empty when n is tiny)."""
    blocks = -(-n // block)
    cuts = [min(n, (c * blocks // sites) * block) for c in range(sites + 1)]
    return [(cuts[c], cuts[c + 1]) for c in range(sites)]


def piece_chunks(n: int, sites: int, block: int, piece_values: int) -> list[list[tuple[int, int]]]:
    """Per piece of about `piece_values` values (whole blocks), the S chunks as absolute ranges."""
    per_piece = max(block, piece_values // block * block)
    pieces = []
    for start in range(0, max(n, 1), per_piece):
        end = min(n, start + per_piece)
        pieces.append([(start + a, start + b) for a, b in chunk_bounds(end - start, sites, block)])
    if len(pieces) > MAX_PIECES:
        raise ValueError(f"{len(pieces)} pieces exceed the tag space; raise diloco.bucket_mb")
    return pieces


class DirectExchange:
    """One all-reduce of `numel` fp32 values. Construction posts every receive, so peers can start
    sending at once (gloo sends a message only after the receiver announced its buffer: posting
    early hides that round trip behind whatever the caller does next, e.g. the statistics
    exchange); `run` then scatters, reduces, shares and gathers."""

    def __init__(self, numel: int, group: GlobalGroup, codec: WireCodec, piece_values: int = DEFAULT_PIECE_VALUES) -> None:
        self.numel, self.codec = numel, codec
        self.rank, self.size, self.pg, self.group = group.rank, group.size, group.pg, group
        self.chunks = piece_chunks(numel, self.size, codec.block, piece_values) if self.size > 1 else []
        self.peers = group.peers()
        self.sends: list[tuple[dist.Work, torch.Tensor, int]] = []  # gloo reads a buffer until its send completes
        self.sent = 0
        self.scatter_in: dict[tuple[int, int], tuple[torch.Tensor, dist.Work]] = {}
        self.gather_in: dict[tuple[int, int], tuple[torch.Tensor, dist.Work]] = {}
        for p, chunk in enumerate(self.chunks):
            lo, hi = chunk[self.rank]
            for src in self.peers if hi > lo else []:
                self.scatter_in[p, src] = self._recv(hi - lo, src, RS_TAG + p)
            for src in self.peers:
                a, b = chunk[src]
                if b > a:
                    self.gather_in[p, src] = self._recv(b - a, src, AG_TAG + p)

    def run(
        self, tensors: list[torch.Tensor], weight: float, error_feedback: dict[int, torch.Tensor] | None = None,
        flat: torch.Tensor | None = None,
    ) -> int:
        """In place: tensors <- sum over sites of (weight_site * tensors_site); bytes this site sent.
        `flat` may be `flatten(tensors)` made earlier (it is consumed)."""
        flat, held = _contribution(flatten(tensors) if flat is None else flat, tensors, weight, error_feedback)
        if flat.numel() != self.numel:
            raise ValueError(f"exchange was posted for {self.numel} values, got {flat.numel()}")
        if not all_finite(flat):  # fail before any message is sent, not halfway through
            raise ValueError("all-reduce got a non-finite value; exclude the site (weight 0) instead")
        loss = None if held is None else torch.zeros_like(flat)
        self._scatter(flat, loss)
        self._reduce_and_share(flat, loss)
        self._gather(flat)
        for t, v in zip(tensors, _unflatten(flat, tensors)):
            t.copy_(v)
        if error_feedback is not None and held is not None and loss is not None:
            for i, r in enumerate(_unflatten(held.add_(loss), tensors)):
                error_feedback[i] = r.clone()
        return self.sent

    def _recv(self, n: int, src: int, tag: int) -> tuple[torch.Tensor, dist.Work]:
        buf = torch.empty(self.codec.nbytes(n), dtype=torch.uint8)
        return buf, self.pg.recv([buf], src, tag)

    def _send(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        self.sends.append((self.pg.send([buf], dst, tag), buf, dst))
        self.sent += buf.numel()

    def _scatter(self, flat: torch.Tensor, loss: torch.Tensor | None) -> None:
        for p, chunk in enumerate(self.chunks):
            for dst in self.peers:
                a, b = chunk[dst]
                if b == a:
                    continue
                buf = self.codec.encode(flat[a:b])
                self._send(buf, dst, RS_TAG + p)
                if loss is not None:
                    loss[a:b] = flat[a:b] - self.codec.decode(buf, b - a)

    def _reduce_and_share(self, flat: torch.Tensor, loss: torch.Tensor | None) -> None:
        for p, chunk in enumerate(self.chunks):
            lo, hi = chunk[self.rank]
            if hi == lo:
                continue
            total = torch.zeros(hi - lo, dtype=torch.float32)
            for src in range(self.size):  # fixed site order: the sum depends only on the inputs
                if src == self.rank:
                    total += flat[lo:hi]
                else:
                    buf, work = self.scatter_in[p, src]
                    self.group.wait(work, src, f"reduce-scatter piece {p}")
                    total += self.codec.decode(buf, hi - lo)
            buf = self.codec.encode(total)
            for dst in self.peers:
                self._send(buf, dst, AG_TAG + p)
            # The owner keeps exactly what the peers will decode, not its more precise fp32 sum.
            flat[lo:hi] = self.codec.decode(buf, hi - lo)
            if loss is not None:
                loss[lo:hi] = total - flat[lo:hi]

    def _gather(self, flat: torch.Tensor) -> None:
        for (p, src), (buf, work) in self.gather_in.items():
            self.group.wait(work, src, f"all-gather piece {p}")
            a, b = self.chunks[p][src]
            flat[a:b] = self.codec.decode(buf, b - a)
        for work, _, dst in self.sends:
            self.group.wait(work, dst, "sends to drain")


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one new fp32 vector (cheap to start early: it does not depend on the weight)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def all_finite(flat: torch.Tensor) -> bool:
    """No NaN/inf in `flat`. The sum is ~20x cheaper than an elementwise test and is finite whenever
    every value is; only a non-finite sum (NaN/inf, or finite values overflowing) needs the full test."""
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
    piece_values: int = DEFAULT_PIECE_VALUES,
    error_feedback: dict[int, torch.Tensor] | None = None,
) -> int:
    """In place: tensors <- sum over sites of (weight_site * tensors_site), sent through `codec`.

    `weight` is this site's share (1/n for a plain average, 0 for an excluded site). Every site
    ends bitwise identical. Returns the bytes this site sent.
    """
    numel = sum(t.numel() for t in tensors)
    return DirectExchange(numel, group, codec, piece_values).run(tensors, weight, error_feedback)
