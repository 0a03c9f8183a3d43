"""A save that cannot fit (ENOSPC) or cannot write (EROFS) stops the site with one line naming the
path and the bytes needed, not DCP's 60-line traceback. Real file systems: a small tmpfs, mounted
read-only for EROFS (root ignores file modes, so chmod cannot make one)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.multiproc import run_ranks
from zeroband.checkpoint import storage_problem

pytestmark = pytest.mark.timeout(30)

DISK_BYTES = 1 << 20


def test_storage_problem_names_path_bytes_and_fix():
    assert storage_problem(Path("/c"), 100, False, 100) == ""
    full = storage_problem(Path("/c"), 2_000_000, False, 1_000)
    assert "ENOSPC" in full and "/c" in full and "2,000,000" in full and "1,000 are free" in full
    ro = storage_problem(Path("/c"), 5, True, 10**9)
    assert "EROFS" in ro and "/c" in ro and "checkpoint.dir" in ro


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs at tmp_path/disk, unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


class _Big:
    """An extra whose state (the rank file, written after the DCP shards) is larger than the disk."""

    def state_dict(self) -> dict:
        return {"blob": torch.zeros(DISK_BYTES // 2, dtype=torch.float32)}

    def load_state_dict(self, state: dict) -> None:
        pass


def _saves(root: str, read_only: str) -> list[str]:
    """Three saves into the small disk: too large a model (refused before writing), a rank file
    that fills the disk while written, and one into a read-only mount: each one line."""
    from zeroband import checkpoint as ckpt
    from zeroband.mesh import init_topology, shutdown
    from zeroband.world import World

    init_topology(World(0, 1, 0, 0, 1, torch.device("cpu")), None, "disk", 30, "gloo")
    errors = []
    small = torch.nn.Linear(4, 4)
    cases = [(torch.nn.Linear(1024, 512), {}, root), (small, {"big": _Big()}, root), (small, {}, read_only)]
    try:
        for model, extras, where in cases:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            try:
                ckpt.save_checkpoint(Path(where) / "ckpt", 1, model, opt, extras, {}, keep_last=2)
            except ckpt.CheckpointError as e:
                errors.append(str(e))
            else:
                errors.append("saved")
    finally:
        shutdown()
    return errors


def test_full_and_read_only_disks_stop_the_save_with_one_line(small_disk: Path):
    read_only = small_disk.parent / "ro"
    read_only.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(small_disk), str(read_only)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(read_only)], check=True)
        (small_disk / "other").write_bytes(b"x")  # the bind is read-only, the disk itself is not
        refused, filled, ro = run_ranks(_saves, 1, (str(small_disk), str(read_only)), timeout=25)[0]
    finally:
        subprocess.run(["umount", "-l", str(read_only)], check=True)
    weights = (1024 * 512 + 512) * 4  # the model's float32 tensors; plain SGD keeps no state
    assert "ENOSPC" in refused and str(small_disk / "ckpt") in refused and "\n" not in refused, refused
    assert f"needs {weights:,} bytes" in refused, refused
    assert "ENOSPC" in filled and "step_000000001.tmp" in filled and "\n" not in filled, filled
    assert "EROFS" in ro and str(read_only / "ckpt") in ro and "\n" not in ro, ro
    assert not list((small_disk / "ckpt").glob("step_*[0-9]")), "no step may be sealed"


def test_the_launcher_names_a_ranks_error_its_full_disk_kept_out_of_the_log(small_disk: Path):
    """The site's log is on the full disk too: the launcher still names the rank's own error line
    (from the tail it keeps), not torchrun's line after it."""
    import sys

    from zeroband.tools.launch import LogTee, SupervisePolicy, Supervisor

    (small_disk / "filler").write_bytes(b"\0" * DISK_BYTES)  # tmpfs refuses the rest: ENOSPC
    error = "zeroband: error: cannot save step 4: no space left on the device of /c (ENOSPC)"
    code = f"import sys; print('Traceback (most recent call last):'); print({error!r}); sys.exit(2)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tee = LogTee(proc, small_disk / "site0.log")
    out = Supervisor([proc], small_disk, None, 5.0, SupervisePolicy(5, None, 5), tees=[tee]).run(20)
    assert list(out) == [2] and out.failure == f"site 0 failed first (exit code 2): {error}", out.failure
    assert error not in (small_disk / "site0.log").read_text(), "the disk was meant to be full"
