"""What a user sees: one-line errors for bad data, export and launch mistakes; log lines above the
progress bar; the end-of-run summary and loss plot; metrics without duplicates after a resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import _error, _train, tiny_overrides
from tests.multiproc import run_ranks
from zeroband.cli import main as cli_main
from zeroband.config import deep_merge, dump_config, validate_config


def _with_bad_line(corpus: dict, path: Path, number: int) -> Path:
    lines = Path(corpus["path"]).read_text().splitlines()
    lines[number - 1] = lines[number - 1][:-3]  # cut the closing of the object: a truncated write
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_json_line_is_one_line_naming_file_and_line(corpus, tmp_path, streaming):
    bad = _with_bad_line(corpus, tmp_path / "broken.jsonl", 7)
    err = _error(tiny_overrides(corpus, tmp_path, data={"path": str(bad), "streaming": streaming}))
    [line] = [x for x in err.splitlines() if "error" in x.lower()]  # (the rest: datasets' progress bar)
    assert f"{bad}:7: not valid JSON" in line and "repair or delete that line" in line, line


BINARY = bytes(range(256)) * 8  # no UTF-8 text: a model file, an archive, a copied binary


def _bad_data(kind: str, tmp_path: Path) -> tuple[dict, str, str]:
    """(data overrides, the file the line must name, what it must say) for one kind of bad file."""
    files = {"empty": ("empty.jsonl", b""), "binary": ("model.txt", BINARY), "binary_gz": ("data.jsonl.gz", BINARY),
             "textless": ("titles.jsonl", b'{"title": "a"}\n{"title": "b"}\n'),
             "blank_texts": ("blank.jsonl", b'{"text": ""}\n{"text": ""}\n'), "parquet": ("x.parquet", b"PAR1 not"),
             "extension": ("corpus.csv", b"text\nhello\n")}
    said = {"empty": "empty file", "binary": "not UTF-8 text", "binary_gz": "cannot be read as gzip",
            "textless": "--data.text_field title", "blank_texts": "contains no text", "parquet": "not a Parquet file",
            "extension": "data.path: cannot tell the format"}
    name, content = files[kind]
    path = tmp_path / name
    path.write_bytes(content)
    return {"path": str(path)}, str(path), said[kind]


@pytest.mark.parametrize("kind", ["empty", "binary", "binary_gz", "textless", "blank_texts", "parquet", "extension"])
def test_bad_data_file_is_one_line_naming_it(corpus, tmp_path, kind):
    data, path, said = _bad_data(kind, tmp_path)
    err = _error(tiny_overrides(corpus, tmp_path, data=data))
    [line] = [x for x in err.splitlines() if "error" in x.lower()]  # (the rest: datasets' progress bar)
    assert line.startswith("zeroband: error:") and path in line and said in line and "Fix:" in line, err


@pytest.mark.parametrize("content", [b"", BINARY])
def test_bad_tokenizer_file_is_one_line_naming_it(corpus, tmp_path, content):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes(content)
    err = _error(tiny_overrides(corpus, tmp_path, data={"tokenizer": str(tok)}))
    [line] = [x for x in err.splitlines() if "error" in x.lower()]
    assert f"{tok / 'tokenizer.json'}: not a tokenizer.json" in line and "data.tokenizer" in line, err


@pytest.mark.parametrize("content, said", [(b"", "empty file"), (BINARY, "not UTF-8 text"),
                                           (b'{"title": "a"}\n', ':1: no "text" string')])
def test_data_command_names_a_bad_corpus_it_would_reuse(tmp_path, capsys, content, said):
    (tmp_path / "train.jsonl").write_bytes(content)  # kept from an earlier run: no download is tried
    assert cli_main(["data", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"zeroband: error: {tmp_path / 'train.jsonl'}") and said in err and "--force" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "tokenizer").exists()


def _export(argv: list[str]) -> tuple[int, str]:
    import io

    sys.stderr = io.StringIO()
    return cli_main(["export", *argv]), sys.stderr.getvalue()


def test_export_errors_are_one_line_each(corpus, tmp_path):
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 2})
    cfg = tmp_path / "cfg.toml"
    dump_config(validate_config(tree), cfg)
    cases = {"no complete checkpoint under": [str(cfg)],
             "no such directory": [str(cfg), "--checkpoint", str(tmp_path / "nope")]}
    for expected, argv in cases.items():
        code, err = run_ranks(_export, 1, (argv,))[0]
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    run_ranks(_train, 1, (tree,))
    wider = tmp_path / "wider.toml"
    dump_config(validate_config(deep_merge(tree, {"model": {"n_layers": 3}})), wider)
    code, err = run_ranks(_export, 1, ([str(wider)],))[0]
    assert code == 2 and "model.n_layers: checkpoint 2 vs config 3" in err and len(err.strip().splitlines()) == 1, err


def test_run_ends_with_summary_and_plot(corpus, tmp_path, capfd, monkeypatch):
    run_ranks(_train, 1, (tiny_overrides(corpus, tmp_path, train={"steps": 4}, eval={"interval": 2}),))
    out = capfd.readouterr().out
    run = tmp_path / "t"
    for text in ("run t: 4 steps, 512 tokens", "final train loss", "val loss", "ppl", f"checkpoints: {run}/checkpoints",
                 f"metrics: {run}/metrics.jsonl", f"loss plot: {run}/loss.png"):
        assert text in out, (text, out)
    assert (run / "loss.png").stat().st_size > 0
    from zeroband.tools.report import run_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert "loss plot: skipped (matplotlib is not installed" in run_report(run, run / "checkpoints", "t", 1.0)
