"""What a default `zeroband launch` exposes: only loopback listeners, and its secret nowhere.

One real launch (2 sites x 1 rank, a secret from a 0600 file, signed checkpoints) is watched while
it runs: `ss -ltnp` for every listening socket of its process tree, `ps -eo args` for the secret.
Afterwards every file of the run directory and the captured output are searched for the secret.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import tomli_w

from tests.helpers import is_loopback, listeners, tiny_overrides
from tests.unit import test_exposure as unit_tier  # what both tiers share is defined there, once
from zeroband.tools.launch import descendants

SECRET = unit_tier.SECRET


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_default_launch_listens_on_loopback_and_never_shows_its_secret(corpus, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    tree = tiny_overrides(corpus, tmp_path / "out", train={"steps": 6}, checkpoint={"interval": 3})
    tree["diloco"] = {"inner_steps": 3}
    tree["sites"] = {"timeout_s": 120, "secret_file": str(secret_file)}
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tree))
    cmd = [sys.executable, "-m", "zeroband", "launch", str(config), "--sites", "2", "--nproc", "1", "--timeout", "100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[tuple[str, str]] = set()
    ps_hits: list[str] = []
    while proc.poll() is None:
        seen |= listeners({proc.pid, *descendants(proc.pid)})
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        ps_hits += [line for line in ps.splitlines() if SECRET in line]
        time.sleep(0.3)
    output = proc.stdout.read()
    assert proc.returncode == 0, output[-3000:]
    # The store, both torchrun agents' stores and the ranks' gloo listeners were all seen.
    assert len(seen) >= 5 and {name for _, name in seen} >= {"python", "pt_elastic"}, seen
    assert [s for s in seen if not is_loopback(s[0])] == [], seen
    assert ps_hits == []
    assert SECRET not in output
    run_files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in run_files) and any(p.name == "site0.log" for p in run_files)
    assert [str(p) for p in run_files if SECRET.encode() in p.read_bytes()] == []
    assert '"signature"' in next(p for p in run_files if p.name == "manifest.json").read_text()


def test_secret_on_the_command_line_is_refused_without_echo(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zeroband", "launch", "configs/demo.toml", "--sites.secret", SECRET],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "visible to every user in `ps`" in out.stderr and "Traceback" not in out.stderr
    assert SECRET not in out.stdout + out.stderr


def test_bound_store_listens_only_on_its_host():
    from datetime import timedelta

    import torch.distributed as dist

    from zeroband.store.client import BoundTCPStore

    server = BoundTCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert server.get("k") == b"v"
    mine = {addr for addr, _ in listeners({os.getpid()})}
    assert f"127.0.0.1:{server.port}" in mine, mine  # c10d's own server would show `*:port`
    assert not any(a.endswith(f":{server.port}") and not is_loopback(a) for a in mine), mine
