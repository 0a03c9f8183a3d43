"""Every file path the docs and the code's comments name exists: a moved or deleted file leaves no
stale pointer behind (README.md, CONTRIBUTING.md, docs/*.md, and every zeroband/ module)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# zeroband/<...>.py, or anything under scripts/, docs/, benchmarks/ (globs such as docs/results/*.md allowed)
PATH = re.compile(r"(?<![\w/.-])(zeroband/[\w/]+\.py|(?:scripts|docs|benchmarks)/[\w.*/-]*[\w*/])")


def mentioned_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every repository path `text` names."""
    return [(n, m[1].rstrip(".")) for n, line in enumerate(text.splitlines(), 1) for m in PATH.finditer(line)]


def exists(path: str, root: Path = REPO) -> bool:
    return any(root.glob(path)) if "*" in path else (root / path).exists()


def sources(root: Path = REPO) -> list[Path]:
    return [root / "README.md", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md")),
            *sorted((root / "zeroband").rglob("*.py"))]


def test_every_path_the_docs_and_comments_name_exists() -> None:
    missing = [f"{f.relative_to(REPO)}:{n}: {p}" for f in sources() if f.exists()
               for n, p in mentioned_paths(f.read_text()) if not exists(p)]
    assert missing == [], "stale references (fix the text or the path):\n" + "\n".join(missing)


def test_the_checker_finds_paths_in_prose_code_and_tables(tmp_path: Path) -> None:
    text = ("see `zeroband/outer/diloco.py` and scripts/bench_train.py.\n"
            "| `benchmarks/train.md` | docs/results/*.md |\n"
            "not a path: my_zeroband/x.py, runs/demo/hf, zeroband.outer\n")
    assert mentioned_paths(text) == [(1, "zeroband/outer/diloco.py"), (1, "scripts/bench_train.py"),
                                     (2, "benchmarks/train.md"), (2, "docs/results/*.md")]
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "a.md").write_text("")
    assert exists("docs/results/*.md", tmp_path) and not exists("benchmarks/*.md", tmp_path)
    assert not exists("docs/results/b.md", tmp_path)
