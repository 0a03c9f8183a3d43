"""int8 / 4-bit all-reduce on real forked gloo groups: identical sites, bounded error, exact bytes."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pytest
import torch

from tests.multiproc import free_port, run_sites
from zeroband.comm.quantized import _NEAREST, CODEBOOKS, Codec, all_reduce_quantized

SHAPES = [(257, 301), (3,), (1,), (1023,), (64, 65)]  # odd sizes, tiny tensors, partial blocks

TARGET = {8: 1.05, 4: 0.55}  # bytes per parameter of one full pass (x 2(S-1)/S for the all-reduce)


def make_inputs(kind: str, site: int, seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Pseudo-gradient-like fp32 tensors: Gaussian, heavy-tailed (Student t, 3 dof), or zeros."""
    g = torch.Generator().manual_seed(seed * 1000 + site)
    out = []
    for shape in shapes:
        x = torch.randn(shape, generator=g) * 1e-3
        if kind == "heavy":
            chi2 = torch.randn((3, *shape), generator=g).square().sum(0) / 3
            x = x / chi2.sqrt()
        elif kind == "zeros":
            x.zero_()
        out.append(x)
    return out


def exact_sum(kind: str, seed: int, weights: list[float], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    sites = [make_inputs(kind, s, seed, shapes) for s, w in enumerate(weights) if w]
    live = [w for w in weights if w]
    return [sum(w * ts[i].double() for w, ts in zip(live, sites)) for i in range(len(shapes))]


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = sum(float((g.double() - r).square().sum()) for g, r in zip(got, ref))
    den = sum(float(r.square().sum()) for r in ref)
    return math.sqrt(num / den)


def _group(port: int, prefix: str):
    import torch.distributed as dist

    from zeroband.comm.group import new_global_group

    site, sites = int(os.environ["ZEROBAND_SITE_RANK"]), int(os.environ["ZEROBAND_SITE_COUNT"])
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, is_master=site == 0, timeout=timeout, wait_for_workers=False)
    return new_global_group(store, prefix, site, sites, timeout), site


def _run_cases(port: int, cases: list[dict]) -> list:
    """Every case on this site: [(outputs per round, bytes per round, final residuals or None)]."""
    group, site = _group(port, "q/")
    results = []
    for case in cases:
        shapes = case.get("shapes", SHAPES)
        x = make_inputs(case["kind"], site, case["seed"], shapes)
        if case.get("poison") == site:
            x[0][0, 0] = float("nan")  # an excluded site's NaN must never reach the wire
        feedback = {} if case.get("ef") else None
        outs, sent = [], []
        for _ in range(case.get("rounds", 1)):
            t = [v.clone() for v in x]
            sent.append(all_reduce_quantized(t, group, case["bits"], case["weights"][site], error_feedback=feedback))
            outs.append(t)
        results.append((outs, sent, feedback))
    return results


def run(sites: int, cases: list[dict]) -> list[list]:
    """Per case, per site: that site's results."""
    out = run_sites(_run_cases, sites, 1, (free_port(), cases), timeout=60)
    return [[out[(s, 0)][c] for s in range(sites)] for c in range(len(cases))]


def assert_identical(per_site: list) -> None:
    first = per_site[0][0]
    for outs, _, _ in per_site[1:]:
        for a, b in zip(first, outs):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), "sites differ"


# ----------------------------------------------------------------------- codec (no processes)
@pytest.mark.parametrize("name", sorted(CODEBOOKS))
def test_nearest_level_table_equals_bucketize(name):
    book = torch.tensor(CODEBOOKS[name])
    mid = (book[1:] + book[:-1]) / 2
    up, down = torch.tensor(2.0), torch.tensor(-2.0)
    y = torch.cat([torch.rand(200_000) * 2 - 1, mid, torch.nextafter(mid, up), torch.nextafter(mid, down), book])
    assert torch.equal(_NEAREST[name](y.clamp(-1, 1)), torch.bucketize(y.clamp(-1, 1), mid).to(torch.uint8))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 1001])
