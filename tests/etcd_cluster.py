"""A real etcd cluster, for tests of the fault-tolerant coordination store and the chaos suite.

Members are separate `etcd` processes (Debian: `apt-get install etcd-server`) with fast raft timing
so that losing the leader costs about a second, not the default ten. Tests kill single members by
PID to show the store survives the loss of any one of them; a killed member restarts from its data
directory (`start`). Members listen on loopback ports, or (scripts/chaos.py under WAN emulation) on
one host each, started through a command prefix (`wrap`) that enters that host's network namespace.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.multiproc import free_port

INSTALL_HINT = "etcd binary not found; install it with `apt-get install etcd-server` (Debian/Ubuntu)"
LOOPBACK = "127.0.0.1"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    host: str = LOOPBACK
    wrap: list[str] = field(default_factory=list)  # runs a command on `host` (a namespace's `ip netns exec`)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    members: list[Member]
    root: Path
    own_root: bool = True  # a temporary directory of its own, removed by stop()

    @property
    def endpoints(self) -> str:
        """`h1:p1,h2:p2,...` of every member, dead or alive: clients must cope with dead ones."""
        return ",".join(m.endpoint for m in self.members)

    def url(self, prefix: str = "") -> str:
        return f"etcd://{self.endpoints}" + (f"/{prefix}" if prefix else "")

    def start(self, index: int) -> None:
        """Start member `index`, or restart it from its data directory after `kill`."""
        m = self.members[index]
        peer, client = f"http://{m.host}:{m.peer_port}", f"http://{m.host}:{m.client_port}"
        initial = ",".join(f"{o.name}=http://{o.host}:{o.peer_port}" for o in self.members)
        cmd = m.wrap + [
            etcd_binary() or "etcd", "--name", m.name, "--data-dir", str(m.data_dir),
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--initial-cluster", initial, "--initial-cluster-token", self.root.name,
            "--initial-cluster-state", "new", "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        with open(self.root / f"{m.name}.log", "a") as log:  # the member process holds its own copy
            m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self, index: int) -> bool:
        m = self.members[index]
        if m.wrap:  # the member's host is only reachable from inside its namespace
            cmd = m.wrap + [sys.executable, "-c", _HEALTH.format(url=f"http://{m.endpoint}/health")]
            return subprocess.run(cmd, capture_output=True, text=True).stdout.strip() == "ok"
        try:
            with urllib.request.urlopen(f"http://{m.endpoint}/health", timeout=1.0) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def kill(self, index: int) -> None:
        """SIGKILL one member, the way a site's machine dies: no goodbye to the raft peers."""
        member = self.members[index]
        if member.proc is not None:
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
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)


_HEALTH = ("import urllib.request as u\ntry:\n print('ok' if b'\"true\"' in u.urlopen('{url}', timeout=1).read() "
           "else 'no')\nexcept Exception:\n print('no')")


def _is_leader(member: Member) -> bool:
    req = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=1.0) as r:
        status = json.loads(r.read())
    return status.get("leader") == status.get("header", {}).get("member_id")


def start_cluster(size: int = 3, timeout: float = 30.0, hosts: list[tuple[str, list[str]]] | None = None,
                  root: Path | None = None) -> EtcdCluster:
    """Start `size` members (or one per (host, wrap) of `hosts`, on etcd's own ports there) and return
    once every one reports healthy (a leader is elected). `root` (default: a temporary directory,
    removed by stop) keeps their data and logs."""
    if etcd_binary() is None:
        raise RuntimeError(INSTALL_HINT)
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="zb-etcd-")) if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    on = hosts or [(LOOPBACK, [])] * size
    ports = [(free_port(), free_port()) if h == LOOPBACK else (2379, 2380) for h, _ in on]
    members = [Member(f"m{i}", c, p, root / f"m{i}", h, w) for i, ((h, w), (c, p)) in enumerate(zip(on, ports))]
    cluster = EtcdCluster(members, root, own_root)
    try:
        for i in range(len(members)):
            cluster.start(i)
        _wait_healthy(cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_healthy(cluster: EtcdCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(cluster.healthy(i) for i in range(len(cluster.members))):
        dead = [m.name for m in cluster.members if not m.alive]
        if dead or time.monotonic() > deadline:
            logs = "\n".join((cluster.root / f"{m.name}.log").read_text()[-2000:] for m in cluster.members)
            raise RuntimeError(f"etcd cluster not healthy (dead: {dead}) after {timeout} s:\n{logs}")
        time.sleep(0.05)
