"""The cross-site layout of sites of different shapes (zeroband/comm/layout.py): pure functions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from zeroband.comm.layout import lanes, local_slices, my_lanes, pieces, shard_range, uniform

SHAPES = [(10, 4), (4,), (7, 3), (1, 5), (3,)]  # odd row counts: uneven and empty shards


def chunk_rows(n0: int, ranks: int, rank: int) -> list[int]:
    """The rows torch.chunk gives `rank` (what FSDP2 shards dim 0 with); [] where it runs out."""
    chunks = torch.arange(n0).chunk(ranks)
    return chunks[rank].tolist() if rank < len(chunks) else []


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_shard_range_is_fsdp2s_dim0_chunk(ranks: int) -> None:
    for shape in SHAPES:
        for r in range(ranks):
            rows = chunk_rows(shape[0], ranks, r)
            row = math.prod(shape[1:])
            want = (rows[0] * row, (rows[-1] + 1) * row) if rows else None
            start, stop = shard_range(shape, ranks, r)
            assert (start, stop) == want or (not rows and start == stop)


def test_equal_shapes_give_todays_groups_and_vectors() -> None:
    """Lane r is rank r of every site, holding its whole shard in order: the equal-shape exchange."""
    for ranks in (1, 2, 3):
        assert uniform([ranks] * 3)
        for r in range(ranks):
            (lane,) = my_lanes(SHAPES, [ranks] * 3, 1, r)
            assert lane.owners == (r, r, r) and lane.name() == f"shard{r}"
            slices = local_slices(lane, SHAPES, ranks, r)
            sizes = [shard_range(s, ranks, r) for s in SHAPES]
            assert [(i, 0, b - a) for i, (a, b) in enumerate(sizes) if b > a] == slices


@pytest.mark.parametrize("site_ranks", [[2, 1, 1], [1, 2], [3, 2], [4, 3, 1], [2, 5]])
def test_every_element_is_in_exactly_one_lane_with_its_owner_on_each_site(site_ranks: list[int]) -> None:
    """The lanes tile the flat space; each piece lies inside its owner's shard on every site."""
    assert not uniform(site_ranks)
    seen = {i: torch.zeros(math.prod(s), dtype=torch.int32) for i, s in enumerate(SHAPES)}
    for lane in lanes(SHAPES, site_ranks):
        for p in lane.pieces:
            seen[p.param][p.start : p.stop] += 1
            for site, ranks in enumerate(site_ranks):
                start, stop = shard_range(SHAPES[p.param], ranks, lane.owners[site])
                assert start <= p.start < p.stop <= stop
    assert all(bool((v == 1).all()) for v in seen.values())


@pytest.mark.parametrize("site_ranks", [[2, 1, 1], [3, 2], [4, 3, 1]])
def test_every_site_sends_the_same_values_in_the_same_order(site_ranks: list[int]) -> None:
    """Shard a model's flat values per site, take each lane's slices from the owners' shards: every
    site's owner builds the same vector, so the lane's sum is the same bytes everywhere."""
    full = [torch.arange(math.prod(s), dtype=torch.float32).add_(1000 * i) for i, s in enumerate(SHAPES)]
    for lane in lanes(SHAPES, site_ranks):
        vectors = []
        for site, ranks in enumerate(site_ranks):
            rank = lane.owners[site]
            shard = [f[slice(*shard_range(s, ranks, rank))] for f, s in zip(full, SHAPES)]
            vectors.append(torch.cat([shard[i][a:b] for i, a, b in local_slices(lane, SHAPES, ranks, rank)]))
        assert all(torch.equal(vectors[0], v) for v in vectors[1:])
        assert torch.equal(vectors[0], torch.cat([full[p.param][p.start : p.stop] for p in lane.pieces]))


def test_lanes_are_few_and_each_rank_runs_them_in_one_global_order() -> None:
    """At most sum(R) - S + 1 lanes per parameter boundary set; the order is by first piece, which
    every rank shares, so sequential blocking exchanges never wait on each other in a cycle."""
    site_ranks = [4, 3, 1]
    all_lanes = lanes(SHAPES, site_ranks)
    assert len(all_lanes) <= sum(site_ranks) - len(site_ranks) + 1 + len(SHAPES)
    firsts = [(lane.pieces[0].param, lane.pieces[0].start) for lane in all_lanes]
    assert firsts == sorted(firsts)
    for site, ranks in enumerate(site_ranks):
        for r in range(ranks):
            mine = my_lanes(SHAPES, site_ranks, site, r)
            assert mine == [lane for lane in all_lanes if lane.owners[site] == r]
    assert {lane.name() for lane in all_lanes} >= {"shard0"}
    assert len({lane.name() for lane in all_lanes}) == len(all_lanes)


def test_pieces_cut_only_where_some_site_cuts() -> None:
    cuts = {(p.param, p.start) for p in pieces([(6, 2)], [2, 3])}
    assert cuts == {(0, 0), (0, 4), (0, 6), (0, 8)}  # 2 ranks cut at row 3, 3 ranks at rows 2 and 4
    assert list(itertools.chain.from_iterable(p.owners for p in pieces([(6, 2)], [2, 3]))) == [0, 0, 0, 1, 1, 1, 1, 2]


@pytest.mark.parametrize("old, new", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_outer_state_reshards_to_another_rank_count(old: int, new: int) -> None:
    """A site that comes back with another rank count: each new rank holds exactly its FSDP2 rows of
    the outer copy and momentum the old ranks saved; step counts and plain values stay as they were."""
    from zeroband.outer.lanes import reshard_outer_state, reshard_rank_state

    full = [torch.randn(s) for s in SHAPES]
    moms = [torch.randn(s) for s in SHAPES]

    def rows(t: torch.Tensor, ranks: int, r: int) -> torch.Tensor:
        return t.reshape(-1)[slice(*shard_range(tuple(t.shape), ranks, r))].view(-1, *t.shape[1:])

    def saved(r: int) -> dict:
        state = {i: {"momentum_buffer": rows(m, old, r), "step": torch.tensor(3.0)} for i, m in enumerate(moms)}
        return {"outer": [rows(f, old, r) for f in full], "outer_step": 3, "error_feedback": {0: torch.ones(2)},
                "optimizer": {"state": state, "param_groups": [{"lr": 0.7}]}, "clock": {"rounds": 3}}

    states = [saved(r) for r in range(old)]
    for r in range(new):
        got = reshard_outer_state(states, new, r)
        assert all(torch.equal(g, rows(f, new, r)) for g, f in zip(got["outer"], full))
        assert all(torch.equal(got["optimizer"]["state"][i]["momentum_buffer"], rows(m, new, r)) for i, m in enumerate(moms))
        assert got["optimizer"]["state"][0]["step"].item() == 3.0 and got["optimizer"]["param_groups"] == [{"lr": 0.7}]
        assert got["outer_step"] == 3 and got["clock"] == {"rounds": 3} and got["error_feedback"] == {}
        assert reshard_rank_state("data", [{"epoch": 1}] * old, new, r) == {"epoch": 1}
