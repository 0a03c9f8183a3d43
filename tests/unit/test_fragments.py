"""Streaming DiLoCo's fragments: how the parameters are split and when each fragment syncs (pure)."""

from __future__ import annotations

import pytest

from zeroband.config import DilocoConfig
from zeroband.membership.rounds import Decision
from zeroband.outer.base import OuterStats, RoundClock
from zeroband.outer.fragments import merged, offsets, split


def test_split_balances_bytes_with_whole_tensors():
    numels = [100, 10, 10, 60, 40, 30, 30, 20]
    parts = split(numels, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(numels)))  # each tensor exactly once
    loads = [sum(numels[i] for i in p) for p in parts]
    assert loads == [100, 100, 100]
    assert all(p == sorted(p) for p in parts)


def test_split_is_the_same_for_one_fragment_and_refuses_more_fragments_than_tensors():
    assert split([5, 7, 1], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="diloco.fragments=4 .* 3 parameter tensors"):
        split([5, 7, 1], 4)


def test_split_breaks_ties_by_index():
    assert split([8, 8, 8, 8], 2) == [[0, 2], [1, 3]]


def test_offsets_stagger_the_fragments_and_the_last_one_ends_on_h():
    assert offsets(8, 4) == [2, 4, 6, 0]
    assert offsets(8, 1) == [0]


@pytest.mark.parametrize("p", [1, 2, 4])
def test_each_inner_step_ends_at_most_one_fragments_round(p):
    cfg = DilocoConfig(inner_steps=8, fragments=p)
    clocks = [RoundClock(cfg, 0, off) for off in offsets(8, p)]
    due = [[c.due(step) for c in clocks] for step in range(1, 33)]
    assert all(sum(d) <= 1 for d in due)
    for k in range(len(clocks)):  # every fragment every H steps
        assert sum(d[k] for d in due) == 4


def test_fragments_need_a_divisor_of_h_and_a_fixed_membership_under_a_budget():
    with pytest.raises(ValueError, match="inner_steps=10 must be a multiple of diloco.fragments=4"):
        DilocoConfig(inner_steps=10, fragments=4)
    with pytest.raises(ValueError, match="needs a fixed membership"):
        DilocoConfig(inner_steps=8, fragments=2, round_seconds=5.0, elastic=True)
    assert DilocoConfig(inner_steps=8, fragments=2, elastic=True).fragments == 2
    assert DilocoConfig(inner_steps=8, fragments=2, round_seconds=5.0).fragments == 2


def test_a_budget_fragment_first_round_ends_at_its_phase():
    """Under a time budget fragment p's first round lasts (p + 1) / P of one, the later ones a whole
    one: boundaries round_seconds / P apart, as H / P steps apart without a budget."""
    cfg = DilocoConfig(inner_steps=8, fragments=4, round_seconds=4.0)
    clocks = [RoundClock(cfg, 0, off) for off in offsets(8, 4)]
    assert [c.budget() for c in clocks] == [1.0, 2.0, 3.0, 4.0]
    clocks[0].rounds = 1
    assert clocks[0].budget() == 4.0


def test_a_decision_names_the_fragment_its_round_syncs_and_old_ones_read_as_none():
    """An elastic round's proposer names its fragment (`topic`): a site without the state contributes
    to that one. A decision written before topics existed reads as the whole model's."""
    d = Decision([0, 2], [2], 5, topic=3)
    assert Decision.from_json(d.to_json()) == d
    assert Decision.from_json('{"members": [0], "fresh": [], "generation": 1}').topic is None


def test_merged_record_adds_bytes_and_names_every_fragment():
    a = OuterStats(3, 1.0, 2.0, 10, 20, 3.0, 1.0, 0.7, 2, fragments=[0], outer_crc=5, timings={"mac": 0.5})
    b = OuterStats(3, 0.5, 1.0, 30, 40, 4.0, 2.0, 0.7, 2, fragments=[1], outer_crc=6, timings={"mac": 0.25})
    m = merged([a, b])
    assert (m.payload_bytes, m.wire_bytes, m.fragments, m.pseudo_grad_norm) == (40, 60, [0, 1], 5.0)
    assert m.timings == {"mac": 0.75} and m.allreduce_s == 1.5
    assert m.outer_crc == merged([a, b]).outer_crc != merged([b, a]).outer_crc
