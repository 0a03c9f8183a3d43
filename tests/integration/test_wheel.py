"""The built wheel is the whole installed package: built from a copy of the checkout, installed by pip
into a folder of its own, and imported from there alone (not from the checkout), it builds the outer
step's native kernels from the C sources it shipped and takes an outer step on them. It ships no test
support (that lives under tests/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent

# Run from the installed copy: the outer optimizer the shipped config builds, one step on a tensor
# whose size leaves the kernel a scalar tail, against torch.optim.SGD's bits. Prints where it ran from.
_OUTER_STEP = """
import sys, torch
import zeroband
from zeroband.comm.timing import Parts
from zeroband.config import DilocoConfig
from zeroband.outer import sgd_kernel
from zeroband.outer.optimizer import NesterovSGD, OuterHyper, build_outer_optimizer
from zeroband.outer.placement import OuterCopy

cfg = DilocoConfig()
local = [torch.randn(1003, generator=torch.Generator().manual_seed(0))]
copy = OuterCopy(local, cfg)
outer = build_outer_optimizer(copy, cfg)
ref = copy.tensors[0].clone()
torch_sgd = torch.optim.SGD([ref], lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True, fused=True)
for step in range(2):
    grad = torch.randn(1003, generator=torch.Generator().manual_seed(step + 1))
    outer.step(copy, [grad], OuterHyper(), Parts(), into_local=True)
    ref.grad = grad
    torch_sgd.step()
assert type(outer) is NesterovSGD and sgd_kernel.implementation() == "native", sgd_kernel.implementation()
assert torch.equal(copy.tensors[0], ref) and torch.equal(local[0], ref)
print(zeroband.__file__)
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, **kw)
    assert done.returncode == 0, (cmd, done.stdout[-3000:], done.stderr[-3000:])
    return done


@pytest.mark.slow  # pip builds and installs the wheel, cc builds the kernels: ~63 s wall on a loaded 2-core box, 11 s of CPU
def test_installed_wheel_runs_an_outer_step_on_the_native_kernel(tmp_path: Path) -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler: the native kernels cannot be built here (the eager path runs)")
    src = tmp_path / "src"  # a copy: building in the checkout would write build/ and *.egg-info there
    shutil.copytree(REPO / "zeroband", src / "zeroband", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(tmp_path / "dist"), str(src)])
    [wheel] = (tmp_path / "dist").glob("zeroband-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"zeroband/comm/kernels.c", "zeroband/outer/sgd.c"} <= set(names), names
    assert not [n for n in names if n.startswith(("zeroband/testing/", "tests/"))], names

    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)])
    run_dir = tmp_path / "elsewhere"  # neither the checkout nor the source copy is on the path from here
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "ZEROBAND_KERNEL_DIR": str(tmp_path / "kernels"),
           "ZEROBAND_KERNELS": "auto"}
    done = _run([sys.executable, "-c", _OUTER_STEP], cwd=run_dir, env=env)
    assert Path(done.stdout.strip().splitlines()[-1]).is_relative_to(site), done.stdout
    assert any((tmp_path / "kernels").iterdir())  # built here, from the installed sources
