"""DiLoCo across sites on real forked processes: global groups over gloo, outer step on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import _train, _train_expecting_fault, diloco_tree, final_params, tiny_overrides
from tests.multiproc import free_port, run_sites
from zeroband.config import DilocoConfig, validate_config


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_h1_diloco_equals_data_parallel(corpus, tmp_path):
    """H=1, inner SGD, outer SGD lr 1 without momentum, fp32: DiLoCo is data parallel."""
    common = {"optim": {"name": "sgd", "lr": 0.5, "grad_clip": 0.0, "warmup_steps": 0, "schedule": "constant"},
              "checkpoint": {"interval": 0}}
    dp = tiny_overrides(corpus, tmp_path / "dp", train={"steps": 4, "global_batch": 4, "micro_batch": 2}, **common)
    run_sites(_train, 1, 2, (dp,))
    dl = diloco_tree(corpus, tmp_path / "dl", train={"steps": 4, "global_batch": 2, "micro_batch": 2}, **common,
                     diloco={"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "comm_dtype": "fp32"})
    run_sites(_train, 2, 1, (dl,))
    ref = final_params(dp, None, 4)
    for site in (0, 1):
        got = final_params(dl, site, 4)
        worst = max(rel(got[k], ref[k]) for k in ref)
        assert worst <= 1e-6, worst


def _outer_by_hand(store: str, deltas: list[list[float]], momentum: float, nesterov: bool, lr: float,
                   overlap: bool = False, rule: str = "delayed", lr_factor=None, **outer) -> list:
    """Site s moves its local copy by -delta[s][t] before outer step t; returns the local params seen
    after every boundary. `outer`: more [diloco] settings; `lr_factor(step)`: the inner schedule."""
    import os

    from zeroband.mesh import fixed_global_group, init_topology, shutdown
    from zeroband.outer.diloco import DiLoCo
    from zeroband.world import World

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    world = World(0, 1, 0, site, 2, torch.device("cpu"))
    topology = init_topology(world, store, "hand", 30, "gloo")
    group = fixed_global_group(topology, "hand")
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0 if site == 0 else 5.0)  # site 0's value must win the initial broadcast
    cfg = DilocoConfig(outer_lr=lr, outer_momentum=momentum, nesterov=nesterov, comm_dtype="fp32",
                       overlap=overlap, overlap_rule=rule, **{"inner_steps": 1, "outer_momentum_warmup": 0, **outer})
    outer = DiLoCo(model, cfg, topology, lr_factor=lr_factor, group=group)
    outer.start()
    seen = [float(model.weight)]
    for t, step_delta in enumerate(deltas[site]):
        with torch.no_grad():
            model.weight -= step_delta
        outer.after_inner_step(t + 1, sync_point=t == len(deltas[site]) - 1)
        seen.append(float(model.weight))
    shutdown()
    return seen


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_nesterov_closed_form(nesterov):
    deltas = [[0.2, -0.1, 0.4], [0.4, 0.3, 0.0]]  # pseudo-gradients per site per outer step
    lr, mu = 0.7, 0.9
    theta, buf, expected = 1.0, 0.0, [1.0]
    for t in range(3):
        g = (deltas[0][t] + deltas[1][t]) / 2
        buf = g if t == 0 else mu * buf + g  # torch.optim.SGD's momentum buffer
        theta -= lr * (g + mu * buf if nesterov else buf)
        expected.append(theta)
    # By hand for Nesterov: step 1 averages 0.3, moves by 0.7 * 1.9 * 0.3 = 0.399 -> 0.601.
    if nesterov:
        assert expected[1] == pytest.approx(0.601)
    store = f"tcp://127.0.0.1:{free_port()}"
    out = run_sites(_outer_by_hand, 2, 1, (store, deltas, mu, nesterov, lr), timeout=60)
    for site in (0, 1):
        assert out[(site, 0)] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_two_by_two_sites_bitwise_identical_after_every_outer_step(corpus, tmp_path, dtype):
    tree = diloco_tree(corpus, tmp_path, train={"steps": 6, "global_batch": 4, "micro_batch": 2},
                       checkpoint={"interval": 2, "keep_last": 5}, diloco={"comm_dtype": dtype})
    out = run_sites(_train, 2, 2, (tree,), timeout=180)
    assert out[(0, 0)]["losses"] != out[(1, 0)]["losses"]  # sites read different data
    for step in (2, 4, 6):
        a, b = final_params(tree, 0, step), final_params(tree, 1, step)
        assert all(torch.equal(a[k], b[k]) for k in a), f"sites differ after outer step at {step} ({dtype})"


def test_fp16_outer_step_close_to_fp32(corpus, tmp_path):
    results = {}
    for dtype in ("fp32", "fp16"):
        tree = diloco_tree(corpus, tmp_path / dtype, train={"steps": 2, "global_batch": 4, "micro_batch": 2},
                           diloco={"comm_dtype": dtype, "inner_steps": 2})
        run_sites(_train, 2, 2, (tree,), timeout=120)
        results[dtype] = final_params(tree, 0, 2)
    from zeroband.models.llama import Llama

    start = Llama(validate_config(tree).model)
    start.init_weights(0)
    init = start.state_dict()
    for k, p32 in results["fp32"].items():
        update = (p32 - init[k]).norm()
        if update > 0:
            assert float((results["fp16"][k] - p32).norm() / update) <= 1e-3, k


@pytest.mark.parametrize("diloco", [{}, {"overlap": True}], ids=["blocking", "overlap"])
def test_diloco_resume_is_exact(corpus, tmp_path, diloco):
    """Overlapped: the first boundary after the resume previews the step on the saved schedule
    (the momentum warm-up is still ramping at the checkpoint)."""
    def tree(name):
        return diloco_tree(corpus, tmp_path / name, train={"steps": 8}, checkpoint={"interval": 4}, diloco=diloco)

    reference = run_sites(_train, 2, 1, (tree("full"),))
    cut = tree("cut")
    faults = "site0:step6:inner:raise,site1:step6:inner:raise"
    run_sites(_train_expecting_fault, 2, 1, (cut,), faults=faults)
    resumed = run_sites(_train, 2, 1, (cut,))
    for site in (0, 1):
        assert resumed[(site, 0)]["losses"] == reference[(site, 0)]["losses"][4:]
    a, b = final_params(cut, 0, 8), final_params(tree("full") | {"output_dir": str(tmp_path / "full")}, 0, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_overlapped_outer_step_follows_the_delayed_rule():
    """Overlap: the average of round k is applied at boundary k+1, local progress made meanwhile kept."""
    deltas = [[0.2, -0.1, 0.4, 0.1], [0.4, 0.3, 0.0, -0.2]]
    lr, mu = 0.7, 0.9
    opt_state = {"buf": None}

    def outer_update(g: float, d: float) -> float:
        opt_state["buf"] = d if opt_state["buf"] is None else mu * opt_state["buf"] + d
        return g - lr * (d + mu * opt_state["buf"])

    g, local, snap, pending, expected = 1.0, [1.0, 1.0], [None, None], None, [[1.0], [1.0]]
    for t in range(4):
        local = [local[s] - deltas[s][t] for s in (0, 1)]
        if pending is not None:  # step 1-3 of the rule: wait, apply late, rebase local progress
            g = outer_update(g, pending)
            local = [g + (local[s] - snap[s]) for s in (0, 1)]
            pending = None
        if t < 3:  # step 4: launch this round's average in the background
            pending = sum(g - x for x in local) / 2
            snap = list(local)
        else:  # the last boundary is a sync point: blocking
            g = outer_update(g, sum(g - x for x in local) / 2)
            local = [g, g]
        for s in (0, 1):
            expected[s].append(local[s])
    # By hand, boundary 1 only launches (nothing applied): site 0 keeps its own step, 1 - 0.2.
    assert expected[0][1] == pytest.approx(0.8) and expected[1][1] == pytest.approx(0.6)
    store = f"tcp://127.0.0.1:{free_port()}"
    out = run_sites(_outer_by_hand, 2, 1, (store, deltas, mu, True, lr, True), timeout=60)
    for site in (0, 1):
        assert out[(site, 0)] == pytest.approx(expected[site], abs=1e-6)
    assert out[(0, 0)][-1] == out[(1, 0)][-1]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_sites_bitwise_identical(corpus, tmp_path, dtype):
    tree = diloco_tree(corpus, tmp_path, train={"steps": 4, "global_batch": 4, "micro_batch": 2},
                       checkpoint={"interval": 2, "keep_last": 5}, diloco={"comm_dtype": dtype, "error_feedback": True})
    out = run_sites(_train, 2, 2, (tree,), timeout=180)
    assert all(r["val"]["val_loss"] == out[(0, 0)]["val"]["val_loss"] for r in out.values())
    for step in (2, 4):
        a, b = final_params(tree, 0, step), final_params(tree, 1, step)
        assert all(torch.equal(a[k], b[k]) for k in a), f"sites differ at step {step} ({dtype})"


def test_overlapped_run_ends_identical(corpus, tmp_path):
    tree = diloco_tree(corpus, tmp_path, train={"steps": 8, "global_batch": 4, "micro_batch": 2},
                       diloco={"overlap": True, "inner_steps": 2})
    out = run_sites(_train, 2, 2, (tree,), timeout=180)
    records = [__import__("json").loads(x) for x in open(tmp_path / "t" / "site0" / "metrics.jsonl")]
    outer = [r for r in records if r["kind"] == "outer"]
    # Boundary 2 only launches; 4 and 6 apply the previous round late; 8 (the end) is blocking.
    assert [(r["step"], r["overlapped"]) for r in outer] == [(4, True), (6, True), (8, False)]
    for step in (8,):
        a, b = final_params(tree, 0, step), final_params(tree, 1, step)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert out[(0, 0)]["val"] == out[(1, 0)]["val"]


def test_cross_site_data_parallel_equals_one_site(corpus, tmp_path):
    """mode=data_parallel: 2 sites x 1 rank take the steps of 1 site x 2 ranks (AdamW, clipping)."""
    one = tiny_overrides(corpus, tmp_path / "one", train={"steps": 4, "global_batch": 4, "micro_batch": 2})
    run_sites(_train, 1, 2, (one,))
    two = diloco_tree(corpus, tmp_path / "two", train={"steps": 4, "global_batch": 2, "micro_batch": 2},
                      diloco={"mode": "data_parallel", "comm_dtype": "fp32"})
    run_sites(_train, 2, 1, (two,))
    ref = final_params(one, None, 4)
    for site in (0, 1):
        got = final_params(two, site, 4)
        assert max(rel(got[k], ref[k]) for k in ref) <= 1e-6


def sgd_step(theta: float, buf: float | None, g: float, lr: float, mu: float, nesterov: bool = True) -> tuple[float, float]:
    """torch.optim.SGD on a scalar (dampening 0): the first step's buffer is the gradient itself."""
    buf = g if buf is None else mu * buf + g
    return theta - lr * (g + mu * buf if nesterov else buf), buf


