"""Helpers shared by the test modules (configs, the trainer in a forked rank, checkpoint readers).

Test modules import these from here, never from each other; pytest fixtures stay in conftest.py.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.multiproc import free_port, run_ranks
from zeroband.config import validate_config

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can out up what said "
    "about into than them could only other time new some these two may first then do any like my now over such "
    "our man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long"
).split()


def make_corpus(path: Path, n_docs: int = 120, seed: int = 0) -> Path:
    """Documents of word sequences with a learnable structure (a fixed bigram preference)."""
    rng = random.Random(seed)
    follow = {w: rng.sample(WORDS, 5) for w in WORDS}
    with open(path, "w") as f:
        for d in range(n_docs):
            word, words = rng.choice(WORDS), []
            for _ in range(rng.randint(60, 400)):
                word = rng.choice(follow[word]) if rng.random() < 0.8 else rng.choice(WORDS)
                words.append(word)
            text = " ".join(words).capitalize() + "."
            f.write(json.dumps({"text": text, "title": f"doc {d}"}) + "\n")
    return path


def tiny_overrides(corpus: dict[str, str], out: Path, **extra: object) -> dict:
    """A config tree for a ~60k-parameter model on the test corpus; `extra` merges over it."""
    from zeroband.config import deep_merge

    base = {
        "name": "t",
        "output_dir": str(out),
        "model": {"preset": "debug", "vocab_size": 384, "max_seq_len": 64},
        "data": {"path": corpus["path"], "tokenizer": corpus["tokenizer"], "seq_len": 32, "val_fraction": 0.1},
        "train": {"steps": 8, "global_batch": 4, "micro_batch": 2, "device": "cpu"},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "checkpoint": {"interval": 0, "keep_last": 3},
        "eval": {"interval": 0, "batches": 2},
        "log": {"interval": 2, "progress_bar": False},
    }
    return deep_merge(base, extra)


def diloco_tree(corpus: dict, out: Path, **extra) -> dict:
    tree = tiny_overrides(corpus, out, **extra)
    tree.setdefault("diloco", {})
    tree["diloco"] = {"inner_steps": 2, **tree["diloco"]}
    tree["sites"] = {"store": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 60, "insecure": True, **tree.get("sites", {})}
    return tree


def elastic_tree(corpus: dict, out: Path, store: str, steps: int = 10, sites: dict | None = None, **diloco) -> dict:
    tree = tiny_overrides(corpus, out, train={"steps": steps}, eval={"interval": 0, "batches": 1})
    tree["diloco"] = {
        "elastic": True, "inner_steps": 2, "heartbeat_s": 0.25, "dead_after_s": 2.0, "grace_s": 1.0,
        "start_grace_s": 15.0, "comm_dtype": "fp16", **diloco,
    }
    tree["sites"] = {"host_store": False, "store": store, "timeout_s": 30, "insecure": True, **(sites or {})}
    return tree


def _train(tree: dict) -> dict:
    from zeroband.train import train

    return train(validate_config(tree))


def _train_expecting_fault(tree: dict) -> str:
    from tests.faults import InjectedFault

    try:
        _train(tree)
    except InjectedFault as e:
        return str(e)
    return "no fault"


def _main(argv: list[str]) -> tuple[int, str]:
    """zeroband.train.main in a forked rank, with stderr captured."""
    from zeroband.train import main

    sys.stderr = io.StringIO()
    code = main(argv)
    return code, sys.stderr.getvalue()


def _args(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _args(value, f"{prefix}{key}.")
        else:
            out += [f"--{prefix}{key}", json.dumps(value) if isinstance(value, str) else str(value).lower()]
    return out


def _error(tree: dict, ranks: int = 1) -> str:
    code, err = run_ranks(_main, ranks, (_args(tree),))[0]
    assert code == 2, err
    assert "Traceback" not in err
    return err


def final_params(tree: dict, site: int | None, step: int, secret: str | None = None) -> dict[str, torch.Tensor]:
    """A site's parameters at `step`, read as `zeroband export` reads them: a checkpoint signed with
    `secret` (the run's ZEROBAND_SECRET) is verified with it, and refused without it."""
    from zeroband.export import load_for_export

    cfg = validate_config({k: v for k, v in tree.items() if k != "diloco"})
    root = cfg.checkpoint_dir / (f"site{site}" if site is not None else "")
    before = os.environ.pop("ZEROBAND_SECRET", None)
    try:
        if secret is not None:
            os.environ["ZEROBAND_SECRET"] = secret
        return dict(load_for_export(cfg, root / f"step_{step:09d}").state_dict())
    finally:
        os.environ.pop("ZEROBAND_SECRET", None)
        if before is not None:
            os.environ["ZEROBAND_SECRET"] = before


def zeroband_cli(*args: str, timeout: float = 110, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m zeroband ARGS` in a child process (`env` added to this one's), its output captured."""
    return subprocess.run([sys.executable, "-m", "zeroband", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**os.environ, **(env or {})})


def site_records(out: Path, site: int, kind: str) -> list[dict]:
    """The records of one kind ("outer", "membership", ...) in a site's metrics.jsonl."""
    from tests.chaos import read_records

    return read_records(out / "t" / f"site{site}" / "metrics.jsonl", kind)


def outer_records(out: Path, site: int) -> list[dict]:
    return site_records(out, site, "outer")


def _corrupt(ckpt: Path) -> None:
    victim = next(p for p in sorted((ckpt / "dcp").iterdir()) if p.suffix == ".distcp")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


# ------------------------------------------------------------------ who listens where (ss -ltnp, /proc)
LOOPBACK = ("127.0.0.1", "::1", "[::1]")


def listeners(pids: set[int]) -> set[tuple[str, str]]:
    """(local address:port, process name) of every listening TCP socket owned by one of `pids`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids:
            found.add((line.split()[3], re.findall(r'\(\("([^"]*)"', line)[0]))
    return found


def is_loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0] in LOOPBACK
