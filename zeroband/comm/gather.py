"""The exchange of codecs whose sums do not re-encode (sparse): all-gather the encodings, sum locally.

A direct exchange (comm/direct.py) has each chunk's owner encode the sum of the sites' slices once
more; a sum of sparse contributions has the union of their indices, and a second top-k would drop
most of it. Here every site encodes its whole contribution ONCE, piece by piece, and sends the same
bytes to every peer; every site decodes every site's bytes (its own included: what it sent, not its
fp32 values) and sums them in fp32 in site order. Identical bytes, identical decoding, identical
order: every site ends bitwise identical. Bytes sent per site: (S-1) x the encoded payload.

The review (comm/reduce.py's SentReview) sees the same tables as in a direct exchange: each site
measures, of every source's decoded piece, the slice that `piece_chunks` gives it as owner
(`seen`), and of its own decoded piece the slice of every owner (`sent`); summed over owners that is
the statistics of a source's whole contribution. Sources it rejects are left out of every site's
sum alike (and the survivors rescaled). No site shares a sum, so there is none to check after.

Error feedback: the caller folds the residual into `tensors` before it measures them (so what a
site declares covers what it sends: zeroband/outer/diloco.py), and `error_feedback[i]` receives, in
the units of the input, what this call did not deliver: tensors - decoded / weight (all of it for
an excluded site, weight 0).
"""

from __future__ import annotations

import torch

from zeroband.comm.direct import (
    DEFAULT_PIECE_BYTES,
    Arena,
    DirectExchange,
    Review,
    WireCodec,
    _unflatten,
    all_finite,
    flatten,
    piece_chunks,
)
from zeroband.comm.group import AG_TAG, GlobalGroup
from zeroband.comm.kernels import add_stats
from zeroband.comm.timing import Parts


class GatherExchange(DirectExchange):
    """One all-reduce of `numel` fp32 values as an all-gather of encoded contributions. Construction
    posts every receive (as DirectExchange's does); `run` encodes, sends, reviews and sums."""

    def __init__(self, numel: int, group: GlobalGroup, codec: WireCodec, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 parts: Parts | None = None, arena: Arena | None = None) -> None:
        self._setup(numel, group, codec, parts, arena)
        self.chunks = piece_chunks(numel, self.size, codec.block, piece_bytes)  # a lone site encodes too
        self.spans = [(chunk[0][0], chunk[-1][1]) for chunk in self.chunks]
        self.inbox: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}
        for p, (a, b) in enumerate(self.spans):
            for src in self.peers if b > a else []:
                self.inbox[p, src] = self._recv(b - a, src, AG_TAG + p)
        self.scratch = self.arena.take(4 * max((b - a for a, b in self.spans), default=0), torch.float32)
        self.mine: dict[int, torch.Tensor] = {}  # this site's encoded pieces

    def run(
        self, tensors: list[torch.Tensor], weight: float, error_feedback: dict[int, torch.Tensor] | None = None,
        flat: torch.Tensor | None = None, review: Review | None = None, finite: bool = False,
    ) -> int:
        """In place: tensors <- sum over sites of (weight_site * tensors_site); bytes this site sent."""
        with self.parts("encode"):
            flat = flatten(tensors) if flat is None else flat
            if flat.numel() != self.numel:
                raise ValueError(f"exchange was posted for {self.numel} values, got {flat.numel()}")
            if not finite and not all_finite(flat):  # fail before any message is sent
                raise ValueError("all-reduce got a non-finite value; exclude the site (weight 0) instead")
            held = None if error_feedback is None else flat.clone()  # becomes what was not delivered
            if weight == 0.0:  # not 0 x t: a NaN in an excluded site's tensor must not reach the wire
                flat.zero_()
        seen, sent = torch.zeros(self.size, 2, dtype=torch.float64), torch.zeros(self.size, 2, dtype=torch.float64)
        for p in range(len(self.chunks)):
            self._send_piece(p, flat, 1.0 if weight == 0.0 else weight, sent, seen, held if weight != 0.0 else None)
        for p, src in self.inbox:
            self._measure(p, self._opened(self.inbox, p, src, AG_TAG + p), seen[src])
        keep, scale = (review.decide(seen, sent) if review is not None else ([True] * self.size, None))
        for p in range(len(self.chunks)):
            self._sum_piece(p, flat, keep, scale)
        self._drain()
        with self.parts("decode"):
            if review is not None:
                self.sumsq = float(add_stats_of(flat))
            for t, v in zip(tensors, _unflatten(flat, tensors)):
                if t.data_ptr() != v.data_ptr():  # tensors that are views of `flat` hold the result already
                    t.copy_(v)
        if error_feedback is not None and held is not None:
            for i, r in enumerate(_unflatten(held, tensors)):
                error_feedback[i] = r.clone()
        return self.sent

    def _send_piece(self, p: int, flat: torch.Tensor, weight: float, sent: torch.Tensor, seen: torch.Tensor,
                    held: torch.Tensor | None) -> None:
        """Encode this site's piece p once, send it to every peer, measure what they will decode
        (`sent` per owner's slice, `seen` for its own), and take it from `held` (in input units)."""
        a, b = self.spans[p]
        if b == a:
            return
        buf = self._encode(flat[a:b], weight)
        self.mine[p] = buf
        for i, dst in enumerate(self.peers):
            self._send(buf, dst, AG_TAG + p, first=i == 0)
        with self.parts("review"):
            decoded = self.codec.decode(buf, b - a, out=self.scratch[: b - a])
            for owner, (lo, hi) in enumerate(self.chunks[p]):
                add_stats(sent[owner], decoded[lo - a : hi - a])
            lo, hi = self.chunks[p][self.rank]
            add_stats(seen[self.rank], decoded[lo - a : hi - a])
            if held is not None:
                held[a:b].sub_(decoded.div_(weight))

    def _measure(self, p: int, buf: torch.Tensor, row: torch.Tensor) -> None:
        """row += statistics of this site's owner slice of a peer's decoded piece p."""
        a, b = self.spans[p]
        lo, hi = self.chunks[p][self.rank]
        with self.parts("review"):
            decoded = self.codec.decode(buf, b - a, out=self.scratch[: b - a])
            add_stats(row, decoded[lo - a : hi - a])

    def _sum_piece(self, p: int, flat: torch.Tensor, keep: list[bool], scale: float | None) -> None:
        """flat's piece p <- the kept sources' decoded pieces, added in site order (x `scale`)."""
        a, b = self.spans[p]
        if b == a:
            return
        total, first = flat[a:b], True
        with self.parts("decode"):
            for src in (s for s in range(self.size) if keep[s]):
                buf = self.mine[p] if src == self.rank else self.inbox[p, src][0]
                self.codec.add_decoded(total, buf, b - a, first, self.scratch)
                first = False
            if first:
                total.zero_()
            elif scale is not None:
                total.mul_(scale)


def add_stats_of(values: torch.Tensor) -> float:
    """Sum of squares of `values` as the review measures it."""
    row = torch.zeros(2, dtype=torch.float64)
    add_stats(row, values)
    return float(row[0])
