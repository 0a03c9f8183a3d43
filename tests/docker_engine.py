"""A real Docker engine for the test of docker/Dockerfile, with no image registry at hand.

Debian's docker.io daemon (`dockerd`, started here on its own socket unless one already answers,
stopped by PID), a base image made from Debian packages (debootstrap + `docker import`), and a
wheelhouse that this machine's own pip fills (`pip download`: the same torch build as this venv and
the project's dependencies) served on a loopback port, so `docker build --network host` installs
offline through scripts/setup.sh. What is slow to make is kept between runs under
ZEROBAND_DOCKER_CACHE (default /var/cache/zeroband-docker as root): the daemon's images and layer cache,
the base image, the wheelhouse. The first run takes minutes; later ones seconds.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests import debian
from tests.multiproc import free_port

ROOT = Path(__file__).resolve().parents[1]
PACKAGES, BINARIES = ("docker.io", "debootstrap"), ("dockerd", "docker", "debootstrap")
BASE = "zeroband-base:bookworm"
BASE_PACKAGES = "python3,python3-venv,gcc,libc6-dev"  # what docker/Dockerfile would otherwise apt-get
MIRROR = os.environ.get("ZEROBAND_DEBIAN_MIRROR", "http://deb.debian.org/debian")
WHEELHOUSE_PORT = 29876  # a fixed port when free: the build args, and so the layer cache, stay the same


def cache_dir() -> Path:
    default = "/var/cache/zeroband-docker" if os.geteuid() == 0 else "~/.cache/zeroband-docker"
    path = Path(os.environ.get("ZEROBAND_DOCKER_CACHE", default)).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Engine:
    """A reachable Docker daemon (`env` points the client at it) and what a build needs."""

    env: dict[str, str]
    wheel_url: str = ""
    torch: str = ""
    daemon: subprocess.Popen | None = None
    stoppers: list = field(default_factory=list)

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(["docker", *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:2])} failed: {(out.stderr or out.stdout)[-2000:]}")
        return out

    def build(self, tag: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """docker/Dockerfile on BASE, installing offline from the wheelhouse through scripts/setup.sh."""
        args = ["build", "--network", "host", "-f", "docker/Dockerfile", "-t", tag, "--build-arg", f"BASE={BASE}",
                "--build-arg", "PIP_NO_INDEX=1", "--build-arg", f"PIP_FIND_LINKS={self.wheel_url}",
                "--build-arg", f"ZEROBAND_TORCH=torch=={self.torch}", str(ROOT)]
        return self.docker(*args, timeout=timeout)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.docker("image", "prune", "-f", check=False)  # superseded builds: keep the disk bounded
            self.daemon.terminate()
            try:
                self.daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        for stop in reversed(self.stoppers):
            stop()


def start_engine() -> tuple[Engine | None, str]:
    """(engine, "") with the base image and wheelhouse ready, or (None, why not) to skip on."""
    why = debian.ensure_installed(PACKAGES, BINARIES)
    if why is not None:
        return None, why
    engine = Engine(dict(os.environ))
    try:
        why = _daemon(engine) or _base_image(engine) or _wheelhouse(engine)
    except BaseException:
        engine.stop()
        raise
    if why:
        engine.stop()
        return None, why
    return engine, ""


def _answers(env: dict[str, str]) -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, env=env, timeout=30).returncode == 0


def _daemon(engine: Engine) -> str | None:
    """Use the daemon that answers, else start dockerd (overlay2; no iptables or bridge: the tests
    use --network host) with its images kept in the cache directory."""
    if _answers(engine.env):
        return None
    run = Path(tempfile.mkdtemp(prefix="zb-dockerd-"))  # short: the socket path has a length limit
    engine.stoppers.append(lambda: (_unmount_under(run), shutil.rmtree(run, ignore_errors=True)))
    log = open(run / "dockerd.log", "w")  # noqa: SIM115 - closed by a stopper
    engine.stoppers.append(log.close)
    cmd = ["dockerd", "--data-root", str(cache_dir() / "data"), "--exec-root", str(run / "exec"),
           "--pidfile", str(run / "pid"), "--host", f"unix://{run}/sock", "--storage-driver", "overlay2",
           "--iptables=false", "--ip-masq=false", "--bridge=none"]
    engine.daemon = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    engine.env["DOCKER_HOST"] = f"unix://{run}/sock"
    deadline = time.monotonic() + 60
    while not _answers(engine.env):
        if engine.daemon.poll() is not None or time.monotonic() > deadline:
            errors = [line for line in (run / "dockerd.log").read_text().splitlines() if "level=error" in line
                      or "failed to start" in line]
            return f"dockerd does not start here: {(errors or ['(no error line)'])[-1][-300:]}"
        time.sleep(0.3)
    return None


def _unmount_under(root: Path) -> None:
    """dockerd leaves its network namespace file mounted under its exec root when it stops."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(f"{root}/"):
            subprocess.run(["umount", point], capture_output=True)


def _base_image(engine: Engine) -> str | None:
    """BASE from Debian packages, made once (debootstrap, ~1 min) and kept by the daemon."""
    if engine.docker("image", "inspect", BASE, check=False).returncode == 0:
        return None
    with tempfile.TemporaryDirectory(prefix="zb-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        out = subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm",
                              str(rootfs), MIRROR], capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            return f"debootstrap bookworm from {MIRROR} failed: {(out.stderr or out.stdout).strip()[-300:]}"
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-", BASE], stdin=tar.stdout, capture_output=True,
                                  text=True, env=engine.env, timeout=600)
        tar.wait()
        if imported.returncode != 0:
            return f"docker import of the Debian rootfs failed: {imported.stderr.strip()[-300:]}"
    return None


def _wheelhouse(engine: Engine) -> str | None:
    """This venv's torch build and the project's dependencies as wheels (refreshed when
    pyproject.toml or torch change), served read-only on loopback for the build."""
    import torch

    engine.torch = torch.__version__
    house = cache_dir() / "wheels"
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + engine.torch.encode()).hexdigest()
    if not (house / ".stamp").is_file() or (house / ".stamp").read_text() != stamp:
        house.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(house), f"torch=={engine.torch}",
               f"{ROOT}[dev]", "pip", "setuptools", "wheel"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            return f"pip download of the image's wheels failed: {out.stderr.strip()[-300:]}"
        (house / ".stamp").write_text(stamp)
    engine.wheel_url = _serve(engine, house)
    return None


def _serve(engine: Engine, directory: Path) -> str:
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELHOUSE_PORT), handler)
    except OSError:  # taken: any port will do, at the cost of the layer cache
        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine.stoppers.append(lambda: (server.shutdown(), server.server_close()))
    return f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass
