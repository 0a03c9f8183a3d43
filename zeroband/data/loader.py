"""Documents -> packed, rank-sharded, exactly resumable token batches.

Pipeline: load documents (local files or a hub dataset) -> split train/val by a hash of each document's
text -> shuffle the train documents (seed + epoch) -> document j of the shuffled split goes to data-parallel
rank j % dp_size -> tokenise, append EOS, concatenate -> rows of seq_len + 1 tokens, consecutive rows
sharing one token so that every token is a target exactly once and no document tail is ever dropped.

Sharding is by global dp rank only, so 2 sites x 1 rank reads the same documents per process as
1 site x 2 ranks. An elastic run reads a lease instead (`set_lease`): pieces of the order that the
shared data ledger (zeroband/data/ledger.py) dealt to this rank, so documents move between sites
that come and go. `.txt` files are split into documents at blank lines (paragraphs).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from zeroband.config import ConfigError, DataConfig
from zeroband.data.ledger import Piece
from zeroband.data.tokenizer import TextTokenizer

Split = Literal["train", "val"]
STATE_VERSION = 1
_TOKENIZE_CHUNK = 64  # documents tokenised per call: amortises the Rust call without a big look-ahead
_SHUFFLE_BUFFER = 10_000  # streaming shuffle buffer, in documents
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_DATA_HINT = "run `zeroband data` to fetch the demo corpus, or set data.path (or data.hub_name)"


# --------------------------------------------------------------------------------------------
# Loading documents


def is_val_document(text: str, val_fraction: float) -> bool:
    """Stable split: a document is validation iff sha1(text), read as a fraction of 2**160, < val_fraction.

    It depends on nothing but the text, so it is the same for any seed, rank count or file order.
    """
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest(), "big") < val_fraction * 2**160


def resolve_files(path: str | list[str]) -> list[str]:
    """Expand globs in data.path; raise FileNotFoundError naming the pattern that matched nothing."""
    files: list[str] = []
    for pattern in [path] if isinstance(path, str) else path:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise FileNotFoundError(f"data.path={pattern!r} matches no file: {_DATA_HINT}")
        files += [m for m in matches if Path(m).is_file()]
    return files


def infer_format(files: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffixes = Path(files[0].removesuffix(".gz").removesuffix(".zst")).suffix
    if suffixes not in _FORMATS:
        accepted = ", ".join(_FORMATS)
        raise DataError(f"data.path: cannot tell the format of {files[0]!r} from its extension; accepted: "
                        f"{accepted} (optionally .gz/.zst). Fix: rename it, or set data.format to json, parquet or text")
    return _FORMATS[suffixes]


def load_documents(cfg: DataConfig) -> Any:
    """A `datasets.Dataset` (or `IterableDataset` when streaming) holding only the text column."""
    import datasets

    if cfg.hub_name:
        ds = datasets.load_dataset(cfg.hub_name, split="train", streaming=cfg.streaming)
        _check_text_field(ds, cfg)
    else:
        files = resolve_files(cfg.path)
        fmt = infer_format(files, cfg.format)
        # datasets fails with a bare StopIteration on empty files; say what is wrong instead.
        if all(Path(f).stat().st_size == 0 for f in files):
            shown = files[0] if len(files) == 1 else f"data.path={cfg.path!r}: all {len(files)} files"
            raise DataError(f"{shown}: empty file, no documents. Fix: {_DATA_HINT}")
        # Paragraphs, not lines, so that prose in a .txt file is not cut into one-line documents.
        extra = {"sample_by": "paragraph"} if fmt == "text" else {}
        quiet = logging.getLogger("datasets")  # it logs its own multi-line report of a bad row first
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            with bad_rows_named(cfg):
                ds = datasets.load_dataset(fmt, data_files=files, split="train", streaming=cfg.streaming, **extra)
                _check_text_field(ds, cfg)  # a streaming dataset reads its first rows here
        finally:
            quiet.setLevel(level)
    return ds.select_columns([cfg.text_field])


@contextmanager
def bad_rows_named(cfg: DataConfig) -> Iterator[None]:
    """A parse failure deep in datasets/pyarrow becomes one DataError naming the file and line."""
    try:
        yield
    except DataError:
        raise
    except Exception:
        files = [] if cfg.hub_name else resolve_files(cfg.path)
        bad = first_unreadable(files, infer_format(files, cfg.format)) if files else None
        if bad is None:
            raise
        raise DataError(bad) from None


class DataError(ConfigError):
    """A data file a user must fix: the message names the file, the line and what to do."""


def first_unreadable(files: list[str], fmt: str) -> str | None:
    """'FILE: what is wrong. Fix: ...' for the first file the `fmt` reader cannot read (not gzip
    though named .gz, not UTF-8 text, not Parquet, a bad JSON line); None if none is found."""
    for name in files:
        if fmt == "parquet":
            problem = _parquet_problem(name)
        else:
            problem = _text_problem(name) or (first_bad_json_line([name]) if fmt == "json" else None)
        if problem is not None:
            return problem if problem.startswith(name) else f"{name}: {problem}"
    return None


def _text_problem(name: str) -> str | None:
    """Why `name` is not UTF-8 text (a binary file, a bad .gz), or None."""
    opener = gzip.open if name.endswith(".gz") else open
    offset = 0
    try:
        with opener(name, "rb") as f:
            while chunk := f.read(1 << 20):
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError as e:
                    if e.start < len(chunk) - 4:  # not merely a character cut by the chunk's end
                        return (f"not UTF-8 text (byte {chunk[e.start]:#04x} at offset {offset + e.start}): is it a "
                                f"binary file? Fix: data.path takes UTF-8 .jsonl/.json/.txt or .parquet files")
                offset += len(chunk)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        return f"cannot be read as {'gzip' if name.endswith('.gz') else 'a file'} ({e}). Fix: repair or remove it"
    return None


def _parquet_problem(name: str) -> str | None:
    import pyarrow.parquet as pq

    try:
        pq.read_schema(name)
    except Exception as e:  # pyarrow's errors are many types; the message is what matters
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"not a Parquet file ({first}). Fix: repair or remove it, or set data.format"
    return None


def first_bad_json_line(files: list[str]) -> str | None:
    """'FILE:LINE: what is wrong. Fix: ...' for the first line of a JSON Lines file that is not one
    JSON object (a .json file is parsed whole); None if every file parses."""
    for name in files:
        with (gzip.open if name.endswith(".gz") else open)(name, "rt", encoding="utf-8", errors="replace") as f:
            if not name.removesuffix(".gz").endswith(".jsonl"):
                try:
                    json.load(f)
                    continue
                except json.JSONDecodeError as e:
                    return f"{name}:{e.lineno}: not valid JSON ({e.msg}). Fix that line, or the file's JSON"
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    return (f"{name}:{number}: not valid JSON ({e.msg}, column {e.colno}). Fix: every line of "
                            'a .jsonl file must be one JSON object, e.g. {"text": "..."}; repair or delete that line')
                if not isinstance(record, dict):
                    return f"{name}:{number}: a JSON {type(record).__name__}, not an object. Fix: write it as {{\"text\": ...}}"
    return None


def _check_text_field(ds: Any, cfg: DataConfig) -> None:
    columns = ds.column_names
    if columns is None:  # streaming json: columns are only known after reading a row
        first = next(iter(ds), None)
        columns = list(first) if first is not None else []
    where = cfg.hub_name or f"data.path={cfg.path!r}"
    if not columns:
        raise DataError(f"{where} contains no documents. Fix: {_DATA_HINT}")
    if cfg.text_field not in columns:
        raise DataError(
            f"{where}: data.text_field={cfg.text_field!r} is not a field of its documents (they have {columns}). "
            f"Fix: set data.text_field to the field that holds the text, e.g. --data.text_field {columns[0]}"
        )


# --------------------------------------------------------------------------------------------
# Document order per split, epoch and rank


class _IndexedSource:
    """In-memory (memory-mapped Arrow) dataset: splits are index arrays, resuming is an index skip."""

    def __init__(self, ds: Any, field: str, val_fraction: float) -> None:
        self.ds, self.field = ds, field
        train: list[int] = []  # document indices
        val: list[int] = []
        offset = 0
        # One hashing pass over the texts; tokenisation happens later, lazily, per rank.
        for batch in ds.iter(batch_size=4096):
            for i, text in enumerate(batch[field], offset):
                if text:
                    (val if is_val_document(text, val_fraction) else train).append(i)
            offset += len(batch[field])
        self.indices = {"train": np.asarray(train, dtype=np.int64), "val": np.asarray(val, dtype=np.int64)}

    def count(self, split: Split) -> int | None:
        return len(self.indices[split])

    def texts(
        self, split: Split, epoch: int, seed: int, rank: int, size: int, start: int
    ) -> Iterator[list[str]]:
        order = self.indices[split]
        if split == "train":
            order = order[np.random.default_rng([seed % 2**32, epoch]).permutation(len(order))]
        yield from self._rows(order[rank::size], start)

    def lease_texts(self, lease: list[Piece], seed: int, start: int) -> Iterator[list[str]]:
        """The train documents of `lease` (global indices: epoch x N + position, zeroband/data/ledger.py),
        from its `start`-th document on."""
        n, orders = len(self.indices["train"]), {}
        picked = []
        for d in (d for a, b in lease for d in range(a, b)):
            epoch = d // n
            if epoch not in orders:
                orders[epoch] = self.indices["train"][np.random.default_rng([seed % 2**32, epoch]).permutation(n)]
            picked.append(orders[epoch][d % n])
        yield from self._rows(np.asarray(picked, dtype=np.int64), start)

    def _rows(self, mine: np.ndarray, start: int) -> Iterator[list[str]]:
        for lo in range(start, len(mine), _TOKENIZE_CHUNK):
            yield self.ds[[int(i) for i in mine[lo : lo + _TOKENIZE_CHUNK]]][self.field]


class _StreamingSource:
    """Streamed dataset: shuffled with a buffer; resuming reads and discards documents (no tokenising)."""

    def __init__(self, ds: Any, field: str, val_fraction: float) -> None:
        self.ds, self.field, self.val_fraction = ds, field, val_fraction
        self.seen: dict[str, int] = {}  # split -> documents in the split, known after one full pass

    def count(self, split: Split) -> int | None:
        return self.seen.get(split)

    def texts(
        self, split: Split, epoch: int, seed: int, rank: int, size: int, start: int
    ) -> Iterator[list[str]]:
        stream = self.ds
        if split == "train":
            stream = stream.shuffle(seed=seed % 2**32, buffer_size=_SHUFFLE_BUFFER)
            stream.set_epoch(epoch)
        chunk: list[str] = []
        j = 0
        for row in stream:
            text = row[self.field]
            if not text or is_val_document(text, self.val_fraction) != (split == "val"):
                continue
            if j % size == rank and j // size >= start:
                chunk.append(text)
                if len(chunk) == _TOKENIZE_CHUNK:
                    yield chunk
                    chunk = []
            j += 1
        self.seen[split] = j
        if chunk:
            yield chunk


# --------------------------------------------------------------------------------------------
# Packing


class _Cursor:
    """Position in one split's token stream for one rank: epoch, documents consumed, leftover tokens."""

    def __init__(self, loader: PackedBatches, split: Split) -> None:
        self.loader, self.split = loader, split
        self.epoch = self.consumed = 0
        self.buffer: list[int] = []
        # Which documents the buffer holds, front to back: [leased document (-1: not leased), offset of
        # its first buffered token in its tokens + EOS, tokens buffered]; and whether buffer[0] was
        # already a row's last token (a target; the next row's first input). For `position`.
        self.docs: deque[list[int]] = deque()
        self.rowed = False
        self.finished = 0  # leased documents whose every token left the buffer
        # (token ids, utf-8 bytes) of documents tokenised ahead but not yet in the buffer (not in the state).
        self.pending: deque[tuple[list[int], int]] = deque()
        self.chunks: Iterator[list[str]] | None = None
        self.bytes = self.tokens = 0

    def next_row(self) -> list[int]:
        need = self.loader.seq_len + 1
        while len(self.buffer) < need:
            self._append_document()
        row = self.buffer[:need]
        # Advance by seq_len, not seq_len + 1: the row's last token is the next row's first input.
        del self.buffer[: self.loader.seq_len]
        self._drop(self.loader.seq_len)
        self.rowed = True
        return row

    def _drop(self, n: int) -> None:
        while n > 0 and self.docs:
            entry = self.docs[0]
            k = min(n, entry[2])
            entry[1], entry[2], n = entry[1] + k, entry[2] - k, n - k
            if entry[2] == 0:
                self.finished += self.docs.popleft()[0] >= 0

    def position(self) -> tuple[int, int]:
        """(leased documents whose every token was a target, tokens of the next one that were): a
        row's targets are its tokens after the first, so buffer[0] counts once a row has ended on it."""
        done = self.finished
        for i, (doc, first, count) in enumerate(self.docs):
            trained = first + (1 if i == 0 and self.rowed else 0)
            if doc < 0:
                continue
            if trained < first + count:
                return done, trained
            done += 1
        return done, 0

    def _append_document(self) -> None:
        if not self.pending and not self._tokenize_more():
            self._next_epoch()
            return
        ids, n_bytes = self.pending.popleft()
        doc, skip = self.loader._leased_doc(self.consumed) if self.split == "train" else (-1, 0)
        stream = [*ids, self.loader.tokenizer.eos_id][skip:]  # skip: tokens an earlier reader trained
        self.buffer += stream
        self.docs.append([doc, skip, len(stream)])
        self.consumed += 1
        self.tokens += len(stream)
        self.bytes += n_bytes

    def _tokenize_more(self) -> bool:
        if self.chunks is None:
            self.chunks = self.loader._texts(self.split, self.epoch, self.consumed)
        texts = next(self.chunks, None)
        if texts is None:
            return False
        ids = self.loader.tokenizer.encode_batch(texts)
        self.pending.extend(zip(ids, (len(t.encode("utf-8")) for t in texts)))
        return True

    def _next_epoch(self) -> None:
        if self.split == "train" and self.loader.leased is not None:
            raise self.loader._lease_error(self.consumed)
        if self.consumed == 0:
            raise self.loader._no_documents_error(self.split)
        self.epoch, self.consumed, self.chunks = self.epoch + 1, 0, None


