"""Membership on etcd's own primitives, behind etcd's TLS and authentication (issue 35 item 3).

A real 3-member etcd cluster on loopback, started as a multi-site run uses it (tests/etcd_cluster.py
`secure=True`: client and peer TLS with client certificates, a run user whose role covers the run's
prefix only). Sites hold leases (liveness), write proposals and verdicts once by transaction and
wait by watches; nobody without the run's credentials can read, write or delete a key.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.etcd_cluster import INSTALL_HINT, RUN_PREFIX, EtcdCluster, etcd_binary, start_cluster
from tests.helpers import _train, elastic_tree, final_params, outer_records
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


def test_elastic_run_on_secure_etcd(corpus, tmp_path, secure_cluster):
    """Two sites with the run's secret, on leases, transactions and watches: every round commits
    with both sites and their replicas end identical; the run's keys are etcd's (under its prefix)."""
    tree = elastic_tree(corpus, tmp_path, secure_cluster.url(RUN_PREFIX), steps=6,
                        sites={"insecure": False, **secure_cluster.access()})
    began = time.monotonic()
    out = run_sites(_train, 2, 1, (tree,), env={"ZEROBAND_SECRET": SECRET}, timeout=90)
    took = time.monotonic() - began
    assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 6, out
    assert [r["sites_used"] for r in outer_records(tmp_path, 0)] == [2, 2, 2]
    a, b = final_params(tree, 0, 6, SECRET), final_params(tree, 1, 6, SECRET)
    assert all(a[k].equal(b[k]) for k in a)
    keys = client(secure_cluster, run_access(secure_cluster)).list_keys()
    assert any(k.endswith("/r1/a0/verdict") for k in keys), keys
    assert not any("/hb/" in k for k in keys), "a presence key outlived its site's revoked lease"
    print(f"2 sites, 3 rounds on TLS + auth etcd in {took:.1f} s")
