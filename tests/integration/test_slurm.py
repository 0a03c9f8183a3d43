"""scripts/slurm/site.sbatch under a real SLURM (tests/slurm_cluster.py): two sites, two jobs.

Each site is one `sbatch` of the project's script on a two-node cluster started here (CPU, gloo;
each node its own loopback address), beside a coordination store started the way `zeroband launch`
starts it, with the secret in the environment. While they run, `ss -ltnp` lists every listening
socket of the jobs' processes; after, both sites must have trained to the last step with identical
replicas (the outer state's checksum after every outer step), having listened only on loopback
(one-node sites) or on their nodes' addresses (a two-node site).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w

from tests.helpers import is_loopback, listeners, site_records, tiny_overrides
from tests.slurm_cluster import NODES, SlurmCluster, ensure_installed, job_processes, start_cluster
from zeroband.tools.launch import free_port, store_process

pytestmark = pytest.mark.timeout(240)  # the cluster starts in ~5 s; each test's sites train in ~20-60 s

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Zb-slurm-secret-5c2a91e07b"
STEPS = 4


@pytest.fixture(scope="module")
def slurm() -> SlurmCluster:
    why = ensure_installed()
    if why is not None:
        pytest.skip(f"SLURM cannot run here: {why}")
    cluster = start_cluster()
    yield cluster
    cluster.stop()


def submit(slurm: SlurmCluster, config: Path, site: int, store: str, out: Path, *shape: str, **env: str) -> str:
    """sbatch the site script as a user would, choosing the site's shape on the command line (the
    #SBATCH lines ask for 2 nodes x 8 GPUs); `env` adds to the job's environment (the secret in
    ZEROBAND_SECRET unless it names a ZEROBAND_SECRET_FILE)."""
    if "ZEROBAND_SECRET_FILE" not in env:
        env["ZEROBAND_SECRET"] = SECRET
    mine = {k: v for k, v in slurm.env.items() if k not in ("ZEROBAND_SECRET", "ZEROBAND_SECRET_FILE")}
    env = {**mine, "SITE_RANK": str(site), "SITE_COUNT": "2", "ZEROBAND_STORE": store,
           "ZEROBAND_HOST_STORE": "false", "ZEROBAND_PYTHON": sys.executable,
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",  # as after `source .venv/bin/activate`:
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env}
    cmd = ["sbatch", "--parsable", *shape, "--gpus-per-node=0", "--cpus-per-task=1",
           f"--output={out}/slurm-site{site}-%j.log", f"--chdir={ROOT}", "scripts/slurm/site.sbatch", str(config)]
    return slurm.run(*cmd, env=env).strip().split(";")[0]


@dataclass
class Watched:
    """What was seen of the jobs' processes while they ran."""

    listeners: set[tuple[str, str]] = field(default_factory=set)
    commands: set[str] = field(default_factory=set)
    ps_hits: list[str] = field(default_factory=list)
    logs: str = ""  # the jobs' output files, once they ended

    def look(self, pids: set[int]) -> None:
        self.listeners |= listeners(pids)
        for pid in pids:
            try:
                self.commands.add(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        self.ps_hits += [line for line in ps.splitlines() if SECRET in line]


def wait_jobs(slurm: SlurmCluster, jobs: list[str], timeout_s: float, watched: Watched) -> dict[str, dict]:
    """Poll until every job has ended, watching their processes; returns job id -> final record."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {j: slurm.job(j) for j in jobs}
        if all(s["JobState"] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") for s in states.values()):
            return states
        if time.monotonic() > deadline:
            pytest.fail(f"jobs still running after {timeout_s:.0f} s: {states}\n{slurm.log_tail()}")
        watched.look(job_processes(set(jobs), sys.executable))
        time.sleep(0.3)


def write_config(corpus: dict, out: Path) -> Path:
    tree = tiny_overrides(corpus, out, train={"steps": STEPS})
    tree["diloco"] = {"inner_steps": 2, "log_checksum": True}
    tree["sites"] = {"timeout_s": 60}
    config = out / "run.toml"
    config.write_text(tomli_w.dumps(tree))
    return config


def run_sites(slurm: SlurmCluster, config: Path, out: Path, shapes: list[tuple[list[str], dict]]) -> Watched:
    """Submit one job per site beside a store run as `zeroband launch` runs it; check that every
    job completed and both sites logged the same outer checksums at every outer step."""
    port = free_port()
    with store_process(["127.0.0.1", port], lambda cmd: cmd) as store:
        jobs = [submit(slurm, config, site, f"tcp://127.0.0.1:{port}", out, *shape, **env)
                for site, (shape, env) in enumerate(shapes)]
        states = wait_jobs(slurm, jobs, 180, watched := Watched())
        watched.look({store.pid})
    watched.logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(out.glob("slurm-site*.log")))
    assert [(s["JobState"], s["ExitCode"]) for s in states.values()] == [("COMPLETED", "0:0")] * 2, watched.logs
    crcs = [[(r["step"], r["outer_crc"]) for r in site_records(out, s, "outer")] for s in (0, 1)]
    assert [step for step, _ in crcs[0]] == list(range(2, STEPS + 1, 2)), crcs
    assert crcs[0] == crcs[1], crcs
    # The same entry point as `zeroband launch`, never plain torchrun; the secret in no argv or log.
    agents = [c for c in watched.commands if "torchrun" in c]
    assert agents and all("-m zeroband.torchrun" in c for c in agents), agents
    assert watched.ps_hits == [] and SECRET not in watched.logs
    return watched


def test_sbatch_two_sites_train_identical_on_loopback(slurm, corpus, tmp_path):
    watched = run_sites(slurm, write_config(corpus, tmp_path), tmp_path, [(["--nodes=1"], {})] * 2)
    # Both sites' torchrun agents (rendezvous + worker stores) and ranks (gloo) were seen, all on loopback.
    seen = watched.listeners
    assert len(seen) >= 5 and "pt_elastic" in {name for _, name in seen}, seen
    assert [s for s in seen if not is_loopback(s[0])] == [], seen
    assert all("--standalone --local-addr 127.0.0.1" in c for c in watched.commands if "torchrun" in c)


def test_sbatch_sites_of_different_shapes_bind_their_node_addresses(slurm, corpus, tmp_path):
    """Site 0 on 2 nodes x 1 rank, site 1 on 1 node x 2 ranks: each site picks its own shape.
    Site 0's rendezvous store listens on its head node's address (SLURM's NodeAddr of the first
    node), never on every interface; nothing listens anywhere but those addresses and loopback."""
    rdzv, secret = free_port(), tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)  # site 0 reads the secret from a file, site 1 from its environment
    shapes = [(["--nodes=2"], {"ZEROBAND_RDZV_PORT": str(rdzv), "ZEROBAND_SECRET_FILE": str(secret)}),
              (["--nodes=1"], {"ZEROBAND_CPU_RANKS": "2"})]
    watched = run_sites(slurm, write_config(corpus, tmp_path), tmp_path, shapes)
    head = next(iter(NODES.values()))
    seen = {address for address, _ in watched.listeners}
    assert f"{head}:{rdzv}" in seen, seen
    assert {a.rsplit(":", 1)[0] for a in seen} <= {"127.0.0.1", *NODES.values()}, seen
    assert any(f"--local-addr {addr}" in c for c in watched.commands for addr in NODES.values()), watched.commands
