"""Membership on etcd's own primitives, behind etcd's TLS and authentication (issue 35 item 3).

A real 3-member etcd cluster on loopback, started as a multi-site run uses it (tests/etcd_cluster.py
`secure=True`: client and peer TLS with client certificates, a run user whose role covers the run's
prefix only). Sites hold leases (liveness), write proposals and verdicts once by transaction and
wait by watches; nobody without the run's credentials can read, write or delete a key.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.etcd_cluster import INSTALL_HINT, RUN_PREFIX, EtcdCluster, etcd_binary, start_cluster
from tests.helpers import _train, elastic_tree, final_params
from tests.multiproc import run_sites
from zeroband.store.etcd import EtcdAccess, EtcdStore, StoreRefused, StoreUnavailable, parse_endpoints

SECRET = "etcd-secure-test-secret"


@pytest.fixture
def secure_cluster():
    if etcd_binary() is None:
        pytest.skip(INSTALL_HINT)
    pytest.importorskip("etcd3gw", reason="etcd client missing: pip install etcd3gw")
    cluster = start_cluster(3, secure=True)
    try:
        yield cluster
    finally:
        cluster.stop()


def run_access(cluster: EtcdCluster, **change: str | None) -> EtcdAccess:
    a = cluster.access()
    fields = {"ca_file": a["etcd_ca_file"], "cert_file": a["etcd_cert_file"], "key_file": a["etcd_key_file"],
              "user": a["etcd_user"], "password": Path(a["etcd_password_file"]).read_text()}
    return EtcdAccess(**{**fields, **change})  # type: ignore[arg-type]


def client(cluster: EtcdCluster, access: EtcdAccess | None, prefix: str = RUN_PREFIX) -> EtcdStore:
    return EtcdStore(parse_endpoints(cluster.endpoints), prefix, timedelta(seconds=2), retry_s=0.5, access=access)


def test_without_the_runs_credentials_nobody_reads_or_writes(secure_cluster):
    """No client certificate (TLS refuses the connection), plain HTTP, a wrong password, no user,
    or the right user on another prefix: every read, write and delete fails, and the run's key holds.
    (etcd 3.4 grants a lease to any client that holds a certificate: a lease alone touches no key.)"""
    run = client(secure_cluster, run_access(secure_cluster))
    run.set("zeroband/r/elastic/hb/0", "mine")
    outsiders = {
        "no client certificate": client(secure_cluster, run_access(secure_cluster, cert_file=None, key_file=None)),
        "no TLS": client(secure_cluster, None),
        "wrong password": client(secure_cluster, run_access(secure_cluster, password="guess")),
        "no user": client(secure_cluster, run_access(secure_cluster, user=None, password=None)),
        "another prefix": client(secure_cluster, run_access(secure_cluster), prefix="other"),
    }
    key = "zeroband/r/elastic/hb/0"
    for name, outsider in outsiders.items():
        for what, op in (("read", outsider.read_many), ("write", outsider.set), ("delete", outsider.delete_key)):
            args = ([key],) if what == "read" else (key, "forged") if what == "write" else (key,)
            with pytest.raises((StoreRefused, StoreUnavailable)):
                op(*args)  # type: ignore[operator]
                pytest.fail(f"{name}: {what} succeeded")
    assert run.get("zeroband/r/elastic/hb/0") == b"mine"

CHAOS_SITES, CHAOS_STEPS = 3, 40
# site 2's first incarnation is SIGKILLed at step 10 and site 1 leaves (SIGTERM) at step 12; each
# slot comes back at once (two joins). Site 0 holds the run meanwhile; min_sites = 2 keeps it from
# racing to the end alone before they are back.
CHAOS_FAULTS = "site2:step10:inner:kill,site1:step12:inner:term"
# Members 0, 1, 2, 0, 1 are killed when site 0 (never faulted) reaches these inner steps, each down
# ETCD_DOWN_S and back in the raft before the next: paced by the run, not the clock, so a fast run
# cannot end before its faults (it did, at 19 s, when they were set in seconds).
ETCD_RESTARTS_AT_STEP = (4, 9, 16, 23, 30)
ETCD_DOWN_S = 1.0


def _chaos_site(tree: dict) -> dict:
    """One site slot through its faults: site 2's first incarnation runs in a child process that the
    armed fault SIGKILLs; site 1's leaves on SIGTERM. Each slot then trains again, unarmed: a join."""
    import os
    import signal

    from tests.faults import uninstall

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    ends = []
    if site == 2:
        pid = os.fork()
        if pid == 0:
            try:
                _train(tree)
            finally:
                os._exit(1)  # only if the planned kill never came
        _, status = os.waitpid(pid, 0)
        ends.append("killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else f"exit {status}")
    elif site == 1:
        first = _train(tree)
        ends.append(f"left at step {first['steps']}")
    uninstall()
    return {**_train(tree), "ends": ends}


def member_restarts(cluster: EtcdCluster, progress: Path, stop: threading.Event, log: list[str]) -> None:
    """Kill and restart etcd members as the run reaches ETCD_RESTARTS_AT_STEP (a thread of the test);
    `progress` is the metrics file of the site that no fault touches."""
    from tests import chaos

    began = time.monotonic()
    for i, at in enumerate(ETCD_RESTARTS_AT_STEP):
        while chaos.last_step(progress) < at:
            if stop.wait(0.05):
                return
        member, step = i % len(cluster.members), chaos.last_step(progress)
        cluster.kill(member)
        stop.wait(ETCD_DOWN_S)
        cluster.start(member)
        log.append(f"{time.monotonic() - began:.0f}s etcd member {member} killed at step {step} and restarted")
        while not stop.is_set() and not cluster.healthy(member):
            time.sleep(0.05)


@pytest.mark.slow
def test_chaos_on_secure_etcd(corpus, tmp_path, secure_cluster):
    """Three sites with the run's secret on a TLS + auth etcd: a site SIGKILLed and one leaving
    (SIGTERM) mid-run, each slot back at once (two joins), and etcd members killed and restarted
    five times (9 faults). No hang (every site ends within the bound), no diverged replica (every
    outer step's keyed digest alike on every site that logged it; the final parameters identical),
    no lost checkpoint (every one verifies; every site holds the final step)."""
    from tests import chaos

    tree = elastic_tree(corpus, tmp_path, secure_cluster.url(RUN_PREFIX), steps=CHAOS_STEPS, min_sites=2,
                        dead_after_s=3.0, log_checksum=True, sites={"insecure": False, **secure_cluster.access()})
    tree["checkpoint"] = {"interval": 10, "keep_last": 10}
    stop, log = threading.Event(), []
    progress = tmp_path / "t" / "site0" / "metrics.jsonl"
    restarts = threading.Thread(target=member_restarts, args=(secure_cluster, progress, stop, log), daemon=True)
    began = time.monotonic()
    restarts.start()
    try:
        out = run_sites(_chaos_site, CHAOS_SITES, 1, (tree,), env={"ZEROBAND_SECRET": SECRET}, faults=CHAOS_FAULTS,
                        timeout=100)
    finally:
        stop.set()
        restarts.join()
    took = time.monotonic() - began
    ends = [e for s in range(CHAOS_SITES) for e in out[(s, 0)]["ends"]]
    print(f"chaos on TLS + auth etcd in {took:.0f} s: sites {ends}; " + "; ".join(log))
    assert ends == ["left at step 12", "killed"], ends
    assert len(log) == len(ETCD_RESTARTS_AT_STEP), log  # each member lost and back, during the run
    assert all(out[(s, 0)]["steps"] == CHAOS_STEPS for s in range(CHAOS_SITES)), out
    metrics = [tmp_path / "t" / f"site{i}" / "metrics.jsonl" for i in range(CHAOS_SITES)]
    rejoined = {s for d in chaos.read_decisions(metrics) if d.round >= 5 for s in d.fresh}  # the kill: step 10
    assert rejoined == {1, 2}, f"joins after the faults: {rejoined}"
    table = chaos.crc_table({i: chaos.outer_records(m) for i, m in enumerate(metrics)})
    assert chaos.crc_mismatches(table) == [], "diverged replicas"
    ref = final_params(tree, 0, CHAOS_STEPS, SECRET)
    for s in range(1, CHAOS_SITES):
        got = final_params(tree, s, CHAOS_STEPS, SECRET)
        assert all(ref[k].equal(got[k]) for k in ref), f"site {s} differs at the end"
    count, errors = chaos.verify_all_checkpoints(tmp_path / "t" / "checkpoints")
    assert count and not errors, errors
    keys = client(secure_cluster, run_access(secure_cluster)).list_keys()  # the protocol's, under the run's prefix
    assert any(re.search(rf"/r{CHAOS_STEPS // 2}/a\d+/verdict$", k) for k in keys), keys  # the last round's
    assert not any("/hb/" in k for k in keys), "a presence key outlived its site (a lease not revoked at exit)"
