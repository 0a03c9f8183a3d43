"""Shared fixtures: a small corpus and tokenizer built offline, and configs that point at them."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

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


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from zeroband.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    jsonl = make_corpus(root / "train.jsonl")
    train_tokenizer([jsonl], 384, root / "tokenizer")
    return {"path": str(jsonl), "tokenizer": str(root / "tokenizer")}


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
