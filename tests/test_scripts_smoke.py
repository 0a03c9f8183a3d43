"""Every script under scripts/ starts: Python ones answer `--help` (so their imports resolve, the
bug that left bench_quantized.py unable to start), shell ones parse. One child process runs all
the `--help`s, so torch is imported once. Scripts with a `--quick` mode run it in their own tests
(test_bench_*_smoke.py, test_experiment_smoke.py); bench_quantized.py's is here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
PYTHON = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.py"))
SHELL = sorted(str(p.relative_to(SCRIPTS)) for p in [*SCRIPTS.rglob("*.sh"), *SCRIPTS.rglob("*.sbatch")])

# Runs each script as __main__ with --help; prints {script: "ok" | the error}.
_RUNNER = """
import contextlib, io, json, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    saved = list(sys.path)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        out[script] = "ok"
    except SystemExit as e:
        out[script] = "ok" if e.code in (0, None) else f"exit {e.code}"
    except BaseException as e:
        out[script] = f"{type(e).__name__}: {e}"
    sys.path[:] = saved
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_results() -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _RUNNER, *(str(SCRIPTS / s) for s in PYTHON)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return {str(Path(k).relative_to(SCRIPTS)): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("script", PYTHON)
def test_python_script_answers_help(script: str, help_results: dict[str, str]) -> None:
    assert help_results[script] == "ok", help_results[script]


@pytest.mark.parametrize("script", SHELL)
def test_shell_script_parses(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_slurm_script_states_its_usage() -> None:
    done = subprocess.run(["bash", str(SCRIPTS / "slurm" / "site.sbatch")], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "usage: sbatch scripts/slurm/site.sbatch CONFIG" in done.stderr


def test_bench_quantized_quick(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_quantized.py"), "--quick", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads((tmp_path / "quantized.json").read_text())
    rows = {(r["kind"], r["method"]): r for r in data["allreduce"]}
    assert {m for _, m in rows} == {"fp16", "int8", "int4"} and all(r["identical"] for r in rows.values())
    # Bytes counted from the buffers sent: int8 ~1, int4 ~0.53 of a param, plus block scales.
    assert rows["gauss", "int8"]["bytes_per_param"] == pytest.approx(1.0, abs=0.05)
    assert rows["gauss", "int4"]["bytes_per_param"] == pytest.approx(0.53, abs=0.05)
    assert (tmp_path / "quantized.md").read_text().startswith("# Quantised all-reduce")


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


def test_ci_runs_the_readme_test_command_and_it_says_what_it_skipped(tmp_path: Path) -> None:
    """.ci/run is scripts/test.sh; test.sh installs etcd-server or says (first and last) that the etcd
    tests skip. The venv's tools are stubs that log their arguments: the scripts are under test."""
    import os
    import shutil

    venv, calls = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "pip", "ruff"):
        stub = venv / "bin" / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n')
        stub.chmod(0o755)
    env = {**os.environ, "ZEROBAND_VENV": str(venv), "ZEROBAND_NO_APT": "1"}
    done = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    logged = calls.read_text().splitlines()
    assert "ruff check ." in logged and logged[-1] == "python -m pytest -p no:cacheprovider", logged
    skipped = [line for line in done.stdout.splitlines() if "SKIPPED" in line]
    if shutil.which("etcd"):
        assert skipped == []
    else:
        assert len(skipped) == 2 and "etcd store tests skip" in skipped[0] and "ZEROBAND_NO_APT" in skipped[0], skipped
