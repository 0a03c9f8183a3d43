"""The sparse codec on real forked sites: the gathered exchange, and DiLoCo runs that stay bitwise
identical across outer steps and resume exactly from a checkpoint (its residual restored)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from tests.helpers import (
    _train,
    _train_expecting_fault,
    diloco_tree,
    elastic_tree,
    final_params,
    outer_records,
)
from tests.multiproc import Died, free_port, run_sites
from zeroband.comm.codecs.sparse import SparseCodec

SHAPES = [(300, 41), (7,), (5000,)]  # a short last chunk, a tiny tensor, two pieces at 32 KB pieces


def inputs(site: int, rnd: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * site + rnd)
    return [torch.randn(s, generator=g) * 1e-3 for s in SHAPES]


def _exchange(port: int, rounds: int, poisoned: int) -> list:
    """Every round on this site: (result, residual, bytes sent, sites used); site `poisoned` declares a NaN."""
    import torch.distributed as dist

    from zeroband.comm.group import new_global_group
    from zeroband.comm.reduce import SiteStats, reduce_across_sites
    from zeroband.config import DilocoConfig

    site, sites = int(os.environ["ZEROBAND_SITE_RANK"]), int(os.environ["ZEROBAND_SITE_COUNT"])
    store = dist.TCPStore("127.0.0.1", port, is_master=site == 0, timeout=timedelta(seconds=30), wait_for_workers=False)
    group = new_global_group(store, "s/", site, sites, timedelta(seconds=30))
    feedback: dict[int, torch.Tensor] = {}
    out = []
    for rnd in range(rounds):
        x = [v + feedback.get(i, torch.zeros_like(v)) for i, v in enumerate(inputs(site, rnd))]  # folded, as DiLoCo does
        sumsq = sum(float(v.square().sum()) for v in x)
        stats = SiteStats(sumsq, 1.0 if site == poisoned and rnd == 1 else 0.0)
        r = reduce_across_sites(x, stats, group, "sparse", 4 * 4096 * 2, feedback, settings=DilocoConfig(comm_dtype="sparse"))
        out.append(([v.clone() for v in x], {i: t.clone() for i, t in feedback.items()}, r.wire_bytes, r.sites_used))
    return out


def test_gathered_sum_is_every_sites_decoded_contribution_in_site_order():
    sites, rounds = 3, 3
    out = run_sites(_exchange, sites, 1, (free_port(), rounds, 2), timeout=60)
    codec, numel = SparseCodec(0.02), sum(torch.Size(s).numel() for s in SHAPES)
    folded = {s: torch.zeros(numel) for s in range(sites)}  # each site's residual, recomputed here
    for rnd in range(rounds):
        results = [out[(s, 0)][rnd] for s in range(sites)]
        for r in results[1:]:  # bitwise identical on every site
            assert all(torch.equal(a, b) for a, b in zip(r[0], results[0][0]))
        used = [s for s in range(sites) if not (s == 2 and rnd == 1)]
        assert all(r[3] == len(used) for r in results)
        total = torch.zeros(numel)
        for s in range(sites):
            x = torch.cat([v.reshape(-1) for v in inputs(s, rnd)]) + folded[s]
            w = 1.0 / len(used) if s in used else 0.0
            decoded = torch.cat([codec.decode(codec.encode(x[a:b], weight=w), b - a) for a, b in ((0, 8192), (8192, numel))])
            if s in used:
                total = decoded if s == used[0] else total + decoded
            folded[s] = x - decoded / w if w else x  # what was not delivered, in input units
            got = torch.cat([results[s][1][i].reshape(-1) for i in range(len(SHAPES))])
            assert torch.equal(got, folded[s]), (rnd, s)
        assert torch.equal(torch.cat([v.reshape(-1) for v in results[0][0]]), total)
    pieces = [codec.nbytes(8192), codec.nbytes(numel - 8192)]
    assert out[(0, 0)][0][2] == (sites - 1) * sum(pieces)  # every byte of its contribution to each peer (insecure: no tag)


def test_sparse_sites_identical_every_outer_step_and_resume_exact(corpus, tmp_path):
    def tree(name):
        return diloco_tree(corpus, tmp_path / name, train={"steps": 8}, checkpoint={"interval": 4, "keep_last": 5},
                           diloco={"comm_dtype": "sparse", "density": 0.05})

    reference = run_sites(_train, 3, 1, (tree("full"),), timeout=110)
    for step in (4, 8):
        a = final_params(tree("full"), 0, step)
        for site in (1, 2):
            b = final_params(tree("full"), site, step)
            assert all(torch.equal(a[k], b[k]) for k in a), f"site {site} differs at step {step}"
    cut = tree("cut")
    run_sites(_train_expecting_fault, 3, 1, (cut,), faults=",".join(f"site{s}:step6:inner:raise" for s in range(3)))
    resumed = run_sites(_train, 3, 1, (cut,), timeout=110)
    for site in range(3):
        assert resumed[(site, 0)]["losses"] == reference[(site, 0)]["losses"][4:]
    a, b = final_params(cut, 0, 8), final_params(tree("full"), 0, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the residual came back from the checkpoint


def test_elastic_sparse_retry_after_a_kill_mid_exchange_keeps_survivors_identical(corpus, tmp_path, store_address):
    """A site dies in the all-reduce: the round is retried among the survivors (each folds its residual
    into a fresh copy of its pseudo-gradient again), every round commits once, and they end identical."""
    tree = elastic_tree(corpus, tmp_path, store_address, steps=8, comm_dtype="sparse")
    out = run_sites(_train, 3, 1, (tree,), faults="site1:step6:allreduce:kill", allow_death=True, timeout=110)
    assert isinstance(out[(1, 0)], Died)
    records = outer_records(tmp_path, 0)
    assert [r["step"] for r in records] == [2, 4, 6, 8] and {r["step"]: r["sites_used"] for r in records}[6] == 2
    a, b = final_params(tree, 0, 8), final_params(tree, 2, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sites_of_different_shapes_fold_each_lanes_residual_and_stay_identical(corpus, tmp_path):
    """Ranks 2, 1, 1: the exchange runs per lane (zeroband/outer/lanes.py), each lane with its own
    residual; every outer step leaves the same keyed digest on every site."""
    from tests.integration.test_shapes import outer_crcs

    tree = diloco_tree(corpus, tmp_path, train={"steps": 6, "global_batch": 4, "micro_batch": 2},
                       diloco={"log_checksum": True, "comm_dtype": "sparse"})
    run_sites(_train, 3, [2, 1, 1], (tree,), timeout=110)
    crcs = [outer_crcs(tree, s) for s in range(3)]
    assert [step for step, _ in crcs[0]] == [2, 4, 6] and crcs[0] == crcs[1] == crcs[2]
