"""A real etcd cluster, for tests of the fault-tolerant coordination store and the chaos suite.

Members are separate `etcd` processes (Debian: `apt-get install etcd-server`) with fast raft timing
so that losing the leader costs about a second, not the default ten. Tests kill single members by
PID to show the store survives the loss of any one of them; a killed member restarts from its data
directory (`start`). Members listen on loopback ports, or (scripts/chaos.py under WAN emulation) on
one host each, started through a command prefix (`wrap`) that enters that host's network namespace.

`start_cluster(secure=True)`: etcd's own access control, as a multi-site run uses it. Fresh
certificates (zeroband/tools/etcd_access.py), client and peer TLS with `--client-cert-auth`
(nobody without a certificate from the run's CA connects), then authentication: `root`, and the
run's user `RUN_USER` whose role may read and write `RUN_PREFIX/` only (`EtcdCluster.access`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.multiproc import free_port
from zeroband.tools.etcd_access import TlsFiles, add_run_user, make_certs

RUN_PREFIX, RUN_USER = "zb-run", "run"

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
    tls: TlsFiles | None = None  # secure: certificates, client and peer TLS
    password_file: Path | None = None  # secure: the run user's password (mode 0600)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def access(self) -> dict[str, str]:
        """The `sites` settings that reach the run's prefix (secure clusters): CA, client certificate, user."""
        assert self.tls is not None and self.password_file is not None, "only a secure cluster has access settings"
        cert, key = self.tls.client
        return {"etcd_ca_file": str(self.tls.ca), "etcd_cert_file": str(cert), "etcd_key_file": str(key),
                "etcd_user": RUN_USER, "etcd_password_file": str(self.password_file)}

    @property
    def endpoints(self) -> str:
        """`h1:p1,h2:p2,...` of every member, dead or alive: clients must cope with dead ones."""
        return ",".join(m.endpoint for m in self.members)

    def url(self, prefix: str = "") -> str:
        return f"etcd://{self.endpoints}" + (f"/{prefix}" if prefix else "")

    def start(self, index: int) -> None:
        """Start member `index`, or restart it from its data directory after `kill`."""
        m = self.members[index]
        peer, client = f"{self.scheme}://{m.host}:{m.peer_port}", f"{self.scheme}://{m.host}:{m.client_port}"
        initial = ",".join(f"{o.name}={self.scheme}://{o.host}:{o.peer_port}" for o in self.members)
        cmd = m.wrap + [
            etcd_binary() or "etcd", "--name", m.name, "--data-dir", str(m.data_dir),
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--initial-cluster", initial, "--initial-cluster-token", self.root.name,
            "--initial-cluster-state", "new", "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        if self.tls is not None:
            crt, key, ca = str(self.tls.server[0]), str(self.tls.server[1]), str(self.tls.ca)
            cmd += ["--cert-file", crt, "--key-file", key, "--client-cert-auth", "--trusted-ca-file", ca,
                    "--peer-cert-file", crt, "--peer-key-file", key, "--peer-client-cert-auth",
                    "--peer-trusted-ca-file", ca, "--auth-token", self.tls.jwt_flag()]
        with open(self.root / f"{m.name}.log", "a") as log:  # the member process holds its own copy
            m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self, index: int) -> bool:
        m = self.members[index]
        if m.wrap:  # the member's host is only reachable from inside its namespace
            cmd = m.wrap + [sys.executable, "-c", _HEALTH.format(url=f"http://{m.endpoint}/health")]
            return subprocess.run(cmd, capture_output=True, text=True).stdout.strip() == "ok"
        try:
            with urllib.request.urlopen(f"{self.scheme}://{m.endpoint}/health", timeout=1.0,
                                        context=self.context()) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def context(self) -> ssl.SSLContext | None:
        """TLS with the client certificate (secure clusters), else None."""
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(*(str(p) for p in self.tls.client))
        return context

    def kill(self, index: int) -> None:
        """SIGKILL one member, the way a site's machine dies: no goodbye to the raft peers."""
        member = self.members[index]
        if member.proc is not None:
            member.proc.kill()
            member.proc.wait()

    def leader(self) -> int:
        """Index of the member that is the raft leader now."""
        for i, m in enumerate(self.members):
            if m.alive and _is_leader(m, self.scheme, self.context()):
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


def _is_leader(member: Member, scheme: str, context: ssl.SSLContext | None) -> bool:
    req = urllib.request.Request(f"{scheme}://{member.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=1.0, context=context) as r:
        status = json.loads(r.read())
    return status.get("leader") == status.get("header", {}).get("member_id")


def start_cluster(size: int = 3, timeout: float = 30.0, hosts: list[tuple[str, list[str]]] | None = None,
                  root: Path | None = None, secure: bool = False) -> EtcdCluster:
    """Start `size` members (or one per (host, wrap) of `hosts`, on etcd's own ports there) and return
    once every one reports healthy (a leader is elected). `root` (default: a temporary directory,
    removed by stop) keeps their data and logs. `secure`: TLS and authentication (module doc)."""
    if etcd_binary() is None:
        raise RuntimeError(INSTALL_HINT)
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="zb-etcd-")) if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    on = hosts or [(LOOPBACK, [])] * size
    ports = [(free_port(), free_port()) if h == LOOPBACK else (2379, 2380) for h, _ in on]
    members = [Member(f"m{i}", c, p, root / f"m{i}", h, w) for i, ((h, w), (c, p)) in enumerate(zip(on, ports))]
    cluster = EtcdCluster(members, root, own_root)
    if secure:
        cluster.tls = make_certs(root / "tls", sorted({m.host for m in members}))
    try:
        for i in range(len(members)):
            cluster.start(i)
        _wait_healthy(cluster, timeout)
        if secure:
            cluster.password_file = _secret_file(root / "run.password")
            add_run_user(f"https://{members[0].endpoint}", cluster.tls, RUN_PREFIX, RUN_USER,
                         cluster.password_file.read_text(), secrets.token_hex(16))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _secret_file(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16))
    return path


def _wait_healthy(cluster: EtcdCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(cluster.healthy(i) for i in range(len(cluster.members))):
        dead = [m.name for m in cluster.members if not m.alive]
        if dead or time.monotonic() > deadline:
            logs = "\n".join((cluster.root / f"{m.name}.log").read_text()[-2000:] for m in cluster.members)
            raise RuntimeError(f"etcd cluster not healthy (dead: {dead}) after {timeout} s:\n{logs}")
        time.sleep(0.05)
