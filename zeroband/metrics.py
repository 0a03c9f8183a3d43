"""What a run tells its user: a progress bar, a JSONL file, wandb, and the utilisation account."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zeroband.config import ALLOW_UNSIGNED_WARNING, Config
from zeroband.records import encode_record

log = logging.getLogger(__name__)

# Peak dense throughput used for the MFU estimate. On CPU there is no meaningful datasheet number,
# so MFU is reported against a measured-free nominal value only when the user sets one.
PEAK_FLOPS_ENV = "ZEROBAND_PEAK_FLOPS"
KNOWN_PEAK_FLOPS = {"H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in KNOWN_PEAK_FLOPS.items():
            if key in name:
                return value
    return None


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is KiB on Linux: the process's peak resident set, the honest CPU number.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ComputeClock:
    """Splits wall time into inner compute and everything else, for `compute utilisation`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.compute_s = 0.0

    def add_compute(self, seconds: float) -> None:
        self.compute_s += seconds

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.start

    @property
    def utilisation(self) -> float:
        return self.compute_s / max(self.wall_s, 1e-9)

    def state_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "wall_s": self.wall_s}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.compute_s = state["compute_s"]
        self.start = time.perf_counter() - state["wall_s"]


class MetricsLogger:
    """Writes metrics on the site's rank 0 only; other ranks get a logger that does nothing."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, total_steps: int, start_step: int, tag: str = "",
                 keep_through: int | None = None) -> None:
        """`keep_through`: the step the run resumed from (-1: a fresh start). Records after it in an
        existing metrics.jsonl belong to work that is about to be redone and are dropped, so a
        reader never sees a step twice. None keeps the file as it is."""
        self.enabled = enabled
        self.tag = tag
        self.file = None
        self.bar = None
        self.redirect = None
        self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if keep_through is not None:
            truncate_after(self.path, keep_through)
        self.file = open(self.path, "a", buffering=1)
        if cfg.log.progress_bar and sys.stderr.isatty() or os.environ.get("ZEROBAND_FORCE_BAR"):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc=tag or cfg.name, dynamic_ncols=True)
            # Log lines (validation, outer steps, warnings) print above the bar instead of through it.
            self.redirect = logging_redirect_tqdm()
            self.redirect.__enter__()
        if cfg.log.wandb_project and cfg.log.wandb_mode != "disabled":
            self.wandb = _init_wandb(cfg, run_dir, tag)

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": time.time(), **metrics}
        self._write(record)
        if self.wandb is not None:
            self.wandb.log({f"{kind}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if kind == "train":
            if self.bar is None:  # with a bar, train records show in its postfix
                log.info("step %d %s", step, _short(metrics))
        elif self.bar is not None:  # above the bar: tqdm.write keeps the bar intact
            self.bar.write(f"{kind} step {step} {_short(metrics)}", file=sys.stderr)
        else:
            log.info("%s step %d %s", kind, step, _short(metrics))

    def _write(self, record: dict[str, Any]) -> None:
        assert self.file is not None  # callers return first when the logger is disabled
        self.file.write(encode_record(record) + "\n")

    def record_insecure(self, step: int, choices: dict[str, str]) -> None:
        """One `insecure` record per insecure setting in effect (`insecure_choices`), in the file only:
        its loud line was printed where the run started."""
        if not self.enabled:
            return
        for setting, effect in choices.items():
            self._write({"kind": "insecure", "step": step, "time": time.time(), "setting": setting, "effect": effect})
        if self.wandb is not None and choices:
            self.wandb.config.update({"insecure": sorted(choices)}, allow_val_change=True)

    def rewind(self, step: int) -> None:
        """Drop the records after `step` (a rollback will redo those steps)."""
        if not self.enabled:
            return
        assert self.file is not None  # open while enabled
        self.file.close()
        truncate_after(self.path, step)
        self.file = open(self.path, "a", buffering=1)

    def progress(self, step: int, loss: float, tokens_per_s: float, lr: float, eta_s: float) -> None:
        if self.bar is None:
            return
        self.bar.n = step
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}", eta=_fmt_eta(eta_s))

    def close(self) -> None:
        if self.redirect is not None:
            self.redirect.__exit__(None, None, None)
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


SITES_INSECURE_EFFECT = ("cross-site messages are NOT authenticated nor encrypted: anyone who can reach the store or "
                         "the sites' ports can join the run or forge its messages, and anyone on the path reads the model")


def insecure_choices(cfg: Config, unauthenticated: bool) -> dict[str, str]:
    """The insecure settings in effect, setting -> what it lets through: `sites.insecure` when this
    run's cross-site traffic is `unauthenticated` (several sites, no secret), `checkpoint.allow_unsigned`."""
    choices = {"sites.insecure": SITES_INSECURE_EFFECT} if unauthenticated else {}
    if cfg.checkpoint.allow_unsigned:
        choices["checkpoint.allow_unsigned"] = ALLOW_UNSIGNED_WARNING
    return choices


def records_through(lines: list[str], step: int) -> list[str]:
    """The JSONL lines whose record is at or before `step` (unparseable lines are dropped too)."""
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def truncate_after(path: Path, step: int) -> None:
    """Rewrite `path` without the records after `step` (atomically: a crash keeps the old file)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = records_through(lines, step)
    if len(kept) == len(lines):
        return
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    log.info("%s: dropped %d records after step %d (work redone after the resume)", path, len(lines) - len(kept), step)


def _init_wandb(cfg: Config, run_dir: Path, tag: str) -> Any:
    try:
        import wandb
    except ImportError:
        raise RuntimeError("log.wandb_project is set but wandb is not installed: pip install 'zeroband[wandb]'") from None
    return wandb.init(
        project=cfg.log.wandb_project,
        name=f"{cfg.name}{'-' + tag if tag else ''}",
        mode=cfg.log.wandb_mode,
        dir=str(run_dir),
        config=cfg.model_dump(),
    )


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _short(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        elif isinstance(v, (int, str)):
            parts.append(f"{k}={v}")
    return " ".join(parts)
