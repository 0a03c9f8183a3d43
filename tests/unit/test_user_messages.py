"""What a user sees: one-line errors for bad data, export and launch mistakes; log lines above the
progress bar; the end-of-run summary and loss plot; metrics without duplicates after a resume."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from zeroband.cli import main as cli_main
from zeroband.config import ConfigError, load_config, validate_config

REPO = Path(__file__).resolve().parent.parent.parent


def test_launch_without_a_diloco_section(capsys):
    assert cli_main(["launch", str(REPO / "configs" / "demo.toml"), "--sites", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no [diloco] section" in err and "zeroband train" in err and "500" not in err, err


def test_steps_not_a_multiple_of_inner_steps_names_each_fix_once(tmp_path):
    with pytest.raises(ConfigError, match=r"set train.steps to 500, or change diloco.inner_steps"):
        load_config(None, ["--diloco.inner_steps", "500", "--train.steps", "200"])
    with pytest.raises(ConfigError, match=r"set train.steps to 500 or 1000,"):
        load_config(None, ["--diloco.inner_steps", "500", "--train.steps", "700"])


def test_first_bad_json_line_kinds(tmp_path):
    from zeroband.data.loader import first_bad_json_line

    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    listed = tmp_path / "list.jsonl"
    listed.write_text('{"text": "a"}\n["b"]\n')
    whole = tmp_path / "whole.json"
    whole.write_text('[\n {"text": "a"},\n {"text": "b"\n]\n')
    assert first_bad_json_line([str(good)]) is None
    assert first_bad_json_line([str(good), str(listed)]).startswith(f"{listed}:2: a JSON list, not an object")
    assert first_bad_json_line([str(whole)]).startswith(f"{whole}:4: not valid JSON")


def test_log_lines_print_above_the_progress_bar(tmp_path, monkeypatch, capsys):
    from zeroband.metrics import MetricsLogger

    monkeypatch.setenv("ZEROBAND_FORCE_BAR", "1")
    cfg = validate_config({"output_dir": str(tmp_path)})
    console = logging.StreamHandler(sys.stderr)  # what main's logging.basicConfig installs
    logging.getLogger().addHandler(console)
    try:
        metrics = MetricsLogger(cfg, tmp_path, True, 10, 0)
        metrics.progress(5, 3.0, 100.0, 1e-3, 5.0)
        metrics.log(5, {"val_loss": 2.5}, "val")
        logging.getLogger("zeroband.membership.elastic").warning("a warning while the bar is up")
        metrics.close()
    finally:
        logging.getLogger().removeHandler(console)
    err = capsys.readouterr().err
    assert "val step 5 val_loss=2.5" in err and "a warning while the bar is up" in err
    # Each printed line stands alone: the bar is redrawn after it, never spliced into it.
    line = next(x for x in err.replace("\r", "\n").splitlines() if "val step 5" in x)
    assert line.strip() == "val step 5 val_loss=2.5"


def test_records_through_drops_redone_steps(tmp_path):
    from zeroband.metrics import records_through, truncate_after

    lines = [json.dumps({"kind": k, "step": s}) for k, s in [("run", 0), ("train", 2), ("val", 4), ("train", 6)]]
    assert records_through(lines + ["{broken"], 4) == lines[:3]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    truncate_after(path, -1)
    assert path.read_text() == ""
