"""Rogue behaviour for tests/test_attacks.py, all on the test side: wrapped process groups and codecs
that a malicious or broken site would run, and a forger that writes store values without the secret.
Nothing here is a hook in production code."""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    every value by 1e30, 'nan' sends NaN. Its site still declares its honest statistics."""

    base: Any
    how: str

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
        lie = x * 1e30 if self.how == "huge" else torch.full_like(x, float("nan"))
        return self.base.encode(lie, tail, out, scratch, weight, stats, decoded, stream)

    def decode(self, buf: torch.Tensor, n: int, out: torch.Tensor | None = None,
               stats: torch.Tensor | None = None, stream: bool = False) -> torch.Tensor:
        return self.base.decode(buf, n, out, stats, stream)

    def add_decoded(self, total: torch.Tensor, buf: torch.Tensor, n: int, first: bool, scratch: torch.Tensor,
                    stats: torch.Tensor | None = None) -> None:
        self.base.add_decoded(total, buf, n, first, scratch, stats)


def lie_on_the_wire(how: str) -> None:
    """Make this (forked) process a site that lies in everything it encodes, as a source and as the
    owner of a chunk (its shared sums): payloads are `how`, its claimed statistics stay honest."""
    import zeroband.comm.reduce as reduce

    honest = reduce.wire_codec
    reduce.wire_codec = lambda wire: LyingCodec(honest(wire), how)


def lie_as_source(how: str) -> None:
    """Make this (forked) process a site whose contributions are `how` ('huge': 1e30 x, or 'nan')
    while it declares the statistics of its honest pseudo-gradient; as an owner it plays fair."""
    from zeroband.comm.direct import DirectExchange

    honest = DirectExchange._scatter

    def scatter(self: DirectExchange, flat: torch.Tensor, loss: Any, sent: Any, weight: float | None = None) -> None:
        # its own chunk stays honest in `flat` (the exchange weights it where it sums it)
        honest(self, flat * 1e30 if how == "huge" else torch.full_like(flat, float("nan")), loss, sent, weight)

    DirectExchange._scatter = scatter


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
