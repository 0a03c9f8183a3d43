"""Turn a sharded training checkpoint into a Hugging Face Llama directory, and prove it loads."""

from __future__ import annotations

import enum
from pathlib import Path

import torch

from zeroband import checkpoint as ckpt
from zeroband.config import Config
from zeroband.data.tokenizer import TextTokenizer
from zeroband.models.hf import export_hf
from zeroband.models.llama import Llama
from zeroband.trust.secret import RunSecret, resolve_secret


class Unresolved(enum.Enum):
    """No secret handed down: resolve the config's / environment's (once, here)."""

    TOKEN = 0


UNRESOLVED = Unresolved.TOKEN


def load_for_export(cfg: Config, checkpoint_path: Path, secret: RunSecret | Unresolved | None = UNRESOLVED) -> Llama:
    """An unsharded CPU model holding a checkpoint's weights (DCP reshards any rank count onto one).
    The checkpoint must pass the same trust check as a resume (signature, or the run's own dir),
    under `secret` (the command's, resolved once; by default the config's or $ZEROBAND_SECRET)."""
    # the trainer defines what a checkpoint must match and what signs it
    from zeroband.checkpointer import checkpoint_meta, signs_every_checkpoint

    secret = resolve_secret(cfg.sites.secret) if isinstance(secret, Unresolved) else secret

    if not checkpoint_path.is_dir():
        raise ckpt.CheckpointError(f"--checkpoint {checkpoint_path}: no such directory; pass a step_* directory "
                                   f"(e.g. under {cfg.checkpoint_dir}), or leave it out for the newest")
    manifest = ckpt.verify_trusted(checkpoint_path, secret, cfg.checkpoint_dir, cfg.checkpoint.allow_unsigned,
                                   signs_every_checkpoint(cfg), ckpt.Owner(cfg.name))
    info = ckpt.CheckpointInfo(checkpoint_path, manifest["step"], manifest)

    ckpt.check_compatible(info, checkpoint_meta(cfg), manifest["world_size"])
    model = Llama(cfg.model)
    model.reset_rope("cpu")
    state = {"model": model.state_dict()}
    ckpt.dcp_load(state, checkpoint_path / "dcp", no_dist=True)
    model.load_state_dict(state["model"])
    return model


def latest_checkpoint(cfg: Config, secret: RunSecret | None) -> Path:
    from zeroband.checkpointer import signs_every_checkpoint

    roots = [cfg.checkpoint_dir] + sorted(cfg.checkpoint_dir.glob("site*"))
    refused: list[str] = []  # why each checkpoint was not usable: a tampered one is named as such
    for root in roots:
        info = ckpt.find_checkpoint(root, "auto", secret, cfg.checkpoint.allow_unsigned,
                                    signs_every_checkpoint(cfg), ckpt.Owner(cfg.name), refused)
        if info is not None:
            return info.path
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise ckpt.CheckpointError(f"no checkpoint under {cfg.checkpoint_dir} can be exported: {refused[0]}{more}")
    raise FileNotFoundError(f"no complete checkpoint under {cfg.checkpoint_dir}; train first (zeroband train "
                            "CONFIG) or pass --checkpoint PATH, with the same config and overrides as the training")


def export(cfg: Config, checkpoint_path: Path | None, out_dir: Path, verify: bool = True,
           secret: RunSecret | Unresolved | None = UNRESOLVED) -> dict[str, float | str]:
    secret = resolve_secret(cfg.sites.secret) if isinstance(secret, Unresolved) else secret  # once per export
    path = checkpoint_path or latest_checkpoint(cfg, secret)
    model = load_for_export(cfg, path, secret)
    tokenizer = TextTokenizer.load(cfg.data.tokenizer)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_hf(state, cfg.model, out_dir, tokenizer=tokenizer, bos_id=tokenizer.eos_id, eos_id=tokenizer.eos_id)
    result: dict[str, float | str] = {"checkpoint": str(path), "out_dir": str(out_dir)}
    if verify:
        result["max_logit_diff"] = verify_export(model, out_dir, tokenizer)
    return result


@torch.no_grad()
def verify_export(model: Llama, out_dir: Path, tokenizer: TextTokenizer) -> float:
    """Load the export with transformers and compare logits with ours on a real sentence."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(out_dir).eval()
    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    ids = hf_tok("In the beginning was the word, and the word was with", return_tensors="pt")["input_ids"]
    if ids.tolist()[0] != tokenizer.encode_batch(["In the beginning was the word, and the word was with"])[0]:
        raise RuntimeError("exported tokenizer encodes differently from the training tokenizer")
    ours = model.eval()(ids)
    theirs = hf_model(ids).logits
    return float((ours - theirs).abs().max())
