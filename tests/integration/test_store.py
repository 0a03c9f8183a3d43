"""Coordination stores: TCPStore and EtcdStore behave alike, and etcd survives losing a member.

The etcd tests run a real 3-member cluster on loopback ports (tests/etcd_cluster.py) and are
skipped, with the install command, when the `etcd` binary or the etcd3gw client is missing.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.etcd_cluster import start_cluster
from tests.multiproc import run_sites
from tests.unit import test_store as unit_tier  # what both tiers share is defined there, once
from zeroband.store.client import open_store

_make_store_body = unit_tier._make_store_body
_need_etcd = unit_tier._need_etcd
cluster = unit_tier.cluster
# the unit tier's tests whose other parameters belong here (see the fixtures below)
test_add_and_compare_set = unit_tier.test_add_and_compare_set
test_add_is_atomic_across_clients = unit_tier.test_add_is_atomic_across_clients
test_missing_key_times_out_clearly = unit_tier.test_missing_key_times_out_clearly
test_read_many_reads_current_values_at_once_and_never_waits = unit_tier.test_read_many_reads_current_values_at_once_and_never_waits
test_set_get_check_delete = unit_tier.test_set_get_check_delete
test_wait_and_blocking_get = unit_tier.test_wait_and_blocking_get


@pytest.fixture(params=["etcd"])
def make_store(request):
    yield from _make_store_body(request)


def test_add_retried_after_lost_reply_counts_once(cluster):
    """A member commits an add and dies before replying: the retry on another member must not add
    again (the txn's receipt tells the retry that the first attempt went through)."""
    from etcd3gw.exceptions import ConnectionFailedError

    store = open_store(cluster.url(f"lost-{uuid.uuid4().hex[:8]}"), False, timedelta(seconds=10))
    assert store.add("n", 1) == 1
    client = store._net._clients[store._net._current]
    real_post = client.post

    def commit_then_drop(url: str, *args, **kwargs):
        reply = real_post(url, *args, **kwargs)
        if url.endswith("/kv/txn"):
            client.post = real_post  # only the first txn loses its reply
            raise ConnectionFailedError("reply lost")
        return reply

    client.post = commit_then_drop
    assert store.add("n", 5) == 6
    assert store.get("n") == b"6"
    assert store.add("n", 1) == 7


def _gloo_sum(address: str, prefix: str) -> list[float]:
    import os

    import torch

    site, sites = int(os.environ["ZEROBAND_SITE_RANK"]), int(os.environ["ZEROBAND_SITE_COUNT"])
    store = open_store(address, False, timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), site, sites, timedelta(seconds=30))
    x = torch.full((4,), float(site + 1))
    pg.allreduce([x]).wait()
    return x.tolist()


@pytest.mark.parametrize("sites", [2, 3])
def test_gloo_group_through_etcd(cluster, sites):
    out = run_sites(_gloo_sum, sites, 1, (cluster.url("gloo"), f"gen-{uuid.uuid4().hex[:6]}/"), timeout=60)
    expected = float(sum(range(1, sites + 1)))
    assert all(v == [expected] * 4 for v in out.values()), out


def test_store_survives_losing_an_etcd_member():
    """Kill the raft leader: reads and writes go on through the other two members, and three sites
    form a NEW gloo group under a new prefix, with the dead member first in their endpoint list."""
    _need_etcd()
    c = start_cluster(3)
    try:
        dead = c.leader()
        order = [dead] + [i for i in range(3) if i != dead]  # clients try the dead member first
        address = "etcd://" + ",".join(c.members[i].endpoint for i in order) + "/survive"
        store = open_store(address, False, timedelta(seconds=10))
        store.set("before", b"1")
        c.kill(dead)
        t0 = time.monotonic()
        store.set("after", b"2")  # fails over to a live member once a new leader is elected
        failover_s = time.monotonic() - t0
        print(f"\nfirst write after killing the etcd leader took {failover_s:.2f} s")
        assert failover_s < 10
        fresh = open_store(address, False, timedelta(seconds=10))
        assert fresh.get("before") == b"1" and fresh.get("after") == b"2"
        assert fresh.add("counter", 2) == 2
        out = run_sites(_gloo_sum, 3, 1, (address, "gen1/"), timeout=60)
        assert all(v == [6.0] * 4 for v in out.values()), out
    finally:
        c.stop()
