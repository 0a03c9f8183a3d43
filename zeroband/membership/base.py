"""Who takes part in an outer round: the `Membership` protocol and the fixed membership.

The outer loop (zeroband/outer/diloco.py) computes; a membership answers its questions and never
calls it back. `attempts()` yields the attempts of one round (fixed: exactly one; elastic: one per
generation until a verdict commits, at most `max_retries` + 1, then the round is skipped and the
iteration simply ends). Each `Attempt` says whether this site brings a pseudo-gradient
(`contributes`) and whether anything is averaged (`averages`: False when the round only hands the
run's state over), hands out the round's group (`group()`: elastic forms it then, and hands the
run's state to members that lack it; the group's own watched calls bound every wait on it), turns
a failure inside `with attempt:` into a failed attempt where a round may retry, and answers
`commit()`: whether every member may apply the result. The outer loop averages on that group
itself: no work of the algorithm is ever handed to a membership. `holds_state` is False while a
site waits for the run's state (elastic joiners): the outer loop then takes rounds that
contribute nothing until a peer has handed the state over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from zeroband.comm.group import GlobalGroup
from zeroband.mesh import Topology
from zeroband.trust.auth import Admission, admission
from zeroband.trust.secret import RunSecret

Event = dict[str, Any]


class EventLog:
    """Structured membership events ("membership" records of metrics.jsonl, shapes in
    docs/architecture.md); events before `attach` (the join inside `start`) are kept until then."""

    def __init__(self, site: int) -> None:
        self.site = site
        self.pending: list[Event] = []
        self.sink: Callable[[Event], None] | None = None

    def attach(self, sink: Callable[[Event], None]) -> None:
        self.sink = sink
        for event in self.pending:
            sink(event)
        self.pending.clear()

    def emit(self, event: str, **fields: Any) -> Event:
        record = {"event": event, "site": self.site, **fields}
        if self.sink is None:
            self.pending.append(record)
        else:
            self.sink(record)
        return record


def agree_on_run(group: GlobalGroup, topology: Topology, timeout_s: float) -> None:
    """Before anything crosses the global group: every site proves the shared secret and shows the
    same settings (`topology.fingerprint`); else PeerRefused on every site, naming each differing
    key with both values (zeroband/trust/auth.py). Settings that agree also fix every
    message's size, so a misconfigured site can never make gloo abort on a wrong-size message.
    Runs at every start (fresh, resumed, restarted): the group's session key is this incarnation's."""
    assert topology.store is not None, "agreeing across sites needs the coordination store (sites.store)"
    admit_group(group, topology.store, topology.secret, topology.fingerprint, timeout_s)


def admit_group(group: GlobalGroup, store: dist.Store, secret: RunSecret | None, fingerprint: dict[str, str],
                timeout_s: float) -> Admission:
    """Admission on the group's prefix, after which the group seals under the session key it agreed
    (trust/mac.py): until then its auth refuses to seal or open anything."""
    result = admission(store, group.prefix, group.rank, group.size, secret, fingerprint, timedelta(seconds=timeout_s))
    group.auth = group.auth.for_session(group.context, result.nonces)
    return result


class Attempt(Protocol):
    """One try at a round: the questions the outer loop asks of it, in the order it asks them."""

    contributes: bool  # this site brings a pseudo-gradient (False: it waits for the run's state)
    averages: bool  # the round averages anything (False: it only hands the run's state over)
    topic: int | None  # the fragment the round syncs, as its proposer named it (None: the whole model)

    def __enter__(self) -> Attempt: ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> bool:
        """True (the error is swallowed) where a failed attempt is voted on and retried."""

    def group(self) -> GlobalGroup:
        """The round's group, ready for the outer loop's collectives (call it inside `with attempt:`)."""

    def commit(self) -> bool:
        """Whether every member may apply this attempt's result (elastic: a vote)."""


class Membership(Protocol):
    @property
    def group(self) -> GlobalGroup | None:
        """The group of the current round (fixed: the whole run's)."""

    may_retry: bool  # an attempt may fail and be retried: the outer loop must keep its inputs

    def start(self, resumed: bool) -> None:
        """Admission and the first round's number, before anything else crosses sites."""

    @property
    def holds_state(self) -> bool:
        """False while this site still waits for the run's state (it contributes nothing)."""

    def attempts(self, topic: int | None = None) -> Iterator[Attempt]:
        """This round's attempts; the iteration ends after a commit or when the round is skipped.
        `topic`: the fragment this site's round syncs (None: the whole model)."""

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
        # sites of different shapes: every lane's group is admitted (its own session key), in the run's lane order
        for group in [g for _, g in self.topology.lanes] or [self.group]:
            agree_on_run(group, self.topology, self.timeout_s)

    @property
    def holds_state(self) -> bool:
        return True

    def attempts(self, topic: int | None = None) -> Iterator[Attempt]:
        yield FixedAttempt(self.group)

    def rounds_done(self, local_rounds: int) -> int:
        return local_rounds

    def leave(self) -> None:
        pass  # a fixed group has no membership: the others will fail at the next all-reduce

    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any],
                               checksum_fn: Callable[[], list[torch.Tensor]] | None = None) -> None:
        pass  # nobody joins a fixed run: nothing is ever handed over

    def attach(self, sink: Callable[[Event], None]) -> None:
        """The one group's link, as its probe measured it at start (a "link" record per peer)."""
        for record in self.group.link_records():
            sink({"event": "link", "site": self.topology.world.site_rank, **record})

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FixedAttempt:
    """The one attempt of a fixed round: every site contributes; a failure stops the run."""

    contributes = averages = True
    topic: int | None = None  # each site syncs its own boundary's fragment: every site is at the same one

    def __init__(self, group: GlobalGroup) -> None:
        self.round_group = group

    def __enter__(self) -> FixedAttempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:  # never swallows: a fixed round is not retried
        return False

    def group(self) -> GlobalGroup:
        return self.round_group

    def commit(self) -> bool:
        return True
