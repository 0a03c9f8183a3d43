"""Hugging Face Llama interop: export our weights as a `transformers` directory, load one back.

Key mapping: HF key = "model." + our key, except `lm_head.weight` which is the same on both sides.
`transformers` is imported lazily because it takes seconds to import and only export needs it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from zeroband.config import ModelConfig

if TYPE_CHECKING:
    from transformers import LlamaConfig


class SavesPretrained(Protocol):
    """Anything with `save_pretrained(dir)`, e.g. a `transformers` tokenizer."""

    def save_pretrained(self, save_directory: Path, /) -> Any: ...  # (transformers also takes a str)


def to_hf_key(key: str) -> str:
    return key if key == "lm_head.weight" else "model." + key


def from_hf_key(key: str) -> str:
    return key.removeprefix("model.")


def hf_llama_config(cfg: ModelConfig, bos_id: int, eos_id: int) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"],  # inference engines (e.g. vLLM) dispatch on this
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        # transformers 5 turns this legacy kwarg into rope_parameters={"rope_type": "default", ...};
        # transformers 4 stores it as is. Either way HF reads back our rope.
        rope_theta=cfg.rope_theta,  # type: ignore[call-arg]  # transformers 5 converts it but leaves it out of the signature
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def export_hf(
    full_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: Path,
    tokenizer: SavesPretrained | None = None,
    bos_id: int = 0,
    eos_id: int = 0,
) -> None:
    """Write `config.json`, `model.safetensors` (and the tokenizer) to `out_dir`, atomically.

    `full_state` holds full tensors under our key names (e.g. from `gather_full_state`); dtypes are kept.
    Everything is written into a sibling temp directory that is renamed into place at the end, so a
    crash never leaves a half-written export behind.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        hf_llama_config(cfg, bos_id, eos_id).save_pretrained(tmp)
        tensors: dict[str, torch.Tensor] = {}
        for key, t in full_state.items():
            if key == "lm_head.weight" and cfg.tie_embeddings:
                continue  # HF re-ties it to embed_tokens; safetensors refuses shared tensors anyway
            # A private contiguous CPU copy: safetensors rejects views into shared storage.
            tensors[to_hf_key(key)] = t.detach().to("cpu", copy=True).contiguous()
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_type(hf: dict[str, Any]) -> str:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return params.get("rope_type", params.get("type", "default"))


def check_hf_config(hf: dict[str, Any], cfg: ModelConfig) -> None:
    """Raise ValueError listing every architecture value in an HF config.json that differs from `cfg`."""
    n_heads = hf.get("num_attention_heads")
    pairs: list[tuple[str, Any, str, Any]] = [
        ("vocab_size", hf.get("vocab_size"), "vocab_size", cfg.vocab_size),
        ("hidden_size", hf.get("hidden_size"), "dim", cfg.dim),
        ("num_hidden_layers", hf.get("num_hidden_layers"), "n_layers", cfg.n_layers),
        ("num_attention_heads", n_heads, "n_heads", cfg.n_heads),
        ("num_key_value_heads", hf.get("num_key_value_heads", n_heads), "n_kv_heads", cfg.n_kv_heads),
        ("intermediate_size", hf.get("intermediate_size"), "ffn_dim", cfg.ffn_dim),
        ("rope_theta", _rope_theta(hf), "rope_theta", cfg.rope_theta),
        ("rms_norm_eps", hf.get("rms_norm_eps"), "norm_eps", cfg.norm_eps),
    ]
    if hf.get("head_dim") is not None:
        pairs.append(("head_dim", hf["head_dim"], "head_dim (dim / n_heads)", cfg.head_dim))
    problems = [
        f"{hf_name} {hf_value} in checkpoint vs model.{our_name} {our_value}"
        for hf_name, hf_value, our_name, our_value in pairs
        if hf_value != our_value
    ]
    # Things our model cannot represent at all.
    if hf.get("model_type", "llama") != "llama":
        problems.append(f"model_type {hf['model_type']!r} in checkpoint; only 'llama' is supported")
    if _rope_type(hf) != "default":
        problems.append(f"rope type {_rope_type(hf)!r} in checkpoint; only the default rope is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=true in checkpoint; the model has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} in checkpoint; the model uses silu")
    if problems:
        raise ValueError("Hugging Face checkpoint does not match the model config: " + "; ".join(problems))


def _read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(hf_dir / name, device="cpu"))
    return state


def load_hf_state(hf_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read an HF Llama directory into full CPU tensors under our key names (dtype as stored).

    The config and every tensor shape are checked against `cfg`; feed the result to `load_full_state`.
    """
    from zeroband.models.llama import Llama

    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    hf = json.loads(config_path.read_text())
    check_hf_config(hf, cfg)

    state = {
        from_hf_key(k): v
        for k, v in _read_safetensors(hf_dir).items()
        if not k.endswith("rotary_emb.inv_freq")  # older exports saved this derived buffer
    }
    if cfg.tie_embeddings:
        head = state.pop("lm_head.weight", None)
        if (
            head is not None
            and "embed_tokens.weight" in state
            and not torch.equal(head, state["embed_tokens.weight"])
        ):
            raise ValueError("checkpoint has an untied lm_head but model.tie_embeddings is true")
    elif "lm_head.weight" not in state and "embed_tokens.weight" in state:
        # A tied checkpoint into an untied model: the head starts as a copy of the embedding.
        state["lm_head.weight"] = state["embed_tokens.weight"].clone()

    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{hf_dir}: missing weights {missing}, unexpected weights {unexpected}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"{hf_dir}: shape mismatch for {to_hf_key(name)!r}: model expects {shape}, "
                f"checkpoint has {tuple(state[name].shape)}"
            )
    return state
