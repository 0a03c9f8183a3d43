"""`zeroband data` fetches sdists without running them: a fake sdist whose setup.py would write a
marker file is served from a local index; the marker never appears, and a wrong sha256 is refused
before the archive is opened."""

from __future__ import annotations

import functools
import hashlib
import io
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from zeroband.data.fetch import FetchError, download_sdists, open_sdist

NAME = "fakepkg-1.0.tar.gz"


def _fake_sdist(path: Path, marker: Path, members: dict[str, bytes] | None = None) -> str:
    """An sdist whose setup.py (run by any build, `pip download` included) creates `marker`."""
    setup = f"open({str(marker)!r}, 'w').write('setup.py ran')\nfrom setuptools import setup\nsetup(name='fakepkg')\n"
    files = {"fakepkg-1.0/setup.py": setup.encode(), "fakepkg-1.0/PKG-INFO": b"Name: fakepkg\nVersion: 1.0\n",
             "fakepkg-1.0/data/text.txt": b"In the beginning\n", **(members or {})}
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def index(tmp_path):
    """A PEP 503 simple index with the fake sdist, served over http on 127.0.0.1."""
    root, marker = tmp_path / "index", tmp_path / "setup-py-ran"
    (root / "files").mkdir(parents=True)
    (root / "simple" / "fakepkg").mkdir(parents=True)
    digest = _fake_sdist(root / "files" / NAME, marker)
    (root / "simple" / "fakepkg" / "index.html").write_text(
        f'<html><body><a href="../../files/{NAME}#sha256={digest}">{NAME}</a></body></html>')
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}/simple", "root": root, "digest": digest,
           "marker": marker}
    server.shutdown()
    server.server_close()


def test_fetch_through_pip_index_config_never_runs_setup(index, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", index["url"])  # pip's own configuration names the index
    cache = tmp_path / "cache"
    paths = download_sdists(cache, pins={NAME: index["digest"]})
    assert hashlib.sha256(paths[NAME].read_bytes()).hexdigest() == index["digest"]
    with open_sdist(paths[NAME]) as tar:
        assert tar.extractfile("fakepkg-1.0/data/text.txt").read() == b"In the beginning\n"
    # A file:// index works the same way.
    again = download_sdists(tmp_path / "cache2", {NAME: index["digest"]}, [(index["root"] / "simple").as_uri()])
    assert again[NAME].read_bytes() == paths[NAME].read_bytes()
    assert not index["marker"].exists()


def test_wrong_sha256_is_refused_before_anything_is_opened(index, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match="does not match the pinned"):
        download_sdists(cache, {NAME: "0" * 64}, [index["url"]])
    assert list(cache.iterdir()) == []  # neither the file nor a partial download is kept
    assert not index["marker"].exists()
    with pytest.raises(FetchError, match="in none of pip's indexes"):
        download_sdists(cache, {"other-1.0.tar.gz": "0" * 64}, [index["url"]])


@pytest.mark.parametrize("member", ["../escape.txt", "/etc/evil.txt", "fakepkg-1.0/../../escape.txt"])
def test_unsafe_archive_members_are_refused(tmp_path, member):
    path = tmp_path / NAME
    _fake_sdist(path, tmp_path / "marker", {member: b"x"})
    with pytest.raises(FetchError, match="unsafe archive member"):
        open_sdist(path)
