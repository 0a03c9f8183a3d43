"""Every setting of a run: pydantic models, TOML loading and `--section.key value` overrides.

Errors never surface as a pydantic traceback: `load_config` raises `ConfigError`, whose message
names each offending key, what was wrong, and how to fix it.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import inspect
import json
import os
import re
import stat
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message says which key and how."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Model presets: Llama-family shapes. The demo/debug ones are sized for a 2-core CPU.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=512, max_seq_len=128),
    "demo": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, vocab_size=4096, max_seq_len=256),
    "150M": dict(dim=1024, n_layers=12, n_heads=16, n_kv_heads=16, ffn_dim=2816, vocab_size=32000, max_seq_len=1024),
    "1B": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=8, ffn_dim=5632, vocab_size=32000, max_seq_len=2048),
    "7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000, max_seq_len=4096),
    "10B": dict(dim=4096, n_layers=42, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, max_seq_len=8192),
}


class ModelConfig(Section):
    """A Llama-family decoder. `preset` fills every shape key not given explicitly."""

    preset: str | None = None
    vocab_size: int = Field(4096, gt=0)
    dim: int = Field(128, gt=0)
    n_layers: int = Field(4, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int = Field(2, gt=0)
    ffn_dim: int = Field(352, gt=0)
    max_seq_len: int = Field(256, gt=0)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # A Hugging Face Llama directory whose weights initialise the model (shapes must match).
    init_from: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("preset") is not None:
            name = values["preset"]
            if name not in MODEL_PRESETS:
                raise ValueError(f"unknown preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
            values = {**MODEL_PRESETS[name], **values}
        return values

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim dim/n_heads={self.dim // self.n_heads} must be even for RoPE")
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class DataConfig(Section):
    """Where text comes from and how it becomes fixed-length token sequences."""

    # Local files (jsonl/json/parquet/txt, globs allowed) or a hub dataset name (needs network).
    path: str | list[str] = "data/demo/train.jsonl"
    format: Literal["auto", "json", "parquet", "text"] = "auto"
    hub_name: str | None = None
    text_field: str = "text"
    tokenizer: str = "data/demo/tokenizer"
    seq_len: int = Field(256, gt=0)
    streaming: bool = False
    shuffle_seed: int = 1234
    # Whole documents whose text hash falls below this fraction are held out for validation.
    val_fraction: float = Field(0.02, ge=0.0, lt=1.0)
    # Elastic runs (zeroband/data/ledger.py): after each round every rank holds max(4 x span_docs,
    # 2 x the most documents a rank read that round) unread documents, so a round must read fewer.
    span_docs: int = Field(64, gt=0)


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    # "sgd" exists for the DiLoCo equivalence test (inner SGD) and for experiments. "muon": Muon
    # (torch.optim.Muon, lr matched to AdamW's RMS) for the 2-D hidden weights, AdamW for the rest.
    name: Literal["adamw", "sgd", "muon"] = "adamw"
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(50, ge=0)
    # Warmup-stable-decay: fraction of the run spent in the final linear decay.
    decay_fraction: float = Field(0.2, gt=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping


class TrainConfig(Section):
    steps: int = Field(200, gt=0)
    # Sequences per optimizer step for one site (all its ranks and accumulation steps together).
    global_batch: int = Field(16, gt=0)
    micro_batch: int = Field(8, gt=0)
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False
    # "auto": cuda if available, else cpu. The site group's backend follows the device.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    # A non-finite loss or gradient norm: "stop" the run with an error (nothing is saved after it),
    # or "rollback" to this run's last good checkpoint and go on with the batches after the ones
    # that diverged (one site only: a DiLoCo site cannot rewind alone), at most max_rollbacks times.
    on_nonfinite: Literal["stop", "rollback"] = "stop"
    max_rollbacks: int = Field(3, ge=0)


class CheckpointConfig(Section):
    dir: str | None = None  # default: <run_dir>/checkpoints
    interval: int = Field(0, ge=0)  # steps between saves; 0 saves only at the end
    keep_last: int = Field(2, gt=0)
    # A fresh start moves the previous run (metrics, config, checkpoints) into <run dir>/old-<time>/;
    # this many of those folders are kept, the oldest beyond it deleted (0: keep none).
    keep_old: int = Field(2, ge=0)
    # "auto" resumes from the newest valid checkpoint in dir if any; "none" starts fresh; or a path.
    resume: str = "auto"
    save_at_end: bool = True
    # Load an unsigned checkpoint from outside this run's checkpoint dir (or any unsigned one when a
    # secret is set). DCP metadata is a pickle: only for checkpoints whose author you trust.
    allow_unsigned: bool = False


# The loud line of the deliberate opt-out (printed where the run starts, recorded in its metrics).
ALLOW_UNSIGNED_WARNING = ("checkpoint.allow_unsigned = true: checkpoints are loaded WITHOUT checking who wrote them "
                          "(unsigned ones, and signed ones when no secret is at hand); a crafted checkpoint can "
                          "give this run any weights. Use it only for checkpoints whose author you trust")


def warn_allow_unsigned(cfg: Config) -> None:
    """The opt-out's one loud line, on stderr whatever logging is set up (the terminal that started the run)."""
    if cfg.checkpoint.allow_unsigned:
        print(f"zeroband: WARNING: {ALLOW_UNSIGNED_WARNING}", file=sys.stderr, flush=True)


