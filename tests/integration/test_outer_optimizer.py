"""The open outer optimizer (issue 25): any torch optimizer steps DiLoCo's outer copy; the native
Nesterov path is one implementation of it, chosen by a pure function of the config."""

from __future__ import annotations

import torch

from tests.helpers import _train, diloco_tree, final_params, outer_records
from tests.multiproc import free_port, run_sites
from zeroband.config import DilocoConfig


def _radam_sites(store: str, steps: int) -> dict:
    """Two sites, DiLoCo with torch.optim.RAdam (built by a factory: zeroband never names it); each
    site moves its model by its own random delta before every blocking outer step."""
    import os

    from zeroband.mesh import fixed_global_group, init_topology, shutdown
    from zeroband.outer.diloco import DiLoCo
    from zeroband.world import World

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    topology = init_topology(World(0, 1, 0, site, 2, torch.device("cpu")), store, "radam", 30, "gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 7, bias=False))
    cfg = DilocoConfig(inner_steps=1, comm_dtype="fp32", log_checksum=True)
    outer = DiLoCo(model, cfg, topology, group=fixed_global_group(topology, "radam"),
                   optimizer=lambda params: torch.optim.RAdam(params, lr=0.05))
    outer.start()
    gen = torch.Generator().manual_seed(1 + site)
    params, state, crcs, deltas = [], [], [], []
    for step in range(steps):
        delta = [torch.randn(p.shape, generator=gen) * 1e-2 for p in model.parameters()]
        with torch.no_grad():
            for p, d in zip(model.parameters(), delta):
                p.sub_(d)
        crcs.append(outer.after_inner_step(step + 1, sync_point=True).outer_crc)  # steps done
        deltas.append(delta)
        params.append([p.detach().clone() for p in model.parameters()])
        state.append([t.clone() for t in outer.optimizer.state_tensors()])
    shutdown()
    return {"params": params, "state": state, "crcs": crcs, "deltas": deltas,
            "kind": type(outer.optimizer.optimizer).__name__}


def test_any_torch_optimizer_across_two_sites_keeps_replicas_bitwise_identical():
    """torch.optim.RAdam, which zeroband never names, as DiLoCo's outer optimizer on 2 real sites
    (forked processes, gloo): after every outer step both sites hold the same bits (parameters and
    the optimizer's state, and the keyed digest each logs), and the step is RAdam's on the average."""
    store = f"tcp://127.0.0.1:{free_port()}"
    steps = 3
    out = run_sites(_radam_sites, 2, 1, (store, steps), timeout=90)
    a, b = out[(0, 0)], out[(1, 0)]
    assert a["kind"] == "RAdam" and a["crcs"] == b["crcs"] and None not in a["crcs"]
    for step in range(steps):
        assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a["params"][step], b["params"][step]))
        assert len(a["state"][step]) == 3 * 3  # step, exp_avg, exp_avg_sq per parameter
        assert all(torch.equal(x, y) for x, y in zip(a["state"][step], b["state"][step]))
    # the same steps by hand: RAdam on site 0's start, fed the mean pseudo-gradient
    torch.manual_seed(0)
    ref = [p.detach().clone() for p in torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 7, bias=False)).parameters()]
    radam = torch.optim.RAdam(ref, lr=0.05)
    for step in range(steps):
        for r, d0, d1 in zip(ref, a["deltas"][step], b["deltas"][step]):
            r.grad = (d0 + d1) / 2
        radam.step()
        assert all(torch.allclose(r, p, rtol=0, atol=1e-6) for r, p in zip(ref, a["params"][step]))
    assert not all(torch.equal(r, p) for r, p in zip(ref, out[(0, 0)]["params"][0]))  # it moved at all


def test_outer_adam_runs_end_to_end(corpus, tmp_path):
    """`diloco.outer_optimizer = "adam"` through the trainer on 2 sites: the sites end identical and
    the outer step logs Adam's lr."""
    tree = diloco_tree(corpus, tmp_path / "adam", train={"steps": 4},
                       diloco={"outer_optimizer": "adam", "outer_lr": 0.01, "outer_kwargs": {"betas": [0.9, 0.95]},
                               "comm_dtype": "fp32"})
    run_sites(_train, 2, 1, (tree,), timeout=90)
    got = [final_params(tree, site, 4) for site in (0, 1)]
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])
    records = outer_records(tmp_path / "adam", 0)
    assert [r["outer_step"] for r in records] == [1, 2] and {r["outer_lr"] for r in records} == {0.01}
