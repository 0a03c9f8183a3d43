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


def test_nonfinite_record_is_strict_json_and_reads_back_as_floats(tmp_path):
    from zeroband.metrics import MetricsLogger
    from zeroband.tools.launch import progress_line
    from zeroband.tools.report import read_metrics

    metrics = MetricsLogger(validate_config({"output_dir": str(tmp_path)}), tmp_path, True, 10, 0)
    metrics.log(3, {"loss": float("nan"), "grad_norm": float("inf")}, "nonfinite")
    metrics.log(4, {"val_loss": float("-inf"), "val_ppl": 1.0}, "val")
    metrics.close()

    def refuse(name: str) -> None:
        raise ValueError(f"bare {name}: not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line, parse_constant=refuse)["kind"] for line in lines] == ["nonfinite", "val"]
    nonfinite, val = read_metrics(tmp_path / "metrics.jsonl")
    assert nonfinite["loss"] != nonfinite["loss"] and nonfinite["grad_norm"] == float("inf")
    assert val["val_loss"] == float("-inf") and progress_line(lines[1]) == "site 0 step 4: val loss -inf, ppl 1.00"


def test_a_diverged_run_is_told_a_fix_its_config_accepts():
    from zeroband.train import nonfinite_fix

    diloco = validate_config({"diloco": {"inner_steps": 10}, "train": {"steps": 20}})
    assert "rollback" not in nonfinite_fix(diloco) and "launch again" in nonfinite_fix(diloco)
    single = validate_config({})
    assert 'train.on_nonfinite = "rollback"' in nonfinite_fix(single)
    validate_config({"train": {"on_nonfinite": "rollback"}})  # what it suggests, the config takes
    with pytest.raises(ValueError, match="needs a single-site run"):
        validate_config({"diloco": {"inner_steps": 10}, "train": {"steps": 20, "on_nonfinite": "rollback"}})


def test_loss_table_shows_every_site_and_every_outer_step():
    from zeroband.tools.report import loss_table

    def site(offset: float) -> list[dict]:
        train = [{"kind": "train", "step": s, "loss": 5.0 - s / 10 + offset} for s in range(1, 9)]
        outer = [{"kind": "outer", "step": s} for s in (4, 8)]
        return [*train, *outer, {"kind": "val", "step": 8, "val_loss": 4.0}]

    rows = loss_table({"site0": site(0.0), "site1": site(0.01)}, every=3).splitlines()
    assert rows[0] == "| step | | site0 train | site0 val | site1 train | site1 val |"
    shown = {row.split("|")[1].strip(): row for row in rows[2:]}
    assert sorted(shown, key=int) == ["1", "4", "7", "8"]  # every 3rd, the outer steps 4 and 8, the last
    assert "| outer |" in shown["4"] and "| outer |" in shown["8"] and "| outer |" not in shown["7"]
    assert shown["8"] == "| 8 | outer | 4.200 | 4.000 | 4.210 | 4.000 |"


def test_clearing_dtensor_caches_reads_no_deprecated_torch_object():
    import warnings

    from zeroband.mesh import _forget_dtensor_caches

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.distributed.reduce_op warns on any attribute read
        _forget_dtensor_caches()