class EvalConfig(Section):
    interval: int = Field(50, ge=0)  # 0 disables periodic validation (it still runs at the end)
    batches: int = Field(8, gt=0)


class LogConfig(Section):
    interval: int = Field(10, gt=0)
    progress_bar: bool = True
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"


SGD_OUTER = ("nesterov", "sgd")  # diloco.outer_optimizer values that outer_momentum / nesterov configure


def torch_sgd_class() -> type:
    import torch  # only when a config is checked

    return torch.optim.SGD


OUTER_NAMED = {"nesterov": "SGD", "sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}  # short names of torch.optim


def optimizer_class(name: str) -> type:
    """diloco.outer_optimizer -> its torch optimizer class: a short name (OUTER_NAMED) or a torch optimizer's
    dotted name ("torch.optim.RAdam"); ValueError else. Only torch.optim: a config names no other code to
    import and run. Here, not in zeroband/outer/, so that the config imports nothing above it."""
    import importlib

    import torch  # only when a config is checked

    module, _, attr = ("torch.optim." + OUTER_NAMED[name]).rpartition(".") if name in OUTER_NAMED else name.rpartition(".")
    found = getattr(importlib.import_module(module), attr, None) if module.startswith("torch.optim") else None
    if not (inspect.isclass(found) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"diloco.outer_optimizer={name!r} is not an outer optimizer: use one of "
                         f"{', '.join(OUTER_NAMED)} or a torch optimizer's dotted name such as 'torch.optim.RAdam'")
    return found


CODECS_DIR = Path(__file__).parent / "comm" / "codecs"


def codec_names() -> list[str]:
    """The wire formats diloco.comm_dtype may name: one file per codec in zeroband/comm/codecs/ (its
    registry, which checks each file's name against its codec's). Read from the folder, not imported:
    the config sits below comm in the layers (docs/architecture.md) and a check must stay cheap."""
    return sorted(p.stem for p in CODECS_DIR.glob("*.py") if not p.stem.startswith("_"))


class DilocoConfig(Section):
    """Present only for multi-site runs: what is computed across sites (who they are: [sites])."""

    inner_steps: int = Field(500, gt=0)  # H
    # Outer optimizer: SGD with Nesterov momentum on the CPU fp32 copy. The default values were measured
    # (docs/results/convergence_tuning.md, and the README section on the outer optimizer): the paper's 0.9
    # momentum multiplies consistent pseudo-gradients up to 7x and loses to one site when a run has
    # tens of outer steps; lr 0.7 with momentum 0.5, warmed up over 5 outer steps, held up with
    # 10 and with 40 outer steps.
    # Which outer optimizer (zeroband/outer/optimizer.py): "nesterov" (SGD with Nesterov momentum, the
    # default; the native fused path), "sgd" (heavy-ball momentum; outer_lr 1 with outer_momentum 0 is
    # plain averaging), "adam", "adamw", or a torch optimizer's dotted name ("torch.optim.RAdam"). Every
    # one is built with lr = outer_lr and `outer_kwargs`; outer_momentum, nesterov and the momentum
    # warm-up are SGD's. Measured against each other: docs/results/convergence_outer.md.
    outer_optimizer: str = "nesterov"
    outer_lr: float = Field(0.7, gt=0)  # the default is Nesterov SGD's: other optimizers need their own
    outer_momentum: float = Field(0.5, ge=0, lt=1)
    nesterov: bool = True
    # More settings of the outer optimizer's constructor, e.g. { betas = [0.9, 0.95], eps = 1e-8 } for adam.
    outer_kwargs: dict[str, float | bool | list[float]] = Field(default_factory=dict)
    # Outer learning rate over the run: "constant", or "inner": outer_lr x the inner schedule's factor
    # at the boundary (warmup and decay alike), so momentum cannot keep pushing once inner steps shrink.
    outer_lr_schedule: Literal["constant", "inner"] = "constant"
    # Ramp the outer momentum linearly from 0 to outer_momentum over this many outer steps (0: none).
    outer_momentum_warmup: int = Field(5, ge=0)
    # Wire format of the pseudo-gradient all-reduce: a file of zeroband/comm/codecs/ (fp32, bf16, fp16;
    # int8 / int4: quantised, ~1 / ~0.53 bytes per param; sparse: top-k values at 2 bits, ~0.04).
    comm_dtype: str = "fp16"
    # Carry what the wire format lost into the next outer step (always on for "sparse").
    error_feedback: bool = False
    # "sparse" only: the fraction of each chunk's values sent per outer step (SparseLoCo's top-k density).
    density: float = Field(0.02, gt=0, le=1)
    # Pipeline piece of the all-reduce, in MB of fp32 values: encoding piece k+1 overlaps sending
    # piece k, and the all-gather of a piece starts as soon as its reduce-scatter landed.
    piece_mb: float = Field(4.0, gt=0)
    # Streaming DiLoCo (zeroband/outer/fragments.py): the parameters in this many fragments balanced
    # by bytes, fragment p synced every inner_steps steps at offset (p + 1) x inner_steps / fragments,
    # so a site sends 1/fragments of the model at a time. 1: the whole model at once.
    fragments: int = Field(1, ge=1)
    # Launch the all-reduce in the background and apply it one outer step late (zeroband/outer/overlap.py).
    overlap: bool = False
    # Inner steps after the boundary at which the overlapped average is applied (Streaming DiLoCo's
    # tau): 0 = at the next boundary, a whole round late (hides the most communication); 1 <= tau <
    # inner_steps applies it sooner (fresher, as long as the all-reduce takes under tau inner steps,
    # else the step waits for it). Every site applies it at the same step, so they stay identical.
    overlap_steps: int = Field(0, ge=0)
    # What a site trains on while the average is in flight (zeroband/outer/overlap.py has the exact rules):
    # "delayed" keeps its own progress on the consensus; "eager" previews the outer step with its own
    # fresh pseudo-gradient in place of the average; "eager_share" with its 1/n share (Kale et al.
    # 2025). On the tuning split (docs/results/convergence_tuning.md) "eager" tied "delayed" with 40
    # outer steps and beat it with 10; "eager_share" was worst in both, so "eager" is the default.
    overlap_rule: Literal["delayed", "eager", "eager_share"] = "eager"
    # "data_parallel" averages gradients across sites every step instead (the baseline).
    mode: Literal["diloco", "data_parallel"] = "diloco"
    # Fault tolerance (membership generations, heartbeats, commit step, joins; zeroband/membership/elastic.py).
    elastic: bool = False
    min_sites: int = Field(1, gt=0)  # quorum: an outer step needs at least this many sites
    # Once a quorum is in, wait this long for the others; "auto": follow the measured times
    # (zeroband/membership/grace.py): up to half the slack an overlapped exchange leaves, else twice
    # the recent worst lateness of a site after the quorum, at least 1 s, at most 60 s.
    grace_s: float | Literal["auto"] = "auto"
    start_grace_s: float = Field(60.0, ge=0)  # at launch, how long the first sites wait for the rest
    heartbeat_s: float = Field(2.0, gt=0)
    dead_after_s: float = Field(10.0, gt=0)  # a site whose heartbeat is this old is dropped
    max_retries: int = Field(3, ge=0)  # failed all-reduces retried in a new generation
    join_timeout_s: float = Field(3600.0, gt=0)  # how long a joiner waits for a boundary
    # A pseudo-gradient whose norm exceeds this multiple of the other sites' median is excluded
    # (needs 3+ sites; 0 disables). NaN/inf pseudo-gradients are always excluded.
    outlier_factor: float = Field(10.0, ge=0)
    # Time-budget rounds (Decoupled DiLoCo): > 0 makes every round last this many seconds instead of
    # inner_steps steps; each site runs as many inner steps as fit, and pseudo-gradients are
    # weighted by the tokens each site processed. The run lasts train.steps // inner_steps rounds;
    # the lr schedule and the checkpoints follow the run's rounds x inner_steps (the run step).
    round_seconds: float = Field(0.0, ge=0)
    # How the sites' pseudo-gradients are merged (zeroband/comm/reduce.py `site_weight`): "mean" (or
    # by tokens with round_seconds); "rda", radial-directional averaging (Decoupled DiLoCo): the mean
    # of their unit directions, rescaled to the mean of their norms, so the average of near-orthogonal
    # pseudo-gradients keeps their size where a mean shrinks it by up to sqrt(sites).
    merge: Literal["mean", "rda"] = "mean"
    # Elastic: a site left out of a round (it arrived after the grace window) brings that round's
    # pseudo-gradient to the next merge, its share times late_weight (it is one round stale); 0
    # drops it. Older work is never applied: a site left out again has none to bring. The default
    # follows docs/results/late.md (scripts/experiments/late.py: merged late against dropped).
    late_weight: float = Field(0.5, ge=0, le=1)
    # Log a crc32 of the outer state after every outer step (costs a pass over the shard; the chaos
    # suite uses it to prove the sites stay bitwise identical).
    log_checksum: bool = False
    # Where the fp32 outer copy and momentum live when the model is on a GPU: "cuda" keeps them next
    # to the model (no copies but the pseudo-gradient's round trip to the wire), "cpu" in pinned host
    # memory, "auto" on the GPU when they fit in half its free memory (blocking steps only: the
    # overlapped and elastic steps keep them on the CPU). CPU models always use the CPU.
    outer_device: Literal["auto", "cpu", "cuda"] = "auto"
    # torch threads of the outer step (0: the cores this rank owns, its affinity / local ranks); the
    # inner step keeps its own setting.
    outer_threads: int = Field(0, ge=0)

    @field_validator("comm_dtype")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        if value not in (known := codec_names()):
            raise ValueError(f"unknown wire format: choose one of {', '.join(known)} "
                             f"(a file of zeroband/comm/codecs/). Fix: --diloco.comm_dtype fp16")
        return value

    @field_validator("grace_s", mode="before")
    @classmethod
    def _grace(cls, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            seconds = float(value) if not isinstance(value, bool) else -1.0
        except (TypeError, ValueError):
            seconds = -1.0
        if 0 <= seconds < float("inf"):
            return seconds
        raise ValueError('use "auto" (from the measured step, exchange and arrival times) or a number of seconds '
                         '>= 0. Fix: --diloco.grace_s auto')

    @model_validator(mode="before")
    @classmethod
    def _drop_moved_keys(cls, values: Any) -> Any:
        # From a file or the command line `validate_config` refuses these first. Python callers that
        # still pass e.g. DilocoConfig(store=...) lose nothing: the outer step never read the [sites]
        # keys (it talks through the topology), so they are dropped, and a renamed key keeps its
        # value under the new name; either way with a warning naming the new key.
        if isinstance(values, dict) and (moved := [k for k in values if f"diloco.{k}" in MOVED_KEYS]):
            warnings.warn(moved_key_message(f"diloco.{moved[0]}", values[moved[0]]), DeprecationWarning, stacklevel=2)
            renamed = {MOVED_KEYS[f"diloco.{k}"].split(".", 1)[1]: values[k] for k in moved
                       if MOVED_KEYS[f"diloco.{k}"].startswith("diloco.")}
            values = {k: v for k, v in values.items() if k not in moved} | renamed
        return values

    @model_validator(mode="before")
    @classmethod
    def _outer_lr_given(cls, values: Any) -> Any:
        # outer_lr's default (0.7) is Nesterov SGD's: an Adam step of 0.7 per coordinate would wreck the
        # model, so any other optimizer names its lr (a dumped config always carries it: round trips pass).
        name = values.get("outer_optimizer", "nesterov") if isinstance(values, dict) else "nesterov"
        if name in SGD_OUTER or not isinstance(name, str):
            return values
        optimizer_class(name)  # an unknown name is the first thing to say
        if "outer_lr" not in values:
            raise ValueError(f"diloco.outer_lr must be set for diloco.outer_optimizer = "
                             f"{values['outer_optimizer']!r} (the default 0.7 is Nesterov SGD's; Adam takes ~1e-3 to 1e-2)")
        return values

    @model_validator(mode="after")
    def _check_outer_optimizer(self) -> DilocoConfig:
        cls = optimizer_class(self.outer_optimizer)
        takes = set(inspect.signature(cls).parameters) - {"self", "params"}  # its __init__'s, less self
        if unknown := sorted(set(self.outer_kwargs) - takes):
            raise ValueError(f"diloco.outer_kwargs has {unknown[0]!r}, which {cls.__name__} does not take "
                             f"(it takes: {', '.join(sorted(takes))})")
        fields = type(self).model_fields
        if self.outer_optimizer not in SGD_OUTER:
            for key in ("outer_momentum", "nesterov", "outer_momentum_warmup"):
                if getattr(self, key) != fields[key].default:
                    raise ValueError(f"diloco.{key} applies to the SGD outer optimizers only ('nesterov', 'sgd'), "
                                     f"not {self.outer_optimizer!r}: remove it (set betas etc. in diloco.outer_kwargs)")
        if self.overlap and self.overlap_rule != "delayed" and cls is not torch_sgd_class():
            raise ValueError(f"diloco.overlap_rule={self.overlap_rule!r} previews the outer step, which only SGD "
                             f"can: set diloco.overlap_rule = 'delayed' for outer_optimizer {self.outer_optimizer!r}")
        return self

    @model_validator(mode="after")
    def _check_outer(self) -> DilocoConfig:
        if self.overlap_steps and self.overlap_steps >= self.inner_steps:
            raise ValueError(f"diloco.overlap_steps={self.overlap_steps} must be < diloco.inner_steps="
                             f"{self.inner_steps} (0 applies the average at the next boundary)")
        if self.elastic and self.overlap:
            raise ValueError("diloco.elastic and diloco.overlap cannot be combined yet; choose one")
        if self.outer_device == "cuda" and (self.overlap or self.elastic):
            raise ValueError("diloco.outer_device = 'cuda' needs blocking outer steps: set it to 'auto' or 'cpu' "
                             "with diloco.overlap or diloco.elastic")
        if self.round_seconds and self.mode != "diloco":
            raise ValueError("diloco.round_seconds needs diloco.mode = 'diloco'")
        if self.round_seconds and self.outer_lr_schedule == "inner":  # each site's step at a boundary is its own
            raise ValueError("diloco.outer_lr_schedule = 'inner' needs rounds of diloco.inner_steps steps: with "
                             "diloco.round_seconds the sites would each take another outer lr. Fix: set "
                             "diloco.outer_lr_schedule = 'constant' or diloco.round_seconds = 0")
        if self.fragments > 1 and self.inner_steps % self.fragments:
            raise ValueError(f"diloco.inner_steps={self.inner_steps} must be a multiple of diloco.fragments="
                             f"{self.fragments}: one fragment syncs every inner_steps / fragments steps")
        if self.fragments > 1 and self.mode != "diloco":
            raise ValueError("diloco.fragments > 1 needs diloco.mode = 'diloco'. Fix: diloco.fragments = 1")
        if self.fragments > 1 and self.round_seconds and self.elastic:
            raise ValueError("diloco.fragments > 1 with diloco.round_seconds needs a fixed membership (not built "
                             "with diloco.elastic yet). Fix: diloco.fragments = 1 or diloco.round_seconds = 0")
        if self.merge != "mean" and self.mode != "diloco":
            raise ValueError(f"diloco.merge = {self.merge!r} merges pseudo-gradients: it needs diloco.mode = "
                             "'diloco' (data parallel averages gradients). Fix: diloco.merge = 'mean'")
        if self.elastic and self.mode != "diloco":
            raise ValueError("diloco.elastic needs diloco.mode = 'diloco'")
        if self.dead_after_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"diloco.dead_after_s={self.dead_after_s} must exceed 2 x diloco.heartbeat_s={self.heartbeat_s}, "
                "or a live site could be declared dead between two heartbeats"
            )
        return self


class SitesConfig(Section):
    """Who the sites are and how they meet: identity, store, authentication, cross-site transport.

    Split from [diloco] (issue 14): [diloco] says what is computed (the outer optimizer, H, the wire
    format, overlap, the membership policy of an elastic run); [sites] says where this site is and
    how it reaches the others. These keys are each site's own (site_count and backend aside), so a
    site moved to another store or given more patience still runs the same algorithm. Read only by
    a run with [diloco]; a single-site run ignores it.

    The elastic knobs (min_sites, grace_s, heartbeat_s, dead_after_s, max_retries, join_timeout_s,
    outlier_factor) stay in [diloco]: they act only with diloco.elastic and decide which
    pseudo-gradients a round averages and when, so they belong to the algorithm (most must match
    across sites). timeout_s is here: it bounds every cross-site wait, fixed or elastic.
    """

    # Coordination store for the global groups: tcp://host:port (hosted by site 0's rank 0 when
    # host_store is true, else by someone else, e.g. `zeroband launch`) or etcd://h1:p1,h2:p2,h3:p3.
    store: str = "tcp://127.0.0.1:29600"
    host_store: bool = True
    # Shared secret that authenticates every cross-site message (admission, store values) and keys the
    # TLS 1.3 of every cross-site connection (payloads encrypted); or ZEROBAND_SECRET. Never written to disk.
    secret: str | None = Field(None, repr=False, exclude=True)
    # Or a file holding it (mode 0600); never on the command line, where `ps` shows it to everyone.
    secret_file: str | None = None
    # A multi-site run without a secret starts only with this set: nothing it receives is authenticated.
    insecure: bool = False
    # etcd's own access control (an etcd:// store with a secret needs it; README, multi-site runs on
    # etcd): the CA of the members' certificates (TLS), this site's client certificate and key, and
    # the etcd user whose role covers the store's prefix, its password in a file of mode 0600.
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_user: str | None = None
    etcd_password_file: str | None = None
    etcd_password: str | None = Field(None, repr=False, exclude=True)  # read from etcd_password_file
    # Site identity: here, or ZEROBAND_SITE_RANK / ZEROBAND_SITE_COUNT in the environment.
    site_rank: int | None = Field(None, ge=0)
    site_count: int | None = Field(None, gt=0)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(600.0, gt=0)
    # Connections per peer pair of the cross-site transport (comm/transport.py): a large message is
    # cut into this many slices sent at once, to fill a long fat link; the bytes and results are the same.
    # "auto": per peer, those that cover the probed bandwidth-delay product (comm/link.py choose_streams).
    streams: int | Literal["auto"] = "auto"
    # Longest timed transfer of the link probe a global group runs when it connects; a link this
    # process probed before is probed again only when its round trip moved by more than half (so an
    # elastic generation or a resume costs no probe). 0: no probe (waits keep timeout_s; "auto": 1 stream).
    probe_s: float = Field(3.0, ge=0, le=60)
    # A wait's bound from the measured link (zeroband/comm/link.py wait_bound): wait_factor x the
    # payload's transfer time + a few RTTs, never under timeout_floor_s nor over timeout_s (the ceiling wins).
    timeout_floor_s: float = Field(10.0, gt=0)
    wait_factor: float = Field(3.0, ge=1)

    @field_validator("streams", mode="before")
    @classmethod
    def _streams(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 64):
            return value
        if isinstance(value, str) and value.isdigit() and 1 <= int(value) <= 64:
            return int(value)
        raise ValueError('use "auto" (chosen from the measured link) or a number of streams from 1 to 64')

    @model_validator(mode="before")
    @classmethod
    def _read_secret_file(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("secret_file") and not values.get("secret"):
            values = {**values, "secret": read_secret_file(Path(values["secret_file"]))}
        return values

    @field_validator("etcd_ca_file", "etcd_cert_file", "etcd_key_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is not None and not os.access(value, os.R_OK):
            raise ValueError("cannot be read (missing, or not readable by this user)")
        return value

    @field_validator("etcd_password_file")
    @classmethod
    def _password_file(cls, value: str | None) -> str | None:
        if value is not None:
            read_secret_file(Path(value), "sites.etcd_password_file")  # the checks only: read again below
        return value

    @model_validator(mode="after")
    def _check_etcd(self) -> SitesConfig:
        etcd = self.store.startswith("etcd://")
        given = [k for k in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_user", "etcd_password_file")
                 if getattr(self, k) is not None]
        if given and not etcd:
            raise ValueError(f"sites.{given[0]} is set but sites.store is not etcd://")
        if (self.etcd_cert_file is None) != (self.etcd_key_file is None):
            raise ValueError("sites.etcd_cert_file and sites.etcd_key_file go together (the client certificate and its key)")
        if (self.etcd_user is None) != (self.etcd_password_file is None):
            raise ValueError("sites.etcd_user and sites.etcd_password_file go together")
        if given and self.etcd_ca_file is None:
            raise ValueError("sites.etcd_ca_file is needed with the other etcd settings (etcd is reached over TLS)")
        if etcd and not self.insecure and self.etcd_user is None:
            raise ValueError(f"store={self.store!r} with a secret needs etcd's access control: set sites.etcd_ca_file, "
                             "etcd_cert_file, etcd_key_file, etcd_user and etcd_password_file (README, multi-site runs "
                             "on etcd), or sites.insecure = true on a trusted network")
        if self.etcd_password_file is not None and self.etcd_password is None:
            self.etcd_password = read_secret_file(Path(self.etcd_password_file), "sites.etcd_password_file")
        return self

    @model_validator(mode="after")
    def _check_site(self) -> SitesConfig:
        if self.site_rank is not None and self.site_count is not None and self.site_rank >= self.site_count:
            raise ValueError(f"site_rank={self.site_rank} must be < site_count={self.site_count}")
        if not (self.store.startswith("tcp://") and ":" in self.store[6:]) and not self.store.startswith("etcd://"):
            raise ValueError(f"store={self.store!r} must look like tcp://host:port or etcd://h1:p1,h2:p2,h3:p3")
        return self

# Keys that left [diloco] or were renamed (issue 14): the old spelling is refused with one line
# naming the new one. The pipeline piece of the all-reduce has one name, from config to comm/direct.py.
MOVED_KEYS = {f"diloco.{k}": f"sites.{k}" for k in SitesConfig.model_fields} | {"diloco.bucket_mb": "diloco.piece_mb"}


def moved_key_message(old: str, value: Any) -> str:
    new = MOVED_KEYS[old]
    section, key = new.split(".")
    shown = "..." if key == "secret" else json.dumps(value) if isinstance(value, (str, int, float, bool)) else "..."
    verb = "is now" if old.split(".")[0] == section else "moved to"
    return f"{old} {verb} {new}: write [{section}] {key} = {shown} (or --{new} on the command line)"


def refuse_moved_keys(raw: dict[str, Any]) -> None:
    """One line per run for the first old key found: what it is called now and how to write it."""
    for old in MOVED_KEYS:
        section, key = old.split(".")
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raise ConfigError(moved_key_message(old, raw[section][key]))


def read_secret_file(path: Path, name: str = "sites.secret_file") -> str:
    """The secret in `path` (surrounding whitespace dropped). Refused unless it is a regular file,
    not a symlink (one could point at another user's file, or be re-pointed by whoever owns its
    directory), owned by this user (a file someone else owns is a secret someone else chose) and
    readable by nobody else. Checked on the open descriptor: what is checked is what is read."""
    where = f"{name} {str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        why = f"is a symlink; point {name} at the file itself" if e.errno == errno.ELOOP else e.strerror
        raise ValueError(f"{where} cannot be read: {why}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where} is not a regular file; put the secret in a file of mode 0600")
        if st.st_uid != os.geteuid():
            raise ValueError(f"{where} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                             "write the secret to a file of your own, mode 0600")
        if st.st_mode & 0o077:
            raise ValueError(f"{where} is readable by other users (mode {st.st_mode & 0o777:o}); run `chmod 600 {path}`")
        text = f.read().strip()
    if not text:
        raise ValueError(f"{where} is empty")
    return text


class Config(Section):
    name: str = "run"
    output_dir: str = "runs"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    diloco: DilocoConfig | None = None
    sites: SitesConfig = SitesConfig()

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_keys(cls, values: Any) -> Any:
        if isinstance(values, dict):
            refuse_moved_keys(values)
        return values

    @model_validator(mode="after")
    def _check_consistency(self) -> Config:
        if self.train.global_batch % self.train.micro_batch:
            raise ValueError(
                f"train.global_batch={self.train.global_batch} is not divisible by "
                f"train.micro_batch={self.train.micro_batch}"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower data.seq_len or raise model.max_seq_len"
            )
        if self.diloco is not None and self.train.on_nonfinite == "rollback":
            raise ValueError("train.on_nonfinite = 'rollback' needs a single-site run (no [diloco]); a DiLoCo "
                             "site cannot rewind alone. Fix: set train.on_nonfinite = 'stop'")
        if self.diloco is not None:
            h = self.diloco.inner_steps
            if self.train.steps % h:
                fits = sorted({max(h, self.train.steps // h * h), (self.train.steps // h + 1) * h})
                raise ValueError(
                    f"train.steps={self.train.steps} is not a multiple of diloco.inner_steps={h}: the run must end "
                    f"on an outer step. Fix: set train.steps to {' or '.join(map(str, fits))}, or change "
                    "diloco.inner_steps"
                )
            if self.checkpoint.interval % h:
                raise ValueError(
                    f"checkpoint.interval={self.checkpoint.interval} is not a multiple of diloco.inner_steps={h}: "
                    "DiLoCo checkpoints are taken at outer boundaries"
                )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    def check_world(self, world_size: int) -> None:
        """Batch geometry must fit the number of ranks torchrun started (one site)."""
        per_step = world_size * self.train.micro_batch
        if self.train.global_batch % per_step:
            fits = [n for n in range(1, 65) if self.train.global_batch % (n * self.train.micro_batch) == 0]
            raise ConfigError(
                f"train.global_batch={self.train.global_batch} is not divisible by ranks x micro_batch = "
                f"{world_size} x {self.train.micro_batch} = {per_step}. Fix: set train.global_batch to a "
                f"multiple of {per_step}, change train.micro_batch, or start {fits} ranks per site."
            )

    def grad_accum_steps(self, world_size: int) -> int:
        self.check_world(world_size)
        return self.train.global_batch // (world_size * self.train.micro_batch)

    def fingerprint(self) -> str:
        """Hash of what must agree between sites and checkpoints: model shape and tokenizer geometry."""
        keys = self.model.model_dump(exclude={"init_from", "preset"})
        keys["seq_len"] = self.data.seq_len
        return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Loading


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--optim.lr", "3e-4", "--train.compile"]` -> `{"optim": {"lr": 3e-4}, "train": {"compile": True}}`.

    Values are parsed as TOML literals (numbers, booleans, strings, arrays); anything else is a string.
    `--key=value` works too. A secret in any form is refused (`refuse_secret_arguments`).
    """
    refuse_secret_arguments(args)
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            raw = args[i + 1]
            i += 2
        else:
            raw = "true"
            i += 1
        _set_dotted(out, key.replace("-", "_"), _parse_literal(raw))
    return out


def refuse_secret_arguments(args: list[str]) -> None:
    """Refuse (ConfigError, one line that never echoes it) a command line that carries a secret in
    any form: `--sites.secret X`, `--sites.secret=X`, `--sites={secret="X"}`, `--sites '{a.secret="X"}'`."""
    for i, arg in enumerate(args):
        key, eq, raw = arg[2:].partition("=") if arg.startswith("--") else ("", "", arg)
        before = args[i - 1] if i else ""
        owner = f"--{key}" if key else before.partition("=")[0] if before.startswith("--") else "an argument"
        if (key and names_secret(key)) or ((eq or not key) and holds_secret(_parse_literal(raw))):
            raise ConfigError(secret_on_command_line(owner))


# `secret = ` / `"secret":` in a value that did not parse as TOML: it would be echoed in an error.
_SECRET_ASSIGNMENT = re.compile(r"""\bsecret\b["']?\s*[=:]""", re.IGNORECASE)


def names_secret(dotted: str) -> bool:
    """Whether an override key (`sites.secret`, `sites-secret`, `x.SECRET.y`) names a secret (not
    `secret_file`, which names where it is)."""
    return any(part == "secret" or part.endswith("_secret") for part in dotted.replace("-", "_").lower().split("."))


def holds_secret(value: Any, text: bool = True) -> bool:
    """Whether an override's parsed value carries a `secret` key at any depth (inline tables, dotted
    keys inside them, arrays of tables), or (`text`) is unparsed text that assigns one."""
    if isinstance(value, dict):
        return any(names_secret(str(k)) or holds_secret(v, text) for k, v in value.items())
    if isinstance(value, list):
        return any(holds_secret(v, text) for v in value)
    return text and isinstance(value, str) and bool(_SECRET_ASSIGNMENT.search(value))


def check_secret_file_mode(path: Path, raw: dict[str, Any]) -> None:
    """A config file may hold the secret only if no other user can read it (like sites.secret_file)."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077 and holds_secret(raw, text=False):
        raise ConfigError(f"{path} holds sites.secret and other users can read it (mode {mode:o}); refused. Fix: "
                          f"move the secret to ZEROBAND_SECRET or to sites.secret_file (mode 0600), or `chmod 600 {path}`")


def secret_on_command_line(key: str) -> str:
    """The refusal of a secret given as an override; never echoes the value."""
    return (f"{key} puts a secret on the command line, where it is visible to every user in `ps` and is "
            "copied into logs and wandb's run files; refused. Fix: export ZEROBAND_SECRET=<secret>, or set "
            "sites.secret_file to a file of mode 0600 holding it")


def _parse_literal(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Read a TOML file (optional), apply overrides, validate. Raises ConfigError with a clear message."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found (configs live in configs/*.toml)")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        check_secret_file_mode(p, raw)
    if overrides:
        raw = deep_merge(raw, overrides if isinstance(overrides, dict) else parse_overrides(overrides))
    if raw.get("diloco") in (False, "none"):  # `--diloco none`: run a multi-site config as one site
        raw.pop("diloco")
    return validate_config(raw)


def validate_config(raw: dict[str, Any]) -> Config:
    refuse_moved_keys(raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def format_validation_error(err: ValidationError) -> str:
    lines = [f"invalid configuration ({err.error_count()} problem(s)):"]
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-"))
        kind = item["type"]
        if kind == "extra_forbidden":
            section_path, _, key = loc.rpartition(".")
            valid = _valid_keys(section_path)
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {section_path + '.' if section_path else ''}{close[0]}?" if close else ""
            lines.append(f"  {loc}: unknown key. {hint} Valid keys here: {', '.join(valid)}")
        else:
            got = item.get("input")
            secret = loc.split(".")[-1] == "secret"  # whatever it parsed as, it is never echoed
            shown = "" if isinstance(got, dict) else " (value not shown)" if secret else f" (got {got!r})"
            where = loc or "config"
            lines.append(f"  {where}: {item['msg']}{shown}")
    return "\n".join(lines)


def _valid_keys(section_path: str) -> list[str]:
    model: type[BaseModel] = Config
    for part in [p for p in section_path.split(".") if p]:
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            return []
        model = candidates[0]
    return sorted(model.model_fields)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config (TOML) so a run directory says exactly what ran."""
    import tomli_w

    data = cfg.model_dump(exclude_none=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(tomli_w.dumps(data))
    tmp.replace(path)