def test_outer_lr_follows_inner_schedule_and_momentum_warms_up():
    """outer lr = outer_lr x lr_factor(step at the boundary); momentum ramps over 2 outer steps."""
    deltas = [[0.2, -0.1, 0.4], [0.4, 0.3, 0.0]]
    lr, mu = 0.7, 0.9
    theta, buf, expected = 1.0, None, [1.0]
    for t in range(3):
        g = (deltas[0][t] + deltas[1][t]) / 2
        theta, buf = sgd_step(theta, buf, g, lr / (t + 1), mu * min(1.0, (t + 1) / 2))
        expected.append(theta)
    # By hand, step 1: lr 0.7, momentum 0.45, avg 0.3 -> 1 - 0.7 * 0.3 * 1.45 = 0.6955.
    assert expected[1] == pytest.approx(0.6955)
    store = f"tcp://127.0.0.1:{free_port()}"
    out = run_sites(_outer_by_hand_scheduled, 2, 1, (store, deltas, mu, lr), timeout=60)
    for site in (0, 1):
        assert out[(site, 0)] == pytest.approx(expected, abs=1e-6)


def _inverse_step(step: int) -> float:
    return 1.0 / (step + 1)


def _outer_by_hand_scheduled(store: str, deltas: list[list[float]], mu: float, lr: float) -> list:
    return _outer_by_hand(store, deltas, mu, True, lr, lr_factor=_inverse_step, outer_lr_schedule="inner",
                          outer_momentum_warmup=2)


