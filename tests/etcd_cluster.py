"""A real etcd cluster on loopback ports, for tests of the fault-tolerant coordination store.

Members are separate `etcd` processes (Debian: `apt-get install etcd-server`) with fast raft timing
so that losing the leader costs about a second, not the default ten. Tests kill single members by
PID to show the store survives the loss of any one of them.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.multiproc import free_port

INSTALL_HINT = "etcd binary not found; install it with `apt-get install etcd-server` (Debian/Ubuntu)"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    members: list[Member]
    root: Path
    logs: list = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        """`h1:p1,h2:p2,...` of every member, dead or alive: clients must cope with dead ones."""
        return ",".join(m.endpoint for m in self.members)

    def url(self, prefix: str = "") -> str:
        return f"etcd://{self.endpoints}" + (f"/{prefix}" if prefix else "")

    def kill(self, index: int) -> None:
        """SIGKILL one member, the way a site's machine dies: no goodbye to the raft peers."""
        member = self.members[index]
        assert member.proc is not None
        member.proc.kill()
        member.proc.wait()

    def leader(self) -> int:
        """Index of the member that is the raft leader now."""
        for i, m in enumerate(self.members):
            if m.alive and _is_leader(m):
                return i
        raise RuntimeError("no etcd leader")

    def stop(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
                try:
                    m.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait()
        for log in self.logs:
            log.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _post(member: Member, path: str, timeout: float = 1.0) -> bytes:
    req = urllib.request.Request(f"http://{member.endpoint}{path}", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _is_leader(member: Member) -> bool:
    import json

    status = json.loads(_post(member, "/v3/maintenance/status"))
    return status.get("leader") == status.get("header", {}).get("member_id")


def _healthy(member: Member) -> bool:
    try:
        with urllib.request.urlopen(f"http://{member.endpoint}/health", timeout=1.0) as r:
            return b'"true"' in r.read()
    except OSError:
        return False


def _start(member: Member, initial_cluster: str, token: str, log) -> subprocess.Popen:
    peer, client = f"http://127.0.0.1:{member.peer_port}", f"http://127.0.0.1:{member.client_port}"
    cmd = [
        etcd_binary() or "etcd", "--name", member.name, "--data-dir", str(member.data_dir),
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--initial-cluster", initial_cluster, "--initial-cluster-token", token,
        "--initial-cluster-state", "new", "--heartbeat-interval", "50", "--election-timeout", "500",
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def start_cluster(size: int = 3, timeout: float = 30.0) -> EtcdCluster:
    """Start `size` members and return once every one reports healthy (a leader is elected)."""
    if etcd_binary() is None:
        raise RuntimeError(INSTALL_HINT)
    root = Path(tempfile.mkdtemp(prefix="zb-etcd-"))
    members = [Member(f"m{i}", free_port(), free_port(), root / f"m{i}") for i in range(size)]
    initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in members)
    cluster = EtcdCluster(members, root)
    try:
        for m in members:
            log = open(root / f"{m.name}.log", "w")  # noqa: SIM115 - closed in stop()
            cluster.logs.append(log)
            m.proc = _start(m, initial, root.name, log)
        _wait_healthy(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_healthy(cluster: EtcdCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(_healthy(m) for m in cluster.members):
        dead = [m.name for m in cluster.members if not m.alive]
        if dead or time.monotonic() > deadline:
            logs = "\n".join((cluster.root / f"{m.name}.log").read_text()[-2000:] for m in cluster.members)
            raise RuntimeError(f"etcd cluster not healthy (dead: {dead}) after {timeout} s:\n{logs}")
        time.sleep(0.05)
