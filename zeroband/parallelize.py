"""Building the model on the site mesh: meta device -> activation checkpointing -> compile -> FSDP2
-> weights, in that order (the order torchtitan uses: each step wraps what the previous made).
A 1-rank site has nothing to shard: no FSDP2, bf16 by autocast, the whole model compiled."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zeroband.config import Config
from zeroband.mesh import Topology
from zeroband.models.hf import load_hf_state
from zeroband.models.llama import Llama, apply_activation_checkpointing, load_full_state, model_blocks


def shards(topology: Topology) -> bool:
    """FSDP2 only when there is a degree to shard over (as torchtitan). On one rank its hooks, copies
    and DTensor dispatch are pure host overhead: on an H100 they made the 150M inner step host-bound
    (docs/results/gpu_h100.md), so a 1-rank site runs bf16 under autocast."""
    return topology.world.ranks_per_site > 1


def build_model(cfg: Config, topology: Topology, shard: bool | None = None) -> Llama:
    """Fixed order: meta device -> activation checkpointing -> compile -> FSDP2 -> weights.
    `shard` (default: `shards(topology)`) is explicit only for the benchmark that compares both."""
    shard = shards(topology) if shard is None else shard
    bf16 = cfg.train.mixed_precision == "bf16"
    with torch.device("meta"):
        model = Llama(cfg.model)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if shard:  # FSDP2 casts the gathered parameters to bf16 and reduces gradients in fp32
        assert topology.site_mesh is not None, "sharding needs the site mesh (mesh.init_topology)"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model_blocks(model):
            if cfg.train.compile:
                block.compile()  # per block: FSDP2's hooks sit between the blocks
            fully_shard(block, mesh=topology.site_mesh, mp_policy=mp)
        fully_shard(model, mesh=topology.site_mesh, mp_policy=mp)
    else:  # fp32 parameters, bf16 matmuls under autocast (inside the compiled graph)
        model.autocast = torch.bfloat16 if bf16 else None
        if cfg.train.compile:
            model.compile()  # one graph: embedding, blocks, norm and head fuse across the seams
    model.to_empty(device=topology.world.device)
    if cfg.model.init_from:
        model.reset_rope(topology.world.device)
        load_full_state(model, load_hf_state(Path(cfg.model.init_from), cfg.model))
    else:
        model.init_weights(cfg.train.seed)
    return model
