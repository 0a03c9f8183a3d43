"""The experiment's corpus and tokenizer: decompress and verify the shared corpus, train a BPE on its train split.

Everything is written to a cache directory outside the repository (default ~/.cache/zeroband). The
train/validation split is the loader's own (`is_val_document`, a fixed hash of each document's
text), so the tokenizer never sees a validation document.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
from pathlib import Path

from zeroband.checkpoint import sha256_file

# The prose-v1 corpus (xz-compressed jsonl) lives wherever a machine keeps it: --shared-corpus or this.
SHARED_CORPUS_ENV = "ZEROBAND_PROSE_CORPUS"
SHARED_SHA256 = "52c111d5b419efd06a33d92e812bac307e0bd2301526bcfe180137559d734d46"
DEFAULT_CACHE = Path.home() / ".cache" / "zeroband"


sha256_of = sha256_file  # one implementation, shared with checkpoint verification


def shared_corpus(cache: Path, source: Path | None = None) -> Path:
    """The decompressed shared corpus in `cache`, verified by sha256 (decompressed once) from
    `source` (default: $ZEROBAND_PROSE_CORPUS)."""
    out = cache / "prose-v1.jsonl"
    if out.is_file() and sha256_of(out) == SHARED_SHA256:
        return out
    source = source or (Path(os.environ[SHARED_CORPUS_ENV]) if os.environ.get(SHARED_CORPUS_ENV) else None)
    if source is None or not source.is_file():
        where = f"{source} not found" if source else f"no shared corpus given (and none decompressed in {cache})"
        raise SystemExit(f"{where}: pass --shared-corpus PATH/prose-v1.jsonl.xz (or set {SHARED_CORPUS_ENV}), "
                         "or use any jsonl corpus with --corpus PATH (e.g. data/demo/train.jsonl from `zeroband data`)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with lzma.open(source, "rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    got = sha256_of(tmp)
    if got != SHARED_SHA256:
        tmp.unlink()
        raise SystemExit(f"{source}: sha256 {got} != expected {SHARED_SHA256} (not prose-v1?)")
    tmp.replace(out)
    return out


def write_train_split(corpus: Path, val_fraction: float, out: Path) -> int:
    """The corpus' train documents (the loader's split) as jsonl; returns how many."""
    from zeroband.data.loader import is_val_document

    n = 0
    with open(corpus, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for line in src:
            text = json.loads(line).get("text") if line.strip() else None
            if text and not is_val_document(text, val_fraction):
                dst.write(json.dumps({"text": text}) + "\n")
                n += 1
    return n


def corpus_key(corpus: Path, vocab: int, val_fraction: float) -> str:
    stat = corpus.stat()
    raw = f"{corpus.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{vocab}:{val_fraction}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def prepare_tokenizer(corpus: Path, vocab: int, val_fraction: float, cache: Path) -> Path:
    """A byte-level BPE of `vocab` tokens trained on the train split only; cached by corpus + settings."""
    from zeroband.data.tokenizer import train_tokenizer

    out = cache / f"tokenizer-{vocab}-{corpus_key(corpus, vocab, val_fraction)}"
    if (out / "tokenizer.json").is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    split = cache / f"train-split-{corpus_key(corpus, vocab, val_fraction)}.jsonl"
    write_train_split(corpus, val_fraction, split)
    train_tokenizer([split], vocab, out)
    split.unlink()
    return out


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/experiments/convergence.py --help (or large_h.py)\n(scripts/experiments/exp_data.py is the experiments' corpus and tokenizer; it does nothing on its own)")
