"""Building the model on the site mesh: meta device -> activation checkpointing -> compile -> FSDP2
-> weights, in that order (the order torchtitan uses: each step wraps what the previous made)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zeroband.config import Config
from zeroband.mesh import Topology
from zeroband.models.hf import load_hf_state
from zeroband.models.llama import Llama, apply_activation_checkpointing, load_full_state, model_blocks


def build_model(cfg: Config, topology: Topology) -> Llama:
    """Fixed order: meta device -> activation checkpointing -> compile -> FSDP2 -> weights."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    # FSDP2 shards over the site's ranks and casts for bf16 mixed precision; a 1-rank fp32 site has
    # nothing to shard, and the wrapping would only cost hooks and DTensor dispatch (~30% per step
    # on the demo model), so like torchtitan we wrap only when there is a degree to shard over.
    shard = topology.world.ranks_per_site > 1 or cfg.train.mixed_precision == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.train.mixed_precision == "bf16" else MixedPrecisionPolicy()
    for block in model_blocks(model):
        if cfg.train.compile:
            block.compile()
        if shard:
            fully_shard(block, mesh=topology.site_mesh, mp_policy=mp)
    if shard:
        fully_shard(model, mesh=topology.site_mesh, mp_policy=mp)
    model.to_empty(device=topology.world.device)
    if cfg.model.init_from:
        model.reset_rope(topology.world.device)
        load_full_state(model, load_hf_state(cfg.model.init_from, cfg.model))
    else:
        model.init_weights(cfg.train.seed)
    return model
