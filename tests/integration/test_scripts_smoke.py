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
import time
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


@pytest.mark.parametrize("script", PYTHON)
def test_python_script_answers_help(script: str, help_results: dict[str, list]) -> None:
    code, text, seconds = help_results[script]
    assert code == 0, code
    assert _usage_line(text), f"no usage line in:\n{text[:2000]}"  # a module the scripts import names their command
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


# ------------------------------------------------------ the README's commands, right after the demo
def _readme_commands() -> list[str]:
    """The commands of README.md's "Using it" block, in order, without their comments."""
    text = (REPO / "README.md").read_text()
    block = text[text.index("\n## Using it"):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _demo_checkout(root: Path, corpus: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A copy of the checkout's demo: demo.sh and setup.sh, the demo configs shrunk to a tiny model
    and 4 steps (same names, same relative data paths), the test corpus as data/demo/ (so `zeroband
    data` reuses it, offline), and a venv whose tools run this tree's zeroband (the install is not
    under test here: tests/integration/test_wheel.py installs the wheel). Returns (root, environment)."""
    import shutil

    import tomli_w
    import tomllib

    from zeroband.config import deep_merge

    (root / "scripts").mkdir(parents=True)
    for name in ("demo.sh", "setup.sh"):
        shutil.copy(SCRIPTS / name, root / "scripts" / name)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    tiny = {"model": {"preset": "debug", "vocab_size": 384, "max_seq_len": 64}, "data": {"seq_len": 32},
            "train": {"steps": 4, "global_batch": 4, "micro_batch": 2}, "checkpoint": {"interval": 4},
            "eval": {"interval": 2, "batches": 1}, "log": {"interval": 1, "progress_bar": False}}
    (root / "configs").mkdir()
    for name, extra in (("demo.toml", {}), ("demo_diloco.toml", {"diloco": {"inner_steps": 2}})):
        tree = deep_merge(tomllib.loads((REPO / "configs" / name).read_text()), deep_merge(tiny, extra))
        (root / "configs" / name).write_text(tomli_w.dumps(tree))
    (root / "data" / "demo").mkdir(parents=True)
    shutil.copy(corpus["path"], root / "data" / "demo" / "train.jsonl")
    shutil.copytree(corpus["tokenizer"], root / "data" / "demo" / "tokenizer")
    venv = root / "venv" / "bin"
    venv.mkdir(parents=True)
    tools = {"python": f'exec {sys.executable} "$@"', "zeroband": f'exec {sys.executable} -m zeroband "$@"',
             "torchrun": f'exec {sys.executable} -m torch.distributed.run "$@"'}
    for tool, line in tools.items():
        (venv / tool).write_text(f"#!/bin/sh\n{line}\n")
        (venv / tool).chmod(0o755)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    (root / "venv" / ".zeroband-installed").touch()  # newer than pyproject.toml: setup.sh installs nothing
    env = {k: v for k, v in os.environ.items() if k != "ZEROBAND_SECRET"}  # the demo must keep its own
    from tests.multiproc import free_port

    env.update(ZEROBAND_VENV=str(root / "venv"), PYTHONPATH=str(REPO), PATH=f"{venv}:{env['PATH']}",
               PET_MASTER_PORT=str(free_port()), ZEROBAND_NO_APT="1")  # plain torchrun's port: a free one
    return root, env


@pytest.mark.slow
@pytest.mark.timeout(600)  # 6 runs of 2-4 torchrun ranks each importing torch: 130 s of CPU, 400 s wall at load 20
def test_readme_commands_succeed_right_after_the_demo(corpus: dict[str, str], tmp_path: Path) -> None:
    """`bash scripts/demo.sh`, then every command of the README's "Using it" block in order, on the
    demo's configs shrunk to 4 steps: each exits 0. The demo keeps its run's secret where launch and
    export find it, so its signed checkpoints still verify; its loss table shows every outer step."""
    root, env = _demo_checkout(tmp_path / "checkout", corpus)
    demo = subprocess.run(["bash", "scripts/demo.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert (root / "runs" / "demo-diloco" / "launch.secret").stat().st_mode & 0o777 == 0o600
    table = demo.stdout[demo.stdout.index("| step |"):].splitlines()
    assert table[0].startswith("| step | | site0 train | site0 val | site1 train | site1 val |"), table
    assert [row.split("|")[1].strip() for row in table if "| outer |" in row] == ["2", "4"], table
    for command in _readme_commands():
        t0 = time.monotonic()
        done = subprocess.run(command.split(), cwd=root, env=env, capture_output=True, text=True, timeout=240)
        print(f"{time.monotonic() - t0:.1f} s  {command}")
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        assert "FutureWarning" not in done.stderr, (command, done.stderr[-3000:])
    assert (root / "my-model" / "config.json").is_file()