@pytest.mark.parametrize("rule, weight, first", [("eager", 1.0, 0.734), ("eager_share", 0.5, 0.867)])
def test_eager_overlap_follows_the_rule_by_hand(rule, weight, first):
    """Eager: the consensus takes the average one round late; each site's model moves at once by the
    outer step previewed on weight x its fresh pseudo-gradient; the last boundary is blocking."""
    deltas = [[0.2, -0.1, 0.4, 0.1], [0.4, 0.3, 0.0, -0.2]]
    lr, mu = 0.7, 0.9
    g, buf, local, snap, pending = 1.0, None, [1.0, 1.0], [1.0, 1.0], None
    expected = [[1.0], [1.0]]
    for t in range(4):
        local = [local[s] - deltas[s][t] for s in (0, 1)]
        if pending is not None:  # the previous average arrives: consensus step, rebase local progress
            g, buf = sgd_step(g, buf, pending, lr, mu)
            local = [g + (local[s] - snap[s]) for s in (0, 1)]
        fresh = [g - x for x in local]
        if t < 3:
            local = [sgd_step(g, buf, weight * fresh[s], lr, mu)[0] for s in (0, 1)]  # a preview: buf unchanged
            snap, pending = list(local), sum(fresh) / 2
        else:
            g, buf = sgd_step(g, buf, sum(fresh) / 2, lr, mu)
            local = [g, g]
        for s in (0, 1):
            expected[s].append(local[s])
    # By hand, boundary 1: site 0 previews the step on weight x 0.2 -> 1 - 0.7 * 1.9 * 0.2 * weight.
    assert expected[0][1] == pytest.approx(first)
    store = f"tcp://127.0.0.1:{free_port()}"
    out = run_sites(_outer_by_hand, 2, 1, (store, deltas, mu, True, lr, True, rule), timeout=60)
    for site in (0, 1):
        assert out[(site, 0)] == pytest.approx(expected[site], abs=1e-6)
    assert out[(0, 0)][-1] == out[(1, 0)][-1]


