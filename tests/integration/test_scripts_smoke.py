"""Every script under scripts/ (found by glob, so a new one is covered) answers `--help` at once:
exit 0, a usage line, no work done and nothing written (the bug that ran compiled_codec.py's
experiment on --help, and demo.sh's install). Python ones run in one child process, torch imported
once before the clock starts; shell ones each in their own bash. Scripts with a `--quick` mode run
it in their own tests (test_bench_*_smoke.py, test_experiment_smoke.py); bench_quantized.py's is here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit import test_scripts_smoke as unit_tier  # what both tiers share is defined there, once

REPO = unit_tier.REPO
SCRIPTS = unit_tier.SCRIPTS

PYTHON = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.py"))

SHELL = sorted(str(p.relative_to(SCRIPTS)) for p in [*SCRIPTS.rglob("*.sh"), *SCRIPTS.rglob("*.sbatch")])

HELP_S = 10.0  # parsing arguments; anything slower started the work itself

# Runs each script as __main__ with --help; prints {script: [exit code or error, stdout, seconds]}.
_RUNNER = """
import contextlib, io, json, os, runpy, sys, time
import torch, zeroband.train  # paid once, before any clock starts
out = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    saved, text, t0 = list(sys.path), io.StringIO(), time.monotonic()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` has it
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else str(e.code))
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    out[script] = [code, text.getvalue(), time.monotonic() - t0]
    sys.path[:] = saved
print(json.dumps(out))
"""


def _sandbox(tmp: Path) -> dict[str, str]:
    """An environment whose temporary directory, home and venv are empty folders of the test's,
    so anything a script writes (a temp results dir, a cache, a venv) shows up there."""
    for d in ("tmp", "home"):
        (tmp / d).mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp / "tmp"), "HOME": str(tmp / "home"), "ZEROBAND_VENV": str(tmp / "venv"),
            "PYTHON": "false", "ZEROBAND_NO_APT": "1"}


def _written(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for d in ("tmp", "home", "venv") for p in (tmp / d).rglob("*")
                  if "__pycache__" not in p.parts)


def _repo_changes() -> set[str]:
    done = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    return set(done.stdout.splitlines())


@pytest.fixture(scope="module")
def help_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    tmp, before = tmp_path_factory.mktemp("help"), _repo_changes()
    done = subprocess.run([sys.executable, "-c", _RUNNER, *(str(SCRIPTS / s) for s in PYTHON)], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env=_sandbox(tmp))
    assert done.returncode == 0, done.stderr[-4000:]
    results = {str(Path(k).relative_to(SCRIPTS)): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    results["(all)"] = [_written(tmp), sorted(_repo_changes() - before)]
    return results


def _usage_line(text: str) -> bool:
    return any(line.lower().startswith("usage:") for line in text.splitlines())


def _is_library(script: str) -> bool:
    """A helper module the scripts import (bench_common.py): no `__main__` block, nothing to ask."""
    return 'if __name__ == "__main__":' not in (SCRIPTS / script).read_text()


@pytest.mark.parametrize("script", PYTHON)
def test_python_script_answers_help(script: str, help_results: dict[str, list]) -> None:
    code, text, seconds = help_results[script]
    assert code == 0, code
    if _is_library(script):  # run as a script, it must do nothing at all
        assert text == "", f"{script} has no __main__ block but printed:\n{text[:2000]}"
    else:
        assert _usage_line(text), f"no usage line in:\n{text[:2000]}"
    assert seconds < HELP_S, f"--help took {seconds:.1f} s: it did work"


def test_python_scripts_help_writes_nothing(help_results: dict[str, list]) -> None:
    written, changed = help_results["(all)"]
    assert written == [] and changed == [], (written, changed)


@pytest.mark.parametrize("script", SHELL)
def test_shell_script_parses_and_answers_help(script: str, tmp_path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    before = _repo_changes()
    done = subprocess.run(["bash", str(SCRIPTS / script), "--help"], cwd=tmp_path, env=_sandbox(tmp_path),
                          capture_output=True, text=True, timeout=HELP_S)
    assert done.returncode == 0 and _usage_line(done.stdout), done.stdout + done.stderr
    assert _written(tmp_path) == [] and _repo_changes() == before


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


def test_ci_runs_the_readme_test_command_and_it_says_what_it_skipped(tmp_path: Path) -> None:
    """.ci/run is scripts/test.sh; test.sh installs etcd-server or says (first and last) that the etcd
    tests skip. The venv's tools are stubs that log their arguments: the scripts are under test."""
    import os
    import shutil

    venv, calls = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "pip", "ruff", "mypy"):
        stub = venv / "bin" / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n')
        stub.chmod(0o755)
    env = {**os.environ, "ZEROBAND_VENV": str(venv), "ZEROBAND_NO_APT": "1"}
    done = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    logged = calls.read_text().splitlines()
    assert "ruff check ." in logged and "mypy " in logged and logged[-1] == "python -m pytest -p no:cacheprovider", logged
    skipped = [line for line in done.stdout.splitlines() if "SKIPPED" in line]
    if shutil.which("etcd"):
        assert skipped == []
    else:
        assert len(skipped) == 2 and "etcd store tests skip" in skipped[0] and "ZEROBAND_NO_APT" in skipped[0], skipped
