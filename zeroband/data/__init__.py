"""Data layer: demo corpus fetch, tokenizer, packed rank-sharded batches."""

from zeroband.data.fetch import fetch_demo_corpus, prepare_demo
from zeroband.data.loader import PackedBatches, is_val_document
from zeroband.data.tokenizer import TextTokenizer, train_tokenizer

__all__ = [
    "PackedBatches",
    "TextTokenizer",
    "fetch_demo_corpus",
    "is_val_document",
    "prepare_demo",
    "train_tokenizer",
]