def test_codec_round_trip_sizes(bits, n):
    codec = Codec(bits, 64)
    x = torch.randn(n)
    x[n // 2] = 0.0
    buf = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(n)
    y = codec.decode(buf, n)
    assert y.shape == (n,) and torch.isfinite(y).all()
    # The block max survives (scale rounds up, so no clipping) and zeros stay exactly zero.
    assert float((y - x).abs().max()) <= float(x.abs().max()) * (0.01 if bits == 8 else 0.2)
    assert y[n // 2] == 0.0
    assert torch.equal(codec.decode(codec.encode(torch.zeros(n)), n), torch.zeros(n))


# ----------------------------------------------------------------------- real groups
@pytest.mark.parametrize("sites", [2, 3, 4])
def test_identical_sites_bounded_error_and_bytes(sites):
    weights = [1.0 / sites] * sites
    cases = [{"kind": k, "bits": b, "seed": 1, "weights": weights} for k in ("gauss", "heavy") for b in (8, 4)]
    n = sum(math.prod(s) for s in SHAPES)
    bound = {("gauss", 8): 0.012, ("heavy", 8): 0.03, ("gauss", 4): 0.14, ("heavy", 4): 0.2}
    for case, per_site in zip(cases, run(sites, cases)):
        assert_identical(per_site)
        err = rel_err(per_site[0][0][0], exact_sum(case["kind"], 1, weights, SHAPES))
        assert err <= bound[case["kind"], case["bits"]], (case, err)
        for _, sent, _ in per_site:
            per_param = sent[0] / n
            ideal = 2 * (sites - 1) / sites * (1.0 if case["bits"] == 8 else 0.5)
            assert ideal <= per_param <= TARGET[case["bits"]] * 2 * (sites - 1) / sites, per_param


def test_excluded_site_zero_weight_nan_and_zeros():
    weights = [0.5, 0.0, 0.5]
    cases = [
        {"kind": "gauss", "bits": 8, "seed": 2, "weights": weights, "poison": 1},
        {"kind": "gauss", "bits": 4, "seed": 2, "weights": weights, "poison": 1, "ef": True},
        {"kind": "zeros", "bits": 4, "seed": 2, "weights": [1.0, 1.0, 1.0]},
    ]
    nan_int8, nan_int4, zeros = run(3, cases)
    for per_site, bound in ((nan_int8, 0.012), (nan_int4, 0.14)):
        assert_identical(per_site)
        assert rel_err(per_site[0][0][0], exact_sum("gauss", 2, weights, SHAPES)) <= bound
        assert per_site[1][1][0] > 0  # the excluded site still takes part
    assert_identical(zeros)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in zeros[0][0][0])


def test_tiny_tensors_more_sites_than_blocks():
    shapes = [(1,), (2,), (5,)]
    cases = [{"kind": "gauss", "bits": b, "seed": 3, "weights": [0.25] * 4, "shapes": shapes} for b in (8, 4)]
    for case, per_site in zip(cases, run(4, cases)):
        assert_identical(per_site)
        assert rel_err(per_site[0][0][0], exact_sum("gauss", 3, case["weights"], shapes)) <= 0.2


def test_single_site_is_exact_and_silent():
    cases = [{"kind": "heavy", "bits": b, "seed": 4, "weights": [0.5]} for b in (8, 4)]
    for per_site in run(1, cases):
        outs, sent, _ = per_site[0]
        assert sent == [0]
        assert all(torch.equal(o, x * 0.5) for o, x in zip(outs[0], make_inputs("heavy", 0, 4, SHAPES)))


def test_error_feedback_mean_of_rounds_converges():
    rounds, weights = 8, [0.5, 0.5]
    cases = [{"kind": "gauss", "bits": 4, "seed": 5, "weights": weights, "rounds": rounds, "ef": ef} for ef in (False, True)]
    plain, fed = run(2, cases)
    truth = exact_sum("gauss", 5, weights, SHAPES)

    def mean_of_rounds(outs: list) -> list[torch.Tensor]:
        return [sum(o[i].double() for o in outs) / rounds for i in range(len(SHAPES))]

    for per_site in (plain, fed):
        assert_identical(per_site)
    # Without feedback rounding is deterministic: every round repeats the same error.
    assert all(torch.equal(a, b) for a, b in zip(plain[0][0][0], plain[0][0][-1]))
    err_plain = rel_err(mean_of_rounds(plain[0][0]), truth)
    err_fed = rel_err(mean_of_rounds(fed[0][0]), truth)
    assert err_fed < 0.25 * err_plain, (err_fed, err_plain)
    # The errors telescope: outputs over all rounds + what the sites still owe = rounds x truth.
    owed = [sum(fed[s][2][i].double() for s in range(2)) for i in range(len(SHAPES))]
    total = [sum(o[i].double() for o in fed[0][0]) + owed[i] for i in range(len(SHAPES))]
    assert rel_err(total, [rounds * t for t in truth]) < 1e-5