def _outer_by_hand_tau(store: str, deltas: list[list[float]], mu: float, lr: float, rule: str) -> list:
    return _outer_by_hand(store, deltas, mu, True, lr, True, rule, inner_steps=2, overlap_steps=1)


@pytest.mark.parametrize("rule, weight", [("delayed", 0.0), ("eager", 1.0)])
def test_overlap_steps_apply_the_average_tau_steps_after_launch(rule, weight):
    """overlap_steps = 1 with H = 2: each round's average lands one inner step after its boundary
    (consensus step, then local progress since the boundary rebased onto it); the last boundary blocks."""
    deltas = [[0.2, -0.1, 0.4, 0.1, 0.3, -0.2], [0.4, 0.3, 0.0, -0.2, 0.1, 0.2]]  # per inner step
    lr, mu = 0.7, 0.9
    g, buf, local, snap, pending = 1.0, None, [1.0, 1.0], [1.0, 1.0], None
    expected = [[1.0], [1.0]]
    for t in range(6):
        local = [local[s] - deltas[s][t] for s in (0, 1)]
        if (t + 1) % 2 and pending is not None:  # one step after the boundary: the average lands
            g, buf = sgd_step(g, buf, pending, lr, mu)
            local, pending = [g + (local[s] - snap[s]) for s in (0, 1)], None
        elif not (t + 1) % 2 and t < 5:  # overlapped boundary: launch, move by the rule's estimate
            fresh = [g - x for x in local]
            if weight:
                local = [sgd_step(g, buf, weight * fresh[s], lr, mu)[0] for s in (0, 1)]
            snap, pending = list(local), sum(fresh) / 2
        elif t == 5:  # last boundary: blocking
            g, buf = sgd_step(g, buf, sum(g - x for x in local) / 2, lr, mu)
            local = [g, g]
        for s in (0, 1):
            expected[s].append(local[s])
    # By hand, step 3 (delayed): the average (0.1 + 0.7) / 2 of steps 1-2 lands -> g = 1 - 0.7 * 1.9 * 0.4
    # = 0.468, plus site 0's own step-3 progress -0.4 -> 0.068.
    if rule == "delayed":
        assert expected[0][3] == pytest.approx(0.068)
    store = f"tcp://127.0.0.1:{free_port()}"
    out = run_sites(_outer_by_hand_tau, 2, 1, (store, deltas, mu, lr, rule), timeout=60)
    for site in (0, 1):
        assert out[(site, 0)] == pytest.approx(expected[site], abs=1e-6)
    assert out[(0, 0)][-1] == out[(1, 0)][-1]


