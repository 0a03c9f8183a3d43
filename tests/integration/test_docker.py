"""docker/Dockerfile built for real and run as two sites (tests/docker_engine.py).

The image is built from a Debian base made here, installing through scripts/setup.sh from a
loopback wheelhouse; then two containers (--network host, as the Dockerfile's run line says) run
the image's entry point as sites 0 and 1 beside a coordination store started the way `zeroband
launch` starts it, with the secret in a 0600 file mounted read-only. Both must train to the last
step with identical replicas, their processes listening only on loopback.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import tomli_w

from tests.docker_engine import Engine, start_engine
from tests.helpers import is_loopback, listeners, site_records, tiny_overrides
from zeroband.tools.launch import descendants, free_port, store_process

SECRET = "Zb-docker-secret-0d6e3b8a41"
STEPS = 4
IMAGE = "zeroband:test"


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine, why = start_engine()
    if engine is None:
        pytest.skip(f"no container engine here: {why}")
    yield engine
    engine.stop()


def site_args(engine: Engine, site: int, config: Path, mounts: list[Path], secret: Path, store: str) -> list[str]:
    """`docker run` of one site: the image's entry point, every store on 127.0.0.1."""
    volumes = [x for m in mounts for x in ("-v", f"{m}:{m}")]
    return ["run", "-d", "--network", "host", "--name", f"zb-site{site}-{uuid.uuid4().hex[:6]}", *volumes,
            "-v", f"{secret}:/run/secrets/zeroband:ro", "-e", f"ZEROBAND_SITE_RANK={site}",
            "-e", "ZEROBAND_SITE_COUNT=2", "-e", "GLOO_SOCKET_IFNAME=lo", "-e", "OMP_NUM_THREADS=1", IMAGE,
            "--standalone", "--local-addr", "127.0.0.1", "--nproc-per-node", "1", "-m", "zeroband.train",
            str(config), "--sites.store", store, "--sites.host_store", "false", "--train.device", "cpu",
            "--sites.secret_file", "/run/secrets/zeroband"]


def watch(engine: Engine, containers: list[str], timeout_s: float) -> tuple[list[int], set, set[str]]:
    """Wait for the containers to exit; returns (exit codes, listeners seen, command lines seen)."""
    deadline, seen, commands = time.monotonic() + timeout_s, set(), set()
    while True:
        states = [json.loads(engine.docker("inspect", "-f", "{{json .State}}", c).stdout) for c in containers]
        if not any(s["Running"] for s in states):
            return [s["ExitCode"] for s in states], seen, commands
        if time.monotonic() > deadline:
            pytest.fail(f"containers still running after {timeout_s:.0f} s")
        pids = set().union(*({s["Pid"], *descendants(s["Pid"])} for s in states if s["Running"] and s["Pid"]))
        seen |= listeners(pids)
        for pid in pids:
            try:
                commands.add(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
        time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first build makes the base image and the deps layer (minutes); then ~20 s
def test_image_builds_and_two_sites_train_identical_on_loopback(engine, corpus, tmp_path):
    engine.build(IMAGE)
    tree = tiny_overrides(corpus, tmp_path, train={"steps": STEPS})
    tree["diloco"] = {"inner_steps": 2, "log_checksum": True}
    tree["sites"] = {"timeout_s": 60}
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tree))
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    mounts = [tmp_path, Path(corpus["path"]).parent]
    port, containers = free_port(), []
    try:
        with store_process(["127.0.0.1", port], lambda cmd: cmd):
            for site in (0, 1):
                args = site_args(engine, site, config, mounts, secret, f"tcp://127.0.0.1:{port}")
                containers.append(engine.docker(*args).stdout.strip())
            codes, seen, commands = watch(engine, containers, 120)
        logs = "\n".join(engine.docker("logs", c, check=False).stdout[-3000:] for c in containers)
    finally:
        for c in containers:
            engine.docker("rm", "-f", c, check=False)
    assert codes == [0, 0], logs
    crcs = [[(r["step"], r["outer_crc"]) for r in site_records(tmp_path, s, "outer")] for s in (0, 1)]
    assert [step for step, _ in crcs[0]] == list(range(2, STEPS + 1, 2)), crcs
    assert crcs[0] == crcs[1], crcs
    assert len(seen) >= 4 and "pt_elastic" in {name for _, name in seen}, seen
    assert [s for s in seen if not is_loopback(s[0])] == [], seen
    agents = [c for c in commands if "torchrun" in c]
    assert agents and all(c.startswith("python -m zeroband.torchrun --standalone") for c in agents), agents
    assert SECRET not in logs and not any(SECRET in c for c in commands)
