"""A real SLURM cluster on loopback, for the test of scripts/slurm/site.sbatch.

Debian's slurm-wlm (slurmctld + one slurmd per node) and munge, each started here as its own
foreground process with every file (munge key and socket, slurm.conf, state and spool directories,
logs) in one temp directory, so nothing of the machine's own configuration is read or changed. The
plugins are the ones that need no cgroup or systemd (proctrack/linuxproc, task/none), so it runs in
containers and VMs too. Two nodes share this machine, each slurmd on its own port, each node with
its own loopback address (NODE_ADDRS), so a multi-node job's binding can be told apart; each node
declares the machine's real CPUs and memory. Daemons are stopped by PID.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests import debian
from tests.multiproc import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
PACKAGES = ("slurm-wlm", "munge")


def ensure_installed() -> str | None:
    """None once slurm-wlm + munge are installed (apt-get, once), else why SLURM cannot run here."""
    return debian.ensure_installed(PACKAGES, BINARIES)


NODES = {"zb1": "127.0.0.2", "zb2": "127.0.0.3"}  # node name -> its address (NodeAddr)


def hardware() -> str:
    """This machine's real CPUs, sockets and memory as slurm.conf node fields (`slurmd -C`)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True, timeout=30).stdout
    found = re.search(r"^NodeName=\S+ (.*)$", out, re.M)
    assert found is not None, out
    return re.sub(r" ?UpTime=\S+", "", found.group(1)).strip()


def slurm_conf(root: Path, host: str, ctld_port: int) -> str:
    specs = hardware()
    nodes = [f"NodeName={name} NodeHostname={host} NodeAddr={addr} Port={free_port()} {specs} State=UNKNOWN"
             for name, addr in NODES.items()]
    return "\n".join([
        "ClusterName=zbtest", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={root}/munge/socket",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        # No cgroup, no systemd: processes are tracked by their parent links in /proc.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "ReturnToService=2",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "MinJobAge=600",  # finished jobs stay visible to `scontrol show job` while the test reads them
        *nodes,
        # FORCE:2: two sites fit together even on a one-CPU machine (they must run at once).
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2",
        "",
    ])


@dataclass
class SlurmCluster:
    root: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: list = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, ...) needs to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def run(self, *cmd: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env or self.env, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value (JobState, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """Cancel what is left of the jobs, then stop the daemons by PID (slurmd first)."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--partition", "debug"], env=self.env, capture_output=True)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and _jobs_left(self):
                time.sleep(0.3)
        for name in (*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in self.logs:
            log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _jobs_left(cluster: SlurmCluster) -> bool:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=cluster.env)
    return out.returncode == 0 and bool(out.stdout.strip())


def start_cluster(timeout: float = 30.0) -> SlurmCluster:
    """munged, slurmctld and a slurmd per node on loopback; returns once every node is idle."""
    root = Path(tempfile.mkdtemp(prefix="zb-slurm-"))
    root.chmod(0o755)  # munged wants its socket's directories searchable by every user
    cluster = SlurmCluster(root)
    try:
        for sub in ("munge", "state", *(f"spool-{n}" for n in NODES)):
            (root / sub).mkdir(mode=0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        host = socket.gethostname().split(".")[0]  # slurmctld/slurmd only run where the config names them
        (root / "slurm.conf").write_text(slurm_conf(root, host, free_port()))
        _spawn(cluster, "munged", ["munged", "--foreground", "--force", f"--socket={root}/munge/socket",
                                   f"--key-file={key}", f"--pid-file={root}/munge/pid",
                                   f"--seed-file={root}/munge/seed", f"--log-file={root}/munged.log"])
        _wait(lambda: (root / "munge" / "socket").exists(), cluster, "munged", timeout)
        _spawn(cluster, "slurmctld", ["slurmctld", "-D", "-i"])  # -i: ignore (no) saved state
        for node in NODES:
            _spawn(cluster, f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        _wait(lambda: _node_state(cluster) == "idle", cluster, "every node to be idle", timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _spawn(cluster: SlurmCluster, name: str, cmd: list[str]) -> None:
    log = open(cluster.root / f"{name}.out.log", "w")  # noqa: SIM115 - closed in stop()
    cluster.logs.append(log)
    cluster.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cluster.env)


def _node_state(cluster: SlurmCluster) -> str:
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=cluster.env)
    return " ".join(sorted(set(out.stdout.split()))) if out.returncode == 0 else ""


def _wait(ready, cluster: SlurmCluster, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"SLURM: waiting for {what}, dead: {dead}, after {timeout} s:\n{cluster.log_tail()}")
        time.sleep(0.2)


def job_processes(job_ids: set[str], program: str) -> set[int]:
    """PIDs of the processes of `job_ids` (by SLURM_JOB_ID) that run `program` (argv[0]): the
    sites' torchrun agents and ranks, not SLURM's own srun and slurmstepd, whose listeners are
    SLURM's business."""
    wanted = {f"SLURM_JOB_ID={j}".encode() for j in job_ids}
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0] != program.encode():
                continue
            if wanted & set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")):
                found.add(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found
