"""Who takes part in an outer round: the `Membership` protocol and the fixed membership.

The outer loop (zeroband/outer/diloco.py) computes; a membership decides which sites take part in
a round and gives it the group to all-reduce on. `run_round(prepare)` carries out one round:
`prepare(contribute, reduce)` runs on the main thread (site-group collectives are allowed there)
and returns the cross-site work, a function of the round's `GlobalGroup` that runs on a watched
thread. `run_round` returns that work's result once the round counts, or `NOT_DONE` when it did
not (the elastic membership skips a round that failed too often). `holds_state` is False while a
site waits for the run's state (elastic joiners): the outer loop then takes rounds that contribute
nothing until a peer has handed the state over.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from zeroband.comm.group import GlobalGroup
from zeroband.mesh import Topology
from zeroband.trust.auth import Admission, admission

Exchange = Callable[[GlobalGroup], Any]
Prepare = Callable[[bool, bool], Exchange]  # (contribute, reduce) -> the cross-site work
NOT_DONE = object()  # run_round's result when the round did not count
Event = dict[str, Any]


class EventLog:
    """Structured membership events ("membership" records of metrics.jsonl, shapes in
    docs/architecture.md); events before `attach` (the join inside `start`) are kept until then."""

    def __init__(self, site: int) -> None:
        self.site, self.pending, self.sink = site, [], None

    def attach(self, sink: Callable[[Event], None]) -> None:
        self.sink = sink
        for event in self.pending:
            sink(event)
        self.pending.clear()

    def emit(self, event: str, **fields: Any) -> None:
        record = {"event": event, "site": self.site, **fields}
        if self.sink is None:
            self.pending.append(record)
        else:
            self.sink(record)


def agree_on_run(group: GlobalGroup, topology: Topology, timeout_s: float) -> None:
    """Before anything crosses the global group: every site proves the shared secret and shows the
    same settings (`topology.fingerprint`); else PeerRefused on every site, naming each differing
    key with both values (zeroband/trust/auth.py). Settings that agree also fix every
    message's size, so a misconfigured site can never make gloo abort on a wrong-size message.
    Runs at every start (fresh, resumed, restarted): the group's session key is this incarnation's."""
    admit_group(group, topology.store, topology.secret, topology.fingerprint, timeout_s)


def admit_group(group: GlobalGroup, store: dist.Store, secret: bytes | None, fingerprint: dict[str, str],
                timeout_s: float) -> Admission:
    """Admission on the group's prefix, after which the group seals under the session key it agreed
    (trust/mac.py): until then its auth refuses to seal or open anything."""
    result = admission(store, group.prefix, group.rank, group.size, secret, fingerprint, timedelta(seconds=timeout_s))
    group.auth = group.auth.for_session(group.context, result.nonces)
    return result


class Membership(Protocol):
    group: GlobalGroup | None  # the group of the current round (fixed: the whole run's)
    may_retry: bool  # a round may run `prepare`'s work more than once (it must keep its inputs)

    def start(self, resumed: bool) -> None:
        """Admission and the first round's number, before anything else crosses sites."""

    @property
    def holds_state(self) -> bool:
        """False while this site still waits for the run's state (it contributes nothing)."""

    def run_round(self, prepare: Prepare) -> Any: ...

    def rounds_done(self, local_rounds: int) -> int:
        """Outer rounds the run has completed (for `RoundClock.finished`)."""

    def leave(self) -> None: ...

    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any],
                               checksum_fn: Callable[[], list[torch.Tensor]] | None = None) -> None:
        """State the membership hands to a site that lacks it (the torchft pattern); `checksum_fn`:
        tensors every member must then hold bitwise alike."""

    def attach(self, sink: Callable[[Event], None]) -> None:
        """Where structured events go (the loop's metrics.jsonl); events before it are kept."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedMembership:
    """One cross-site group for the whole run: every site takes part in every round."""

    def __init__(self, group: GlobalGroup, topology: Topology, timeout_s: float) -> None:
        self.topology, self.timeout_s = topology, timeout_s
        self.group = group
        self.may_retry = False

    def start(self, resumed: bool) -> None:
        agree_on_run(self.group, self.topology, self.timeout_s)

    @property
    def holds_state(self) -> bool:
        return True

    def run_round(self, prepare: Prepare) -> Any:
        work = prepare(True, True)
        return self.group.watched(lambda: work(self.group), "outer all-reduce")

    def rounds_done(self, local_rounds: int) -> int:
        return local_rounds

    def leave(self) -> None:
        pass  # a fixed group has no membership: the others will fail at the next all-reduce

    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any],
                               checksum_fn: Callable[[], list[torch.Tensor]] | None = None) -> None:
        pass  # nobody joins a fixed run: nothing is ever handed over

    def attach(self, sink: Callable[[Event], None]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