class PackedBatches:
    """Stateful iterator of packed (inputs, targets) batches for one data-parallel rank.

    The trainer passes dp_rank = site_rank * ranks_per_site + local_rank and dp_size = sites * ranks_per_site,
    so every process of every site reads disjoint documents. The train split never ends: each epoch
    re-shuffles with shuffle_seed + epoch. Streaming and non-streaming give the same val batches but
    different train orders (a shuffle buffer is not a permutation).
    """

    def __init__(
        self, cfg: DataConfig, tokenizer: TextTokenizer, dp_rank: int, dp_size: int, split: Split = "train"
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.cfg, self.tokenizer, self.split = cfg, tokenizer, split
        self.dp_rank, self.dp_size, self.seq_len = dp_rank, dp_size, cfg.seq_len
        ds = load_documents(cfg)
        source_cls = _StreamingSource if cfg.streaming else _IndexedSource
        self._source = source_cls(ds, cfg.text_field, cfg.val_fraction)
        self._check_counts()
        self._cursor = _Cursor(self, split)
        self.leased: list[Piece] | None = None  # elastic runs: the ledger's pieces for this rank (set_lease)
        self.skips: dict[int, int] = {}  # leased documents cut by an earlier reader: doc -> first token to read
        self._lease_docs: list[int] = []
        self._val_cache: dict[tuple[int, int], tuple[list[tuple[torch.Tensor, torch.Tensor]], float]] = {}
        self._bytes_per_token: float | None = None

    def _check_counts(self) -> None:
        n_train, n_val = self._source.count("train"), self._source.count("val")
        if n_train is None:  # streaming: counts are only known after a pass, checked at the first epoch end
            return
        if n_train + (n_val or 0) == 0:
            raise DataError(f"data.path={self.cfg.path!r} contains no text: every document's "
                            f"{self.cfg.text_field!r} is empty. Fix: {_DATA_HINT}")
        if self.split == "train" and n_train < self.dp_size:
            raise self._no_documents_error("train")

    def _no_documents_error(self, split: Split) -> DataError:
        n = self._source.count(split)
        return DataError(
            f"the {split} split has {n if n is not None else 'too few'} documents but dp_size={self.dp_size}: "
            f"rank {self.dp_rank} gets none (data.val_fraction={self.cfg.val_fraction}). "
            "Use more data, fewer ranks/sites, or a different val_fraction."
        )

    def _texts(self, split: Split, epoch: int, start: int) -> Iterator[list[str]]:
        with bad_rows_named(self.cfg):  # streaming: a bad row surfaces only when it is read
            if split == "train" and self.leased is not None:
                assert isinstance(self._source, _IndexedSource)  # set_lease refused a streaming source
                yield from self._source.lease_texts(self.leased, self.cfg.shuffle_seed, start)
                return
            yield from self._source.texts(split, epoch, self.cfg.shuffle_seed, self.dp_rank, self.dp_size, start)

    def _lease_error(self, read: int) -> DataError:
        return DataError(
            f"rank {self.dp_rank} read all {read} documents the data ledger leased to it before the round ended. "
            "Fix: raise data.span_docs (each rank is leased at least 4 x span_docs documents ahead)"
        )

    # ---------------------------------------------------------------------------------------- leases

    @property
    def train_documents(self) -> int:
        """Documents in one epoch of the train split (what the ledger's global indices count in)."""
        n = self._source.count("train")
        if n is None:
            raise DataError("data.streaming = true cannot be used with an elastic run: the data ledger addresses "
                            "documents by index. Fix: set data.streaming = false")
        return n

    def set_lease(self, pieces: list[Piece], skips: dict[int, int] | None = None) -> None:
        """Read `pieces` (the ledger's lease for this rank) from their first document on, instead of
        a fixed slot; a document in `skips` from that token on (an earlier reader trained the ones
        before it). The buffer keeps only its first token if a row already made it a target: the
        next row's first input. A rank that trained part of the lease's first document gets it back
        with its trained tokens in `skips`, so re-reading it packs the same rows as going on would."""
        if self.split != "train":
            raise ValueError("only the train split is leased")
        self.train_documents  # noqa: B018 -- a streaming source stops here, in one line
        self.leased = [(int(p[0]), int(p[1])) for p in pieces]
        self.skips = dict(skips or {})
        self._lease_docs = [d for a, b in self.leased for d in range(a, b)]
        c = self._cursor
        c.consumed, c.chunks, c.finished = 0, None, 0
        c.pending.clear()  # tokenised ahead from the old lease: the new one starts where reading stopped
        c.buffer = c.buffer[:1] if c.rowed else []
        c.docs = deque([[-1, 0, 1]] if c.buffer else [])

    def _leased_doc(self, k: int) -> tuple[int, int]:
        """(global index, first token to read) of the lease's `k`-th document; (-1, 0) without a lease."""
        if self.leased is None:
            return -1, 0
        doc = self._lease_docs[k]
        return doc, self.skips.get(doc, 0)

    @property
    def lease_read(self) -> int:
        """Documents of the current lease read so far (pulled into the packing buffer)."""
        return self._cursor.consumed

    @property
    def lease_position(self) -> tuple[int, int]:
        """What this rank reports to the ledger (zeroband/data/ledger.py `Position`): documents of its
        lease whose every token was a target, and the tokens of the next one that were."""
        return self._cursor.position()

    # ----------------------------------------------------------------------------------------

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both LongTensor [batch_size, seq_len]; targets are inputs shifted by one."""
        rows = torch.tensor([self._cursor.next_row() for _ in range(batch_size)], dtype=torch.long)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def val_batches(self, n_batches: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same `n_batches` validation batches on every call (fixed, unshuffled, rank-sharded order).

        Independent of this loader's own split and position. If this rank's validation documents run out,
        they wrap around (repeat from the first). Also measures `bytes_per_token` on the documents read.
        """
        key = (n_batches, batch_size)
        if key not in self._val_cache:
            cursor = _Cursor(self, "val")
            rows = [cursor.next_row() for _ in range(n_batches * batch_size)]
            t = torch.tensor(rows, dtype=torch.long).view(n_batches, batch_size, -1)
            batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in t]
            self._val_cache[key] = (batches, cursor.bytes / max(cursor.tokens, 1))
        batches, self._bytes_per_token = self._val_cache[key]
        return batches

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 bytes per token (EOS included) of the validation documents read by the last val_batches().

        bits per byte = mean loss in nats / ln(2) / bytes_per_token.
        """
        if self._bytes_per_token is None:
            raise RuntimeError("bytes_per_token is measured by val_batches(); call it first")
        return self._bytes_per_token

    # ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Exact stream position as plain Python values (safe for torch.save and JSON)."""
        c = self._cursor
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "shuffle_seed": self.cfg.shuffle_seed,
            "epoch": c.epoch,
            "docs_consumed": c.consumed,
            "buffer": list(c.buffer),
            **({"lease": [list(p) for p in self.leased], "skips": {str(d): k for d, k in self.skips.items()},
                "docs": [list(e) for e in c.docs], "rowed": c.rowed, "finished": c.finished}
               if self.leased is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken; documents before it are skipped, not re-tokenised."""
        mine = self.state_dict()
        leased = "lease" in state
        for key in ("version", "split", "seq_len", "shuffle_seed") + (() if leased else ("dp_rank", "dp_size")):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"data state was saved with {key}={state.get(key)!r} but this loader has {key}={mine[key]!r}; "
                    "the saved position is meaningless for a different layout"
                )
        cursor = _Cursor(self, self.split)
        cursor.epoch, cursor.consumed = int(state["epoch"]), int(state["docs_consumed"])
        cursor.buffer = [int(t) for t in state["buffer"]]
        self._cursor = cursor
        self.leased = None
        if leased:
            self.set_lease([(int(a), int(b)) for a, b in state["lease"]],
                           {int(d): int(k) for d, k in state.get("skips", {}).items()})
            cursor.consumed, cursor.buffer = int(state["docs_consumed"]), [int(t) for t in state["buffer"]]
            cursor.docs = deque([int(x) for x in e] for e in state.get("docs", []))
            cursor.rowed, cursor.finished = bool(state.get("rowed", True)), int(state.get("finished", 0))


class SiteShare(PackedBatches):
    """One rank's share of its site's stream, for sites of different shapes (issue 26): every rank of
    the site reads the stream a one-rank site `site_rank` of `site_count` reads, and keeps micro-batch
    j of each group of `ranks` when j == rank. So the site trains on the same rows whatever its rank
    count (a resume may change it), at the price of each rank tokenising the whole site's stream."""

    def __init__(self, cfg: DataConfig, tokenizer: TextTokenizer, site_rank: int, site_count: int, ranks: int,
                 rank: int) -> None:
        super().__init__(cfg, tokenizer, site_rank, site_count, "train")
        self.ranks, self.rank = ranks, rank

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        batches = [PackedBatches.next_batch(self, batch_size) for _ in range(self.ranks)]
        return batches[self.rank]
