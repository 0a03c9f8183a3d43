"""Data layer: tokenizer, packing, rank sharding, exact resume, error messages, demo corpus cleaning."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from zeroband.config import DataConfig
from zeroband.data.fetch import clean_text, fetch_demo_corpus, split_document, strip_gutenberg
from zeroband.data.loader import DataError, PackedBatches, is_val_document
from zeroband.data.tokenizer import TextTokenizer, train_tokenizer

WORDS = "the a king queen sword crown night day river stone bright dark speak walk love fear gold".split()
SEQ_LEN = 16


def _make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 60))]
        docs.append(f"Doc {i}: " + " ".join(words) + ".")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    docs = _make_docs(80)
    jsonl = root / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    tok_dir = root / "tokenizer"
    train_tokenizer([jsonl], 300, tok_dir)
    return {
        "root": root,
        "docs": docs,
        "jsonl": jsonl,
        "tok_dir": tok_dir,
        "tok": TextTokenizer.load(tok_dir),
    }


def _cfg(corpus: dict, **kw) -> DataConfig:
    base = dict(
        path=str(corpus["jsonl"]), tokenizer=str(corpus["tok_dir"]), seq_len=SEQ_LEN, val_fraction=0.15
    )
    return DataConfig(**{**base, **kw})


def _split(docs: list[str], val_fraction: float = 0.15) -> tuple[list[str], list[str]]:
    val = [d for d in docs if is_val_document(d, val_fraction)]
    return [d for d in docs if d not in val], val


def _read_docs(pb: PackedBatches, n_docs: int) -> list[list[int]]:
    """Token ids of the first `n_docs` documents in pb's stream, rebuilt from the overlapping rows."""
    stream: list[int] = []
    while stream.count(pb.tokenizer.eos_id) < n_docs:
        x, y = pb.next_batch(1)
        stream += (x[0, :1].tolist() if not stream else []) + y[0].tolist()
    docs, current = [], []
    for t in stream:
        if t == pb.tokenizer.eos_id:
            docs.append(current)
            current = []
        else:
            current.append(t)
    return docs[:n_docs]


def _n_rank_docs(n: int, rank: int, size: int) -> int:
    return len(range(rank, n, size))


# --------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_loads_in_transformers(corpus: dict, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = corpus["tok"]
    hf = AutoTokenizer.from_pretrained(str(corpus["tok_dir"]))
    texts = corpus["docs"][:5] + ["unseen wörds ✓"]
    assert [hf(t, add_special_tokens=False)["input_ids"] for t in texts] == tok.encode_batch(texts)
    assert hf.eos_token_id == tok.eos_id and len(hf) == tok.vocab_size
    assert tok.decode(tok.encode_batch(texts)[-1]) == texts[-1]
    tok.save_pretrained(tmp_path / "export")
    assert (
        AutoTokenizer.from_pretrained(str(tmp_path / "export"))(texts[0])["input_ids"]
        == tok.encode_batch(texts)[:1][0]
    )
    # A bare tokenizer.json file loads too (EOS found by its well-known spelling).
    assert TextTokenizer.load(tmp_path / "export" / "tokenizer.json").encode_batch(texts) == tok.encode_batch(
        texts
    )


def test_tokenizer_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match="zeroband data"):
        TextTokenizer.load("/nonexistent/tokenizer")


# --------------------------------------------------------------------------------------------
# Packing and sharding


def test_packing_keeps_every_token(corpus: dict) -> None:
    tok = corpus["tok"]
    train, _ = _split(corpus["docs"])
    pb = PackedBatches(_cfg(corpus), tok, 0, 1)
    x, y = pb.next_batch(4)
    assert x.shape == y.shape == (4, SEQ_LEN) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:-1, -1], x[1:, 0])  # rows chain: the last target is the next first input
    got = _read_docs(PackedBatches(_cfg(corpus), tok, 0, 1), len(train))
    assert sorted(got) == sorted(tok.encode_batch(train))


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_read_disjoint_documents(corpus: dict, dp_size: int) -> None:
    tok = corpus["tok"]
    train, val = _split(corpus["docs"])
    per_rank = [
        {
            tok.decode(d)
            for d in _read_docs(
                PackedBatches(_cfg(corpus), tok, r, dp_size), _n_rank_docs(len(train), r, dp_size)
            )
        }
        for r in range(dp_size)
    ]
    assert sum(len(s) for s in per_rank) == len(set().union(*per_rank))
    assert set().union(*per_rank) == set(train)
    assert not set(train) & set(val)


