"""What a resumed run may change: the checkpoint's config against this one, key by key.

Every checkpoint's (signed) manifest carries the resolved config of the run that wrote it. On a
resume `config_changes` compares it with the new config and `resume_rule` sorts each difference:

- "change": how fast, how long, what to log and save (lr, steps, schedule, eval, logging,
  checkpoint cadence, outer lr ...). Applied from the resume on, one printed line each.
- "refuse": what the checkpoint's state only means under the old value (model shape, data order,
  optimizer kind, H, wire format, site count ...). The run stops with one line naming the key.
- "ignore": where this launch puts and finds things (name, output dir, store address, resume path).

The rules are a table of dotted key prefixes; the longest that matches wins, and a key none
matches must not change (a setting added later is refused until someone decides otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from zeroband.trust.auth import flatten_fingerprint

Rule = Literal["change", "refuse", "ignore"]

# key prefix -> (rule, why it may not change); the reason is shown only for "refuse".
RESUME_RULES: dict[str, tuple[Rule, str]] = {
    # where this launch lives and how it reaches the others
    "name": ("ignore", ""), "output_dir": ("ignore", ""),
    "checkpoint.resume": ("ignore", ""), "checkpoint.dir": ("ignore", ""), "checkpoint.allow_unsigned": ("ignore", ""),
    "sites.store": ("ignore", ""), "sites.host_store": ("ignore", ""), "sites.secret_file": ("ignore", ""),
    "sites.insecure": ("ignore", ""), "sites.site_rank": ("ignore", ""), "sites.timeout_s": ("ignore", ""),
    "sites.timeout_floor_s": ("ignore", ""), "sites.wait_factor": ("ignore", ""), "sites.probe_s": ("ignore", ""),
    "model.preset": ("ignore", ""), "model.init_from": ("ignore", ""), "model.init_std": ("ignore", ""),
    # what the checkpoint's state means
    "model": ("refuse", "the checkpoint's weights have the old shape"),
    "data": ("refuse", "the checkpoint's data position is a place in the old token stream"),
    "train.seed": ("refuse", "it fixed the data order and the weights the checkpoint continues"),
    "optim.name": ("refuse", "the checkpoint's optimizer state belongs to the old optimizer"),
    "diloco": ("refuse", "the outer state and every site of the run follow it"),
    "sites.site_count": ("refuse", "the data is sharded by site, and every site's checkpoint holds its share"),
    # how fast and how long to train, and what to record: applied from the resume on
    "optim": ("change", ""), "train": ("change", ""), "eval": ("change", ""), "log": ("change", ""),
    "checkpoint": ("change", ""), "sites.backend": ("change", ""),
    **{f"diloco.{k}": ("change", "") for k in (
        "outer_lr", "outer_momentum", "nesterov", "outer_lr_schedule", "outer_momentum_warmup", "piece_mb",
        "outer_device", "outer_threads", "log_checksum", "outlier_factor", "min_sites", "grace_s", "start_grace_s",
        "heartbeat_s", "dead_after_s", "max_retries", "join_timeout_s")},
}
UNLISTED: tuple[Rule, str] = ("refuse", "no rule says it may change on a resume")


def resume_rule(key: str) -> tuple[Rule, str]:
    """The rule of the longest prefix of the dotted `key` in RESUME_RULES (UNLISTED if none)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:n])) in RESUME_RULES:
            return RESUME_RULES[prefix]
    return UNLISTED


@dataclass(frozen=True)
class ConfigChange:
    key: str
    old: str
    new: str
    rule: Rule
    why: str = ""

    def line(self) -> str:
        return f"{self.key}: {self.old} -> {self.new} from this resume on"


def _shown(value: Any, section: str) -> str:
    return f"[{section}]" if isinstance(value, Mapping) else "none" if value is None else str(value)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[ConfigChange]:
    """The differences that matter between two resolved config trees (model_dump(mode="json")).
    A key only one side has (a setting added or removed between versions) is not compared; a whole
    section present on one side only (`[diloco]`, say) is, under its name."""
    changes = []
    for section in sorted(old.keys() & new.keys()):
        a, b = old[section], new[section]
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            fa, fb = flatten_fingerprint(a, f"{section}."), flatten_fingerprint(b, f"{section}.")
            pairs = [(k, fa[k], fb[k]) for k in sorted(fa.keys() & fb.keys()) if fa[k] != fb[k]]
        else:
            pairs = [(section, _shown(a, section), _shown(b, section))] if a != b else []
        changes += [ConfigChange(key, x, y, *resume_rule(key)) for key, x, y in pairs]
    return [c for c in changes if c.rule != "ignore"]


def refusal(changes: list[ConfigChange], where: str) -> str | None:
    """One line for the first change a resume may not make (None if there is none)."""
    refused = [c for c in changes if c.rule == "refuse"]
    if not refused:
        return None
    c, more = refused[0], [r.key for r in refused[1:]]
    also = f" (also changed: {', '.join(more)})" if more else ""
    fix = f"--{c.key} {c.old}" if "." in c.key else f"--{c.key} none" if c.old == "none" else f"the {c.old} section it had"
    return (f"{c.key} cannot change on resume: {where} was trained with {c.key} = {c.old}, this config has {c.new}"
            f"{also}; {c.why}. Fix: {fix}, or start a new run with --checkpoint.resume none (the old one is moved "
            "aside)")
