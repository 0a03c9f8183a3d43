"""Shared fixtures: a small corpus and tokenizer built offline (helpers live in tests/helpers.py)."""

from __future__ import annotations

import os

import pytest

from tests.helpers import make_corpus

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from zeroband.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    jsonl = make_corpus(root / "train.jsonl")
    train_tokenizer([jsonl], 384, root / "tokenizer")
    return {"path": str(jsonl), "tokenizer": str(root / "tokenizer")}


