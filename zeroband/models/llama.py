"""A Llama-family decoder, small enough to read in one sitting.

Submodules are named exactly like Hugging Face's `LlamaModel` internals, so a state-dict key of ours
is the HF key minus the leading "model." (and `lm_head.weight` is the same on both sides). The maths
(fp32 RMSNorm, rotate-half RoPE, GQA) follows HF's implementation so exported weights give the same
logits in `transformers`.

Life cycle under FSDP2 (what the trainer does):

    with torch.device("meta"):
        model = Llama(cfg)
    for block in model_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    model.init_weights(seed)          # fills every parameter + recomputes the RoPE tables

`init_weights` builds each full parameter on CPU from a generator seeded by (seed, parameter name) and
keeps only this rank's shard, so the weights do not depend on how many ranks share the model.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroband.config import ModelConfig

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# Prefixes wrappers put into parameter names (`torch.compile(m)`, `checkpoint_wrapper(m)`). Stripping
# them keeps init seeds and state-dict keys stable however the trainer wraps the blocks.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _canonical(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# --------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 loses too much in the mean of squares), cast back, then scale:
        # the same order of operations as HF's LlamaRMSNorm, so bf16 results match too.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_seq_len, head_dim], fp32, HF Llama "default" rope (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, hd]; cos/sin: [T, hd], already in x's dtype."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # Query head h reads kv head h // n_rep (HF's repeat_kv layout). Materialising the copies
            # works on every SDPA backend; `enable_gqa=True` does not on all of them.
            n_rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        # Set by `apply_activation_checkpointing`. A flag instead of a wrapper module keeps parameter
        # names (and so checkpoint keys and init seeds) unchanged.
        self.activation_checkpointing = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            # Non-reentrant checkpointing composes with FSDP2: the block's parameters are unsharded
            # again by FSDP's pre-backward hook before autograd asks for the recomputation.
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------------------------
# The model


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Derived from the config, never saved: non-persistent buffers, refilled by `reset_rope`.
        # bf16 autocast of an unsharded model (parallelize.build_model); FSDP2 casts by itself.
        self.autocast: torch.dtype | None = None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope(self.embed_tokens.weight.device)

    @torch.no_grad()
    def reset_rope(self, device: torch.device | str) -> None:
        """(Re)compute the RoPE tables on `device` (needed after `to_empty`, which leaves them garbage)."""
        # Computed on CPU in fp32 so every device gets identical tables, then moved.
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab_size]."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        with torch.autocast(tokens.device.type, self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            x = self.embed_tokens(tokens)
            # Cast like HF does: tables in the activation dtype (bf16 under FSDP2's mixed precision).
            cos, sin = self.rope_cos[:T].to(x.dtype), self.rope_sin[:T].to(x.dtype)
            for block in self.layers:
                x = block(x, cos, sin)
            return self.lm_head(self.norm(x))

    @torch.no_grad()
    def init_weights(self, seed: int, std: float | None = None) -> None:
        """Fill every parameter deterministically from `seed`, identically for any sharding.

        Linear/Embedding weights ~ N(0, std) (residual out-projections scaled by 1/sqrt(2*n_layers), as
        in GPT-2), norm weights = 1. Also recomputes the RoPE tables.
        """
        std = self.cfg.init_std if std is None else std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            name = _canonical(name)
            if name.endswith("layernorm.weight") or name == "norm.weight":
                full = torch.ones(param.shape)
            else:
                gen = torch.Generator().manual_seed(_param_seed(seed, name))
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                full = torch.empty(param.shape).normal_(0.0, s, generator=gen)
            # Written one at a time so peak CPU memory is one full parameter, not the whole model.
            _write_full(param, full)
        self.reset_rope(self.rope_cos.device)


def _param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, parameter name); Python's hash() is salted per process."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------------------------
# Full <-> (possibly sharded) parameters


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    # Imported lazily: torch.distributed may be unavailable on some builds.
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@torch.no_grad()
def _write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (CPU) tensor into `param`, keeping only this rank's shard if it is a DTensor."""
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(dtype=param.dtype)
        try:
            # src_data_rank=None: every rank already holds the full tensor, so each slices its own
            # shard locally (no communication, uneven shards handled like FSDP2 does).
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        except TypeError:  # torch < 2.7: no src_data_rank; scattering from rank 0 gives the same shard
            shard = distribute_tensor(full, param.device_mesh, param.placements)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def load_full_state(model: nn.Module, full_state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Write full tensors (our key names, any device/dtype) into the model's possibly sharded params.

    Every rank must call this with the same full tensors. With `strict`, missing and unexpected keys
    raise; a tied `lm_head.weight` alias in `full_state` is accepted and ignored.
    """
    params = {_canonical(n): p for n, p in model.named_parameters()}
    for name, param in params.items():
        if name not in full_state:
            if strict:
                raise KeyError(f"full state has no entry for parameter {name!r}")
            continue
        full = full_state[name]
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(
                f"shape mismatch for {name!r}: model expects {tuple(param.shape)}, got {tuple(full.shape)}"
            )
        _write_full(param, full)
    if strict:
        tied = {"lm_head.weight"} if getattr(getattr(model, "cfg", None), "tie_embeddings", False) else set()
        unexpected = sorted(set(full_state) - set(params) - tied)
        if unexpected:
            raise KeyError(f"full state has keys the model does not: {unexpected}")


@torch.no_grad()
def gather_full_state(model: nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Full, unsharded copies of every parameter (our key names). A collective under FSDP2:
    every rank of the mesh must call it."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if _is_dtensor(param) else param.detach()
        out[_canonical(name)] = full.to(device, copy=True)
    return out


# --------------------------------------------------------------------------------------------
# Loss, sizes, trainer helpers


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy over all (non-ignored) tokens, computed in fp32."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index
    )


def num_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameter count from the config alone (no model needed).

    `include_embedding=False` leaves out the embedding table (a lookup, no FLOPs) but keeps `lm_head`
    (a matmul) even when it is tied: that is the N of the 6N FLOPs-per-token estimate. With
    `include_embedding=True` it equals `sum(p.numel() for p in model.parameters())`.
    """
    d, hd = cfg.dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2  # q, o + k, v
    mlp = 3 * d * cfg.ffn_dim
    per_layer = attn + mlp + 2 * d  # + two norms
    n = cfg.n_layers * per_layer + d + cfg.vocab_size * d  # + final norm + lm_head
    if include_embedding and not cfg.tie_embeddings:
        n += cfg.vocab_size * d
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6N + attention scores (PaLM / nanoGPT MFU)."""
    return 6.0 * num_params(cfg, include_embedding=False) + 12.0 * cfg.n_layers * cfg.dim * seq_len


def model_blocks(model: Llama) -> list[nn.Module]:
    """The transformer blocks, in order: the units the trainer wraps with `fully_shard`."""
    return list(model.layers)


def apply_activation_checkpointing(model: Llama) -> None:
    """Recompute each block's activations in backward. Parameter names are unchanged."""
    for block in model_blocks(model):
        block = getattr(block, "_orig_mod", block)  # see through torch.compile(block)
        if not isinstance(block, Block):
            raise TypeError(f"expected a Block, got {type(block).__name__}")
        block.activation_checkpointing = True