def test_val_split_independent_of_dp_size(corpus: dict) -> None:
    tok = corpus["tok"]
    _, val = _split(corpus["docs"])
    assert len(val) >= 4

    def read(rank: int, size: int) -> set[str]:
        pb = PackedBatches(_cfg(corpus), tok, rank, size, split="val")
        return {tok.decode(d) for d in _read_docs(pb, _n_rank_docs(len(val), rank, size))}

    assert read(0, 1) == set(val) == read(0, 2) | read(1, 2)
    assert not read(0, 2) & read(1, 2)


def test_two_sites_equal_one_site_two_ranks(corpus: dict) -> None:
    tok = corpus["tok"]

    def batches(sites: int, ranks_per_site: int) -> list[torch.Tensor]:
        out = []
        for site in range(sites):
            for local in range(ranks_per_site):
                pb = PackedBatches(_cfg(corpus), tok, site * ranks_per_site + local, sites * ranks_per_site)
                out.append(torch.cat(pb.next_batch(3)))
        return out

    a, b = batches(2, 1), batches(1, 2)
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and not torch.equal(a[0], a[1])


# --------------------------------------------------------------------------------------------
# Resume and determinism


def _take(pb: PackedBatches, n: int) -> list[torch.Tensor]:
    return [torch.cat(pb.next_batch(2)) for _ in range(n)]


def _check_resume(cfg: DataConfig, tok: TextTokenizer, before: int, after: int, rank: int = 1) -> None:
    full = _take(PackedBatches(cfg, tok, rank, 2), before + after)
    first = PackedBatches(cfg, tok, rank, 2)
    _take(first, before)
    state = json.loads(json.dumps(first.state_dict()))  # must survive plain serialisation
    resumed = PackedBatches(cfg, tok, rank, 2)
    resumed.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(full[before:], _take(resumed, after)))


@pytest.mark.parametrize("streaming", [False, True])
def test_exact_resume(corpus: dict, streaming: bool) -> None:
    _check_resume(_cfg(corpus, streaming=streaming), corpus["tok"], 7, 5)


@pytest.mark.parametrize("streaming", [False, True])
def test_exact_resume_across_epoch(corpus: dict, streaming: bool) -> None:
    cfg, tok = _cfg(corpus, streaming=streaming), corpus["tok"]
    probe, steps = PackedBatches(cfg, tok, 1, 2), 0
    while probe.state_dict()["epoch"] == 0:
        _take(probe, 1)
        steps += 1
    _check_resume(cfg, tok, steps - 2, 5)
    assert probe.state_dict()["epoch"] == 1


def test_resume_rejects_other_layout(corpus: dict) -> None:
    state = PackedBatches(_cfg(corpus), corpus["tok"], 0, 2).state_dict()
    with pytest.raises(ValueError, match="dp_size"):
        PackedBatches(_cfg(corpus), corpus["tok"], 0, 4).load_state_dict(state)


def test_determinism_and_seed(corpus: dict) -> None:
    tok = corpus["tok"]
    a = _take(PackedBatches(_cfg(corpus), tok, 0, 1), 3)
    b = _take(PackedBatches(_cfg(corpus), tok, 0, 1), 3)
    c = _take(PackedBatches(_cfg(corpus, shuffle_seed=99), tok, 0, 1), 3)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))


def test_epochs_reshuffle(corpus: dict) -> None:
    tok = corpus["tok"]
    train, _ = _split(corpus["docs"])
    docs = _read_docs(PackedBatches(_cfg(corpus), tok, 0, 1), 2 * len(train) + 1)
    first, second = docs[: len(train)], docs[len(train) : 2 * len(train)]
    assert sorted(first) == sorted(second) and first != second


def test_streaming_matches_split_and_val(corpus: dict) -> None:
    tok = corpus["tok"]
    train, _ = _split(corpus["docs"])
    stream = PackedBatches(_cfg(corpus, streaming=True), tok, 0, 1)
    assert sorted(_read_docs(stream, len(train))) == sorted(tok.encode_batch(train))
    plain = PackedBatches(_cfg(corpus), tok, 1, 2).val_batches(3, 2)
    streamed = PackedBatches(_cfg(corpus, streaming=True), tok, 1, 2).val_batches(3, 2)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(plain, streamed))


