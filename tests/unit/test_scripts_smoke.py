"""Every script under scripts/ (found by glob, so a new one is covered) answers `--help` at once:
exit 0, a usage line, no work done and nothing written (the bug that ran compiled_codec.py's
experiment on --help, and demo.sh's install). Python ones run in one child process, torch imported
once before the clock starts; shell ones each in their own bash. Scripts with a `--quick` mode run
it in their own tests (test_bench_*_smoke.py, test_experiment_smoke.py); bench_quantized.py's is here."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent

SCRIPTS = REPO / "scripts"


def test_out_refusal_keeps_smoke_runs_out_of_the_committed_results(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from bench_common import out_refusal, output_dir

    for committed in ("benchmarks", "docs/results", "benchmarks/h100", "docs/../benchmarks"):
        assert "never writes to" in out_refusal(REPO / committed, quick=True)
        assert out_refusal(REPO / committed, quick=False) is None  # a real run, asked for
    assert out_refusal(tmp_path, quick=True) is None and out_refusal(None, quick=True) is None
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    made = output_dir(None, "step", quick=True)
    assert made.parent == tmp_path and made.name.startswith("zeroband-step-") and made.is_dir()


def test_experiment_corpus_location_is_a_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lzma

    monkeypatch.syspath_prepend(str(SCRIPTS / "experiments"))
    from exp_data import SHARED_CORPUS_ENV, shared_corpus

    monkeypatch.delenv(SHARED_CORPUS_ENV, raising=False)
    with pytest.raises(SystemExit, match=f"--shared-corpus PATH.*{SHARED_CORPUS_ENV}.*--corpus PATH"):
        shared_corpus(tmp_path / "cache")
    with pytest.raises(SystemExit, match="nope.xz not found"):
        shared_corpus(tmp_path / "cache", tmp_path / "nope.xz")
    other = tmp_path / "other.jsonl.xz"
    with lzma.open(other, "wt") as f:
        f.write('{"text": "not prose-v1"}\n')
    monkeypatch.setenv(SHARED_CORPUS_ENV, str(other))
    with pytest.raises(SystemExit, match="sha256 .* != expected"):
        shared_corpus(tmp_path / "cache")


def test_chaos_says_in_one_line_that_no_site_trained(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from chaos import untrained

    from tests.chaos import SiteProcess

    log = tmp_path / "site0.log"
    log.write_text("Traceback (most recent call last):\n  ...\nzeroband: error: tokenizer 'x' not found (data.tokenizer)\n")
    sites = [SiteProcess(0, [], {}, log)]
    metrics = [tmp_path / "site0" / "metrics.jsonl"]
    line = untrained(sites, metrics)
    assert line is not None and "no site trained" in line and "tokenizer 'x' not found" in line and "\n" not in line
    metrics[0].parent.mkdir()
    metrics[0].write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    assert untrained(sites, metrics) is None


def test_hetero_rows_compare_at_equal_tokens_and_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heterogeneous-speed study's design holds by construction: the time budget with a half-speed
    site trains the tokens of 4 equal sites, and the synchronous rows take the budget's wall time."""
    monkeypatch.syspath_prepend(str(SCRIPTS / "experiments"))
    import hetero

    specs = {s.row: s for s in hetero.specs(1)}
    steps = {row: hetero.site_steps(s) for row, s in specs.items()}
    assert steps == {"equal": 8400, "budget_half": 8400, "sync_wall": 4800, "drop_slow": 7200, "budget_half_rda": 8400}
    budget = specs["budget_half"]
    rounds, seconds = budget.steps // budget.h, budget.extra["diloco"]["round_seconds"]
    assert rounds * seconds == specs["sync_wall"].steps // specs["sync_wall"].h * 2 * seconds  # slow site's pace
    assert specs["drop_slow"].steps // specs["drop_slow"].h == rounds
    assert len({hetero.key_of(s, "v") for s in specs.values()}) == len(specs)


def test_late_schedule_is_seeded_shared_by_rows_and_never_late_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The late-work study's design: one schedule per seed for every row (paired rows), never at the
    last round (the late work would land after the end), never the same site two rounds running (a
    late site waits out the next round), and a distinct cached row per (row, seed)."""
    monkeypatch.syspath_prepend(str(SCRIPTS / "experiments"))
    import late

    for seed in range(3):
        at = late.schedule(seed, late.ROUNDS)
        assert at == late.schedule(seed, late.ROUNDS) and at and max(at) < late.ROUNDS and min(at) >= 1
        assert all(at.get(r - 1) != s for r, s in at.items()) and set(at.values()) <= set(range(late.SITES))
    specs = late.specs(2)
    assert len({late.key_of(s, "v") for s in specs}) == len(specs) == 2 * len(late.ROWS)
