"""Model layer: the Llama decoder, its initialisation under FSDP2, and Hugging Face interop."""

from zeroband.models.hf import export_hf, hf_llama_config, load_hf_state
from zeroband.models.llama import (
    Block,
    Llama,
    apply_activation_checkpointing,
    cross_entropy_loss,
    flops_per_token,
    gather_full_state,
    load_full_state,
    model_blocks,
    num_params,
)

__all__ = [
    "Block",
    "Llama",
    "apply_activation_checkpointing",
    "cross_entropy_loss",
    "export_hf",
    "flops_per_token",
    "gather_full_state",
    "hf_llama_config",
    "load_full_state",
    "load_hf_state",
    "model_blocks",
    "num_params",
]
