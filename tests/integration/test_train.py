"""The trainer on real forked ranks with gloo: it learns, FSDP2 is exact, checkpoints survive kills."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import _train, _train_expecting_fault, tiny_overrides
from tests.multiproc import Died, run_ranks
from zeroband.checkpoint import find_checkpoint, verify_checkpoint
from zeroband.config import validate_config


def test_single_rank_learns_and_writes_run_dir(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 30}, eval={"interval": 15})
    [result] = run_ranks(_train, 1, (tree,))
    losses = result["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    run = Path(result["run_dir"])
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in val] == [15, 30] and val[-1]["val_ppl"] == pytest.approx(math.exp(val[-1]["val_loss"]))
    assert val[-1]["val_bpb"] > 0 and "tokens_per_s" in records[-2] and "peak_mem_mb" in records[-2]
    assert (run / "config.toml").is_file()
    assert verify_checkpoint(run / "checkpoints" / "step_000000030")["step"] == 30


def _fsdp_steps(tree: dict, batches: list, steps: int, dtype: torch.dtype = torch.float32,
                grad_factor: float = 1.0) -> tuple[dict, dict]:
    """Build the model as the trainer does and take `steps` inner steps on this rank's share.
    Returns the full parameters before and after. `dtype=float64` gives the reference run;
    `grad_factor` multiplies the gradients (a deliberate averaging bug, for the negative control)."""
    import torch.distributed as dist

    from zeroband.mesh import init_topology, shutdown
    from zeroband.models.llama import gather_full_state
    from zeroband.optim import build_optimizer
    from zeroband.parallelize import build_model
    from zeroband.step import forward_backward, optimizer_step
    from zeroband.world import world_from_env

    cfg = validate_config(tree)
    world = world_from_env(cfg)
    topology = init_topology(world, None, "t", 60, "gloo")
    model = build_model(cfg, topology).to(dtype)
    opt = build_optimizer(list(model.parameters()), cfg.optim)
    per_rank = len(batches) // world.ranks_per_site
    mine = batches[world.rank * per_rank : (world.rank + 1) * per_rank]
    before = gather_full_state(model)
    for _ in range(steps):
        forward_backward(model, mine, world.device)
        for p in model.parameters():
            p.grad.mul_(grad_factor)
        optimizer_step(model, opt, cfg.optim.grad_clip)
    full = gather_full_state(model)
    dist.barrier()
    shutdown()
    return before, full


def _errors(run: dict, reference: dict) -> dict[str, float]:
    return {k: float((run[k].double() - ref).norm()) for k, ref in reference.items()}


# Why this tolerance. Sharding changes only the order of fp32 sums (2 ranks average two half-batch
# gradients where 1 rank accumulates four micro-batches), so the 2-rank run is the exact (fp64)
# result plus fp32 rounding, just like the 1-rank run. The 1-rank run's distance from an fp64 run
# of the same computation *is* this computation's rounding noise on this CPU (AdamW amplifies the
# gradients' relative error where an element's history nearly cancels, so no fixed atol fits every
# CPU's vector order: 1e-5 failed on AMD EPYC). Two fp32 paths through the same arithmetic have
# errors of the same size (measured ratio 0.87-1.0 per tensor); we allow 3x, plus a floor of one
# fp32 ulp of the tensor per step for tensors the 1-rank run happens to get exactly. A real bug
# (gradients summed instead of averaged, a micro-batch dropped) moves the result by the size of the
# update itself, ~10^4 times the rounding noise: the negative control below checks that it fails.
def _within_rounding(run: dict, one: dict, reference: dict, steps: int) -> dict[str, tuple[float, float]]:
    """Tensors whose error exceeds the bound: {name: (error, bound)}."""
    eps = torch.finfo(torch.float32).eps
    err_run, err_one = _errors(run, reference), _errors(one, reference)
    bounds = {k: 3 * err_one[k] + steps * eps * float(ref.norm()) for k, ref in reference.items()}
    return {k: (err_run[k], bounds[k]) for k in reference if err_run[k] > bounds[k]}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fsdp_two_ranks_match_one_rank(corpus, tmp_path, optimizer):
    # SGD without clipping is linear in the gradient, so an averaging-factor bug cannot hide in it.
    clip = 0.5 if optimizer == "adamw" else 0.0
    tree = tiny_overrides(corpus, tmp_path, optim={"grad_clip": clip, "name": optimizer})
    gen = torch.Generator().manual_seed(0)
    # One global batch of 4 sequences as 4 micro-batches of 1: 1 rank accumulates all 4, 2 ranks take 2 each.
    batches = [(torch.randint(0, 384, (1, 32), generator=gen), torch.randint(0, 384, (1, 32), generator=gen)) for _ in range(4)]
    steps = 3
    [(_, reference)] = run_ranks(_fsdp_steps, 1, (tree, batches, steps, torch.float64))
    [(_, one)] = run_ranks(_fsdp_steps, 1, (tree, batches, steps))
    two = run_ranks(_fsdp_steps, 2, (tree, batches, steps))
    for key in reference:
        assert torch.equal(two[0][1][key], two[1][1][key])
    assert _within_rounding(two[0][1], one, reference, steps) == {}
    if optimizer == "sgd":  # negative control: gradients summed over the 2 ranks instead of averaged
        buggy = run_ranks(_fsdp_steps, 2, (tree, batches, steps, torch.float32, 2.0))
        assert set(_within_rounding(buggy[0][1], one, reference, steps)) == set(reference)


def test_same_seed_same_losses(corpus, tmp_path):
    a = run_ranks(_train, 2, (tiny_overrides(corpus, tmp_path / "a", train={"steps": 4}),))
    b = run_ranks(_train, 2, (tiny_overrides(corpus, tmp_path / "b", train={"steps": 4}),))
    assert a[0]["losses"] == b[0]["losses"]


def test_resume_is_exact_on_two_ranks(corpus, tmp_path):
    """A run interrupted after step N and resumed logs exactly the losses of an uninterrupted run."""
    full = tiny_overrides(corpus, tmp_path / "full", train={"steps": 8}, checkpoint={"interval": 4})
    reference = run_ranks(_train, 2, (full,))[0]["losses"]

    cut = tiny_overrides(corpus, tmp_path / "cut", train={"steps": 8}, checkpoint={"interval": 4})
    faults = "site0:step6:inner:raise"
    assert "injected fault" in run_ranks(_train_expecting_fault, 2, (cut,), faults=faults)[0]
    resumed = run_ranks(_train, 2, (cut,))[0]["losses"]
    assert resumed == reference[4:], (resumed, reference)


def test_killed_save_leaves_previous_checkpoint_loadable(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 8}, checkpoint={"interval": 4})
    out = run_ranks(_train, 2, (tree,), faults="site0:step8:checkpoint:kill", allow_death=True)
    assert all(isinstance(r, Died) and r.exitcode == -9 for r in out), out
    root = tmp_path / "t" / "checkpoints"
    assert (root / "step_000000008.tmp").is_dir() and not (root / "step_000000008").exists()
    info = find_checkpoint(root, "auto")
    assert info is not None and info.step == 4
    resumed = run_ranks(_train, 2, (tree,))[0]
    assert len(resumed["losses"]) == 4 and resumed["steps"] == 8
    assert find_checkpoint(root, "auto").step == 8 and not (root / "step_000000008.tmp").exists()


def _leaves_on_sigterm(tree: dict) -> tuple[int, int, bool]:
    """Train under the installed fault schedule, counting the loop's calls to the outer method's
    leave() through the outer seam (zeroband/seams.py), wrapped around the schedule's own wrapper."""
    import dataclasses

    from zeroband import seams

    leaves: list[int] = []

    class Counted:
        def __init__(self, outer: object) -> None:
            self.outer = outer

        def __getattr__(self, name: str) -> object:
            return getattr(self.outer, name)

        def leave(self) -> None:
            leaves.append(1)
            self.outer.leave()

    installed = seams.current()
    seams.use(dataclasses.replace(installed, outer=lambda outer, model: Counted(installed.outer(outer, model))))
    out = _train(tree)
    saved = (Path(tree["output_dir"]) / "t" / "checkpoints" / "step_000000003" / "manifest.json").is_file()
    return out["steps"], len(leaves), saved


