"""The straight outer step (issue 25): membership answers questions, the outer loop asks them."""

from __future__ import annotations

import inspect


def test_a_round_retries_then_is_skipped_keeping_local_progress():
    from zeroband.membership.elastic import ElasticMembership

    after_aborted = ElasticMembership.after_aborted
    assert [after_aborted(a, 3) for a in range(4)] == ["retry", "retry", "retry", "skip"]
    assert after_aborted(0, 0) == "skip"  # max_retries = 0: one attempt, then the round is skipped


def test_the_blocking_outer_step_is_one_short_method_that_hands_membership_no_closure():
    """DiLoCo.sync reads top to bottom under 40 lines; membership's protocol takes no callback except
    the cross-site work an attempt runs on its watched thread."""
    from zeroband.membership.base import Attempt, Membership
    from zeroband.outer.diloco import DiLoCo

    lines = inspect.getsource(DiLoCo.sync).splitlines()
    assert len(lines) < 40 and "attempts()" in inspect.getsource(DiLoCo.sync)
    callbacks = {name for cls in (Membership, Attempt) for name, fn in vars(cls).items() if callable(fn)
                 and any("Callable" in str(p.annotation) for p in inspect.signature(fn).parameters.values())}
    assert callbacks == {"exchange", "register_state_dict_fn", "attach"}


def test_a_fixed_round_is_one_attempt_that_commits_and_lets_errors_through():
    import pytest

    from zeroband.membership.base import FixedAttempt

    class Group:
        def watched(self, fn, what):
            return fn()

    attempt = FixedAttempt(Group())
    assert attempt.contributes and attempt.averages
    with attempt:
        assert attempt.exchange(lambda group: 42) == 42
    assert attempt.commit()
    with pytest.raises(RuntimeError, match="peer lost"), attempt:
        raise RuntimeError("peer lost")
