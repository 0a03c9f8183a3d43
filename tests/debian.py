"""Debian packages some integration tests need (etcd-server, slurm-wlm, docker.io, ...): installed
once where this machine allows it (root with apt-get), the way scripts/test.sh installs them first;
elsewhere the caller skips, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def missing(binaries: tuple[str, ...]) -> list[str]:
    return [b for b in binaries if shutil.which(b) is None and not Path("/usr/sbin", b).is_file()]


def cannot_apt() -> str | None:
    """Why apt-get cannot install packages here (None: it can)."""
    if os.environ.get("ZEROBAND_NO_APT"):
        return "ZEROBAND_NO_APT is set"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install it"
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    return None


def ensure_installed(packages: tuple[str, ...], binaries: tuple[str, ...], timeout_s: float = 600) -> str | None:
    """Install `packages` if any of `binaries` is missing (skipped when all are present). Returns
    why they cannot be had here, or None when they are installed."""
    if not missing(binaries):
        return None
    why = cannot_apt()
    if why is not None:
        return f"{' '.join(packages)} not installed ({', '.join(missing(binaries))} missing) and {why}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` did not finish in {timeout_s:.0f} s"
        if out.returncode != 0:
            last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return f"`{' '.join(cmd)}` failed (exit {out.returncode}): {last[0]}"
    return None if not missing(binaries) else f"still missing after apt-get install: {missing(binaries)}"