def _retrying_sites(store: str, may_retry: bool) -> dict:
    """Two sites x 3 blocking outer steps of a 0.4M-parameter model with `may_retry` (as elastic
    membership sets it), then one exchange that fails; what memory each step's exchange used."""
    import os

    import zeroband.outer.diloco as diloco_module
    from zeroband.mesh import fixed_global_group, init_topology, shutdown
    from zeroband.outer.diloco import DiLoCo
    from zeroband.world import World

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    topology = init_topology(World(0, 1, 0, site, 2, torch.device("cpu")), store, "retry", 30, "gloo")
    group = fixed_global_group(topology, "retry")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 600, bias=False), torch.nn.Linear(600, 80, bias=False))
    outer = DiLoCo(model, DilocoConfig(inner_steps=1, comm_dtype="fp16", outer_momentum_warmup=0), topology,
                   group=group)
    outer.membership.may_retry = may_retry
    outer.start()
    gen = torch.Generator().manual_seed(1 + site)
    memory, params = [], []
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(torch.randn(p.shape, generator=gen) * 1e-2)
        outer.after_inner_step(step + 1, sync_point=True)
        memory.append((outer.arenas[0], outer.arenas[0].buf.data_ptr(), None if outer.spare is None else outer.spare.data_ptr()))
        params.append([p.detach().clone() for p in model.parameters()])
    honest = diloco_module.reduce_across_sites

    def lost(*args, **kwargs):  # the peer vanished mid-exchange: receives may still be posted into the arena
        raise RuntimeError("peer lost")

    diloco_module.reduce_across_sites = lost
    kept = outer.arenas[0]
    try:
        outer.after_inner_step(4, sync_point=True)
    except RuntimeError:
        pass
    diloco_module.reduce_across_sites = honest
    shutdown()
    return {"ptrs": [m[1:] for m in memory], "same_arena": [m[0] is memory[0][0] for m in memory],
            "fresh_after_failure": outer.arenas[0] is not kept and outer.arenas[0].buf.numel() == 0,
            "spare_after_failure": outer.spare, "params": params}


def test_retrying_rounds_reuse_memory_only_after_a_completed_exchange():
    """Where a round may retry (elastic), the exchange's arena and the copy of its inputs are reused
    from round to round, as in fixed mode (fresh memory doubled the outer step), with the same bits;
    after an exchange that failed, the next one gets fresh memory."""
    out = {}
    for may_retry in (False, True):
        store = f"tcp://127.0.0.1:{free_port()}"
        out[may_retry] = run_sites(_retrying_sites, 2, 1, (store, may_retry), timeout=90)
    for site in (0, 1):
        got, plain = out[True][(site, 0)], out[False][(site, 0)]
        assert all(torch.equal(a, b) for step_a, step_b in zip(got["params"], plain["params"])
                   for a, b in zip(step_a, step_b))
        # the arena grows to what the first exchange took, then stays; the spare vector is made once
        assert got["same_arena"] == [True, True, True] and got["ptrs"][1] == got["ptrs"][2] and got["ptrs"][1][0]
        assert len({spare for _, spare in got["ptrs"]}) == 1 and got["ptrs"][0][1]
        assert plain["ptrs"][0][1] is None  # fixed rounds average the pseudo-gradient in place: no copy
        assert got["fresh_after_failure"] and got["spare_after_failure"] is None


def _merged_by_hand(store: str, deltas: list[list[float]], merge: str) -> list[float]:
    """Site s moves a 2-value weight by -deltas[s], then one blocking outer step (lr 1, no momentum:
    the weight moves by exactly the merged pseudo-gradient); returns the weight after it."""
    import os

    from zeroband.mesh import fixed_global_group, init_topology, shutdown
    from zeroband.outer.diloco import DiLoCo
    from zeroband.world import World

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    topology = init_topology(World(0, 1, 0, site, len(deltas), torch.device("cpu")), store, "rda", 30, "gloo")
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    cfg = DilocoConfig(outer_lr=1.0, outer_momentum=0.0, comm_dtype="fp32", inner_steps=1, outer_momentum_warmup=0,
                       merge=merge)
    outer = DiLoCo(model, cfg, topology, group=fixed_global_group(topology, "rda"))
    outer.start()
    with torch.no_grad():
        model.weight -= torch.tensor([deltas[site]])
    outer.after_inner_step(1, sync_point=True)
    shutdown()
    return model.weight.flatten().tolist()


@pytest.mark.parametrize("merge", ["mean", "rda"])
def test_rda_merges_unit_directions_at_the_mean_norm(merge):
    """Orthogonal pseudo-gradients of norms 0.3 and 0.1: the mean is (0.15, 0.05), of norm 0.158;
    radial-directional averaging takes the mean unit direction (1, 1) / sqrt(2) at the mean norm 0.2.
    Every site applies the same bytes."""
    deltas = [[0.3, 0.0], [0.0, 0.1]]
    merged = [0.15, 0.05] if merge == "mean" else [0.2 / 2**0.5] * 2
    out = run_sites(_merged_by_hand, 2, 1, (f"tcp://127.0.0.1:{free_port()}", deltas, merge), timeout=60)
    assert out[(0, 0)] == pytest.approx([1.0 - m for m in merged], abs=1e-6)
    assert out[(0, 0)] == out[(1, 0)]