def test_sigterm_leaves_once_after_a_checkpoint(corpus, tmp_path):
    """SIGTERM after step 3 (1-based at the loop's seam): the site saves step 3 and leaves once."""
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 8})
    assert run_ranks(_leaves_on_sigterm, 1, (tree,), faults="site0:step3:inner:term") == [(3, 1, True)]


@pytest.mark.parametrize("ranks", [1, 2])
def test_bf16_and_activation_checkpointing_train(corpus, tmp_path, ranks):
    """bf16 on a 2-rank site (FSDP2's bf16 policy) and on a 1-rank site (autocast, no FSDP2) learns."""
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 12, "mixed_precision": "bf16", "activation_checkpointing": True})
    out = run_ranks(_train, ranks, (tree,))
    losses = out[0]["losses"]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) < sum(losses[:3])


def _bf16_model(tree: dict) -> tuple[bool, str, str, str]:
    """(sharded, parameter dtype, activation dtype, gradient dtype) of the model the trainer builds."""
    from zeroband.mesh import init_topology, shutdown
    from zeroband.models.llama import _is_dtensor
    from zeroband.parallelize import build_model
    from zeroband.world import world_from_env

    cfg = validate_config(tree)
    topology = init_topology(world_from_env(cfg), None, "t", 60, "gloo")
    try:
        model = build_model(cfg, topology)
        logits = model(torch.randint(0, cfg.model.vocab_size, (1, 16)))
        logits.float().sum().backward()
        p = model.lm_head.weight
        return _is_dtensor(p), str(p.dtype), str(logits.dtype), str(p.grad.dtype)
    finally:
        shutdown()


def test_a_one_rank_site_runs_bf16_under_autocast_and_a_sharded_one_under_fsdp2(corpus, tmp_path):
    """A 1-rank site has nothing to shard: no FSDP2 (its hooks made the 150M step host-bound on an
    H100), fp32 parameters and gradients, bf16 activations by autocast. A 2-rank site shards."""
    tree = tiny_overrides(corpus, tmp_path, train={"mixed_precision": "bf16"})
    [one] = run_ranks(_bf16_model, 1, (tree,))
    two = run_ranks(_bf16_model, 2, (tree,))
    assert one == (False, "torch.float32", "torch.bfloat16", "torch.float32")
    assert two[0] == two[1] == (True, "torch.float32", "torch.bfloat16", "torch.float32")
