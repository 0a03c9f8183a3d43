"""The straight outer step (issue 25): membership answers questions, the outer loop asks them."""

from __future__ import annotations

import inspect


def test_a_round_retries_then_is_skipped_keeping_local_progress():
    from zeroband.membership.elastic import ElasticMembership

    after_aborted = ElasticMembership.after_aborted
    assert [after_aborted(a, 3) for a in range(4)] == ["retry", "retry", "retry", "skip"]
    assert after_aborted(0, 0) == "skip"  # max_retries = 0: one attempt, then the round is skipped


def test_the_blocking_outer_step_is_one_short_method_that_hands_membership_no_closure():
    """DiLoCo.sync reads top to bottom under 40 lines and averages on the group the attempt hands it;
    membership's protocol takes no work of the algorithm (only the state hand-over's functions and
    the event sink, as torchft's Manager does)."""
    from zeroband.membership.base import Attempt, FixedAttempt, Membership
    from zeroband.membership.elastic import ElasticAttempt
    from zeroband.outer.diloco import DiLoCo

    source = inspect.getsource(DiLoCo.sync)
    assert len(source.splitlines()) < 40 and "membership.attempts(self.topic)" in source and "attempt.group()" in source
    assert "self.reduce(" in source and "partial(" not in source and "lambda" not in source
    callbacks = {name for cls in (Membership, Attempt, FixedAttempt, ElasticAttempt) for name, fn in vars(cls).items()
                 if callable(fn) and any("Callable" in str(p.annotation)
                                         for p in inspect.signature(fn).parameters.values())}
    assert callbacks == {"register_state_dict_fn", "attach"}


def test_a_fixed_round_is_one_attempt_that_commits_and_lets_errors_through():
    import pytest

    from zeroband.membership.base import FixedAttempt

    group = object()  # the run's one cross-site group
    attempt = FixedAttempt(group)
    assert attempt.contributes and attempt.averages
    with attempt:
        assert attempt.group() is group
    assert attempt.commit()
    with pytest.raises(RuntimeError, match="peer lost"), attempt:
        raise RuntimeError("peer lost")


def test_a_watched_call_on_the_group_gives_up_when_its_owner_says_so():
    """The group's own watched entry (where the outer loop's all-reduce runs) polls what the group's
    owner checks (elastic: a member seen dead, the attempt aborted), so membership needs no work
    handed to it to bound the all-reduce."""
    import threading
    import time

    import pytest

    from zeroband.comm.group import GlobalGroup
    from zeroband.watchdog import PeerTimeout, Watch

    stuck = threading.Event()  # a peer that never sends: the helper thread blocks until the test ends
    group = GlobalGroup(pg=None, rank=0, size=2, watch=Watch(timeout_s=20.0))  # type: ignore[arg-type]

    def member_dead() -> None:
        raise ConnectionAbortedError("sites [1] stopped responding")

    group.watch.check = member_dead
    t0 = time.monotonic()
    with pytest.raises(ConnectionAbortedError, match="sites \\[1\\] stopped responding"):
        group.watched(stuck.wait, "outer all-reduce")
    assert time.monotonic() - t0 < 2.0  # the first poll, not the 20 s timeout
    group.watch.check, group.watch.timeout_s = None, 0.3
    with pytest.raises(PeerTimeout, match="outer all-reduce"):
        group.watched(stuck.wait, "outer all-reduce")
    stuck.set()