def test_val_batches_fixed_and_bytes_per_token(corpus: dict) -> None:
    pb = PackedBatches(_cfg(corpus), corpus["tok"], 0, 2)
    with pytest.raises(RuntimeError, match="val_batches"):
        _ = pb.bytes_per_token
    train_before = pb.next_batch(2)
    first = pb.val_batches(40, 4)  # more tokens than this rank's val docs hold: wraps around
    fresh = PackedBatches(_cfg(corpus), corpus["tok"], 0, 2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, fresh.val_batches(40, 4)))
    assert all(torch.equal(p[1], q[1]) for p, q in zip(first, pb.val_batches(40, 4)))
    assert first[0][0].shape == (4, SEQ_LEN)
    assert 1.0 < pb.bytes_per_token < 8.0
    # Validation does not move the train position.
    fresh.next_batch(2)
    assert torch.equal(pb.next_batch(2)[0], fresh.next_batch(2)[0]) and train_before[0].shape == (2, SEQ_LEN)


# --------------------------------------------------------------------------------------------
# File formats and errors


def test_parquet_and_glob_match_jsonl(corpus: dict, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = corpus["docs"]
    pq.write_table(pa.table({"text": docs[:40]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": docs[40:]}), tmp_path / "b.parquet")
    ref = _take(PackedBatches(_cfg(corpus), corpus["tok"], 0, 1), 3)
    got = _take(PackedBatches(_cfg(corpus, path=str(tmp_path / "*.parquet")), corpus["tok"], 0, 1), 3)
    listed = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    got_list = _take(PackedBatches(_cfg(corpus, path=listed), corpus["tok"], 0, 1), 3)
    assert all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(ref, got, got_list))


def test_text_files_split_at_paragraphs(corpus: dict, tmp_path: Path) -> None:
    docs = corpus["docs"][:30]
    (tmp_path / "book.txt").write_text("\n\n".join(docs) + "\n")
    tok = corpus["tok"]
    train, _ = _split(docs)
    got = _read_docs(PackedBatches(_cfg(corpus, path=str(tmp_path / "book.txt")), tok, 0, 1), len(train))
    assert sorted(tok.decode(d).strip() for d in got) == sorted(train)


def test_missing_path_error(corpus: dict, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.path.*zeroband data"):
        PackedBatches(_cfg(corpus, path=str(tmp_path / "nope.jsonl")), corpus["tok"], 0, 1)


def test_missing_text_field_error(corpus: dict) -> None:
    with pytest.raises(ValueError, match=r"data\.text_field='body'.*\['text', 'id'\]"):
        PackedBatches(_cfg(corpus, text_field="body"), corpus["tok"], 0, 1)


def test_too_many_ranks_error(corpus: dict, tmp_path: Path) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus["docs"][:3]))
    with pytest.raises(ValueError, match=r"has \d documents but dp_size=8"):
        PackedBatches(_cfg(corpus, path=str(path), val_fraction=0.0), corpus["tok"], 5, 8)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no"):
        PackedBatches(_cfg(corpus, path=str(empty)), corpus["tok"], 0, 1)


# --------------------------------------------------------------------------------------------
# Demo corpus


GUTENBERG_LIKE = (
    "\ufeffThe Project Gutenberg EBook of Test, by Nobody\r\n\r\nLicence blah\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK TEST ***\r\n\r\n\r\n\r\nTHE PLAY   \r\n\r\n"
    "  First line of verse\t\r\nSecond line\r\n\r\n\r\n\r\n\r\nAct II.\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK TEST ***\r\nMore licence text\r\n"
)


def test_clean_text_strips_gutenberg() -> None:
    assert clean_text(GUTENBERG_LIKE) == "THE PLAY\n\n  First line of verse\nSecond line\n\nAct II."
    assert strip_gutenberg("no markers here") == "no markers here"


def test_split_document_at_paragraphs() -> None:
    paras = [f"Paragraph {i} " + "word " * random.Random(i).randint(50, 400) for i in range(200)]
    text = "\n\n".join(p.strip() for p in paras)
    parts = split_document(text, "Hamlet")
    assert len(parts) > 3 and parts[2][0] == "Hamlet (part 3)"
    assert "\n\n".join(p for _, p in parts) == text  # only cut at paragraph boundaries
    sizes = [len(p.encode()) for _, p in parts]
    assert max(sizes) <= 20_000 and min(sizes) >= 5_000
    assert split_document("short", "Sonnet") == [("Sonnet", "short")]


@pytest.mark.network
@pytest.mark.skipif(os.environ.get("ZEROBAND_NETWORK_TESTS") != "1", reason="set ZEROBAND_NETWORK_TESTS=1")
def test_fetch_demo_corpus(tmp_path: Path) -> None:
    out = fetch_demo_corpus(tmp_path, cache_dir=tmp_path / "cache")
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(docs) > 500 and {"text", "source", "title"} <= set(docs[0])
    assert any(d["title"].startswith("Hamlet (part") for d in docs)
    mtime = out.stat().st_mtime_ns
    assert (
        fetch_demo_corpus(tmp_path, cache_dir=tmp_path / "cache") == out and out.stat().st_mtime_ns == mtime
    )


# --------------------------------------------------------------------------------------------
# Leases from the data ledger (elastic runs)


def _train_order(corpus: dict, cfg: DataConfig, epoch: int) -> list[str]:
    """The train documents in epoch `epoch`'s shuffled order (what the ledger's indices count in)."""
    import numpy as np

    train = [d for d in corpus["docs"] if not is_val_document(d, cfg.val_fraction)]
    return [train[i] for i in np.random.default_rng([cfg.shuffle_seed, epoch]).permutation(len(train))]


def test_a_lease_reads_exactly_its_documents_across_epochs(corpus: dict) -> None:
    cfg, tok = _cfg(corpus), corpus["tok"]
    pb = PackedBatches(cfg, tok, 0, 1)
    n = pb.train_documents
    lease = [(3, 6), (n - 2, n + 2), (n + 10, n + 30)]  # the end of epoch 0, the start of epoch 1, more
    pb.set_lease(lease)
    order = _train_order(corpus, cfg, 0) + _train_order(corpus, cfg, 1)
    want = tok.encode_batch([order[d] for a, b in lease for d in range(a, b)])[:9]
    assert _read_docs(pb, len(want)) == want
    assert 9 <= pb.lease_read < 29  # counted as they enter the packing buffer


def test_a_lease_resumes_exactly_and_its_end_is_one_line(corpus: dict) -> None:
    cfg, tok = _cfg(corpus), corpus["tok"]
    full = PackedBatches(cfg, tok, 0, 1)
    full.set_lease([(0, 30)])
    expected = _take(full, 6)
    first = PackedBatches(cfg, tok, 0, 1)
    first.set_lease([(0, 30)])
    _take(first, 3)
    resumed = PackedBatches(cfg, tok, 1, 2)  # a lease does not depend on the rank layout
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert all(torch.equal(p, q) for p, q in zip(expected[3:], _take(resumed, 3)))
    short = PackedBatches(cfg, tok, 0, 1)
    short.set_lease([(0, 2)])
    with pytest.raises(DataError, match=r"read all 2 documents .* Fix: raise data.span_docs"):
        _take(short, 20)
    with pytest.raises(DataError, match="data.streaming = true cannot be used with an elastic run"):
        PackedBatches(_cfg(corpus, streaming=True), tok, 0, 1).set_lease([(0, 2)])


def test_a_round_end_inside_a_document_is_neither_lost_nor_read_twice(corpus: dict) -> None:
    """The ledger cuts a document at a round's end (zeroband/data/ledger.py): the position counts
    every token that entered a row once, re-leasing from it packs the very rows going on would,
    and a second reader given the cut document starts at the first token nobody trained."""
    cfg, tok = _cfg(corpus), corpus["tok"]
    order = _train_order(corpus, cfg, 0)
    lengths = [len(ids) + 1 for ids in tok.encode_batch(order[:30])]  # + EOS
    going_on, releasing = PackedBatches(cfg, tok, 0, 1), PackedBatches(cfg, tok, 0, 1)
    going_on.set_lease([(0, 30)])
    releasing.set_lease([(0, 30)])
    base = 0  # the lease's first document, in the original order
    for rounds in range(1, 5):
        same = [_take(pb, 3) for pb in (going_on, releasing)]
        assert all(torch.equal(p, q) for p, q in zip(*same))
        docs, tokens = releasing.lease_position
        entered = sum(lengths[: base + docs]) + tokens  # the first input and every target so far
        assert entered == 1 + rounds * 3 * 2 * SEQ_LEN and 0 < tokens < lengths[base + docs], (docs, tokens)
        base += docs
        releasing.set_lease([(base, 30)], {base: tokens})  # the ledger's new lease for a rank that goes on
    cut = PackedBatches(cfg, tok, 0, 1)
    cut.set_lease([(0, 30)])
    last = cut.next_batch(1)[1][0, -1].item()
    docs, tokens = cut.lease_position
    other = PackedBatches(cfg, tok, 0, 1)  # the cut document goes to a site with an empty buffer
    other.set_lease([(docs, docs + 3)], {docs: tokens})
    x, y = other.next_batch(1)
    whole = [*tok.encode_batch([order[docs]])[0], tok.eos_id]
    n = min(len(whole) - tokens, SEQ_LEN)
    assert whole[tokens - 1] == last and x[0, :n].tolist() == whole[tokens : tokens + n]
