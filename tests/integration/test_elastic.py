"""Sites die, hang, join and leave; training goes on. Real forked processes, real gloo, real store.

The store is hosted by the pytest process (or a real etcd cluster), never by a site, so killing
any site leaves the rest able to regroup.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch

from tests.helpers import _args, _main, _train, elastic_tree, final_params, outer_records, site_records
from tests.multiproc import Died, free_port, run_sites
from zeroband.store.client import open_store
from zeroband.tools.launch import store_process

SECRET = "correct horse battery staple"



def assert_identical(tree: dict, sites: list[int], step: int, secret: str | None = None) -> None:
    ref = final_params(tree, sites[0], step, secret)
    for s in sites[1:]:
        got = final_params(tree, s, step, secret)
        assert all(torch.equal(ref[k], got[k]) for k in ref), f"site {s} differs from site {sites[0]} at step {step}"


def test_kill_during_inner_steps(corpus, tmp_path, store_address):
    tree = elastic_tree(corpus, tmp_path, store_address)
    out = run_sites(_train, 3, 1, (tree,), faults="site2:step5:inner:kill", allow_death=True,
                    timeout=120)
    assert isinstance(out[(2, 0)], Died) and out[(2, 0)].exitcode == -9
    assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 10
    used = [r["sites_used"] for r in outer_records(tmp_path, 0)]
    assert used[:2] == [3, 3] and used[-1] == 2, used
    assert_identical(tree, [0, 1], 10)


def test_kill_during_all_reduce_retries_without_partial_result(corpus, tmp_path, store_address):
    tree = elastic_tree(corpus, tmp_path, store_address, comm_dtype="fp32")
    out = run_sites(_train, 3, 1, (tree,), faults="site1:step6:allreduce:kill", allow_death=True,
                    timeout=120)
    assert isinstance(out[(1, 0)], Died)
    records = outer_records(tmp_path, 0)
    by_step = {r["step"]: r for r in records}
    assert by_step[6]["sites_used"] == 2 and by_step[4]["sites_used"] == 3  # step 6 retried among survivors
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10]  # every round committed exactly once
    assert_identical(tree, [0, 2], 10)


def test_a_member_stuck_in_an_aborted_exchange_hears_the_abort_and_retries_with_the_rest(corpus, tmp_path,
                                                                                        store_address):
    """Site 0's all-reduce fails and it votes fail; site 1 is stuck in its exchange (as behind a peer
    that stopped sending), alive, until sites.timeout_s. It must read the abort from the store and
    arrive at the retry within site 0's grace window, not be left out of a round it was ready for."""
    tree = elastic_tree(corpus, tmp_path, store_address, comm_dtype="fp32")
    out = run_sites(_train, 2, 1, (tree,), faults="site0:step4:allreduce:raise,site1:step4:allreduce:hang",
                    timeout=120)
    assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 10
    by_step = {r["step"]: r for r in outer_records(tmp_path, 0)}
    assert by_step[4]["sites_used"] == 2, by_step[4]  # the retry had both sites
    round2 = [e["event"] for e in site_records(tmp_path, 1, "membership") if e["round"] == 2]
    assert round2 == ["decision", "aborted", "decision", "commit"], round2
    assert_identical(tree, [0, 1], 10)


def _late_train(tree: dict, delay_site: int, after_round: int) -> dict:
    """Site `delay_site` starts only once the others have committed `after_round` rounds."""
    import os

    if int(os.environ["ZEROBAND_SITE_RANK"]) == delay_site:
        store = open_store(tree["sites"]["store"], False, timedelta(seconds=60))
        while store.add(f"zeroband/{tree['name']}/elastic/committed", 0) - 1 < after_round:
            time.sleep(0.1)
    return _train(tree)


@pytest.mark.parametrize("fragments", [1, 2])
def test_join_mid_run_receives_state(corpus, tmp_path, store_address, fragments):
    """fragments = 2 (zeroband/outer/fragments.py): a round per step, each one fragment's; the joiner
    takes the round it arrives at with that fragment, and every fragment's state."""
    tree = elastic_tree(corpus, tmp_path, store_address, steps=40, start_grace_s=1.0, fragments=fragments)
    out = run_sites(_late_train, 3, 1, (tree, 2, 2), timeout=150)
    joiner, member = out[(2, 0)], out[(0, 0)]
    assert joiner["steps"] == member["steps"] == 40
    assert len(joiner["losses"]) < len(member["losses"])  # it joined mid-run and took the counters over
    assert_identical(tree, [0, 1, 2], 40)
    used = [r["sites_used"] for r in outer_records(tmp_path, 0)]
    assert used[0] < 3 and used[-1] == 3, used  # (under load site 1 may itself join one round late)


def test_graceful_leave_does_not_wait_for_timeout(corpus, tmp_path, store_address):
    tree = elastic_tree(corpus, tmp_path, store_address, dead_after_s=20.0)
    out = run_sites(_train, 3, 1, (tree,), faults="site2:step5:inner:term", timeout=120)
    assert out[(2, 0)]["steps"] == 5  # it stopped, wrote its checkpoint and returned normally
    assert (tmp_path / "t" / "checkpoints" / "site2" / "step_000000005" / "manifest.json").is_file()
    records = outer_records(tmp_path, 0)
    assert records[-1]["sites_used"] == 2
    assert max(r["outer_step_s"] for r in records) < 10, "survivors waited for a heartbeat timeout"
    assert_identical(tree, [0, 1], 10)


def test_nan_pseudo_gradient_excluded(corpus, tmp_path, store_address):
    tree = elastic_tree(corpus, tmp_path, store_address, steps=6)
    out = run_sites(_train, 3, 1, (tree,), faults="site1:step4:allreduce:nan", timeout=120)
    by_step = {r["step"]: r for r in outer_records(tmp_path, 0)}
    assert by_step[4]["excluded_sites"] == [1] and by_step[4]["sites_used"] == 2
    assert by_step[2]["excluded_sites"] == [] and by_step[6]["excluded_sites"] == []
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in out.values())
    assert_identical(tree, [0, 1, 2], 6)


def test_outer_lr_follows_the_inner_schedule(corpus, tmp_path, store_address):
    """diloco.outer_lr_schedule = "inner" acts in elastic runs too (it was silently ignored)."""
    from zeroband.config import validate_config
    from zeroband.optim import lr_factor

    tree = elastic_tree(corpus, tmp_path, store_address, steps=6, outer_lr_schedule="inner")
    run_sites(_train, 2, 1, (tree,), timeout=120)
    optim = validate_config(tree).optim
    for site in (0, 1):
        lrs = {r["step"]: r["outer_lr"] for r in outer_records(tmp_path, site)}
        assert lrs == {s: 0.7 * lr_factor(s - 1, 6, optim) for s in (2, 4, 6)}, (site, lrs)
    assert lrs[6] < lrs[2]
    assert_identical(tree, [0, 1], 6)


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["secret", "model"])
def test_foreign_peer_refused(corpus, tmp_path, store_address, wrong):
    """A site with another secret or another model is refused; the honest sites train on. With the
    secret, honest site 1 is late (issue 23): it beats from the start but arrives only once site 0
    has decided round 0 alone, seeing no beat but site 2's fail its key. Site 0 used to take itself
    for the foreign one ("site 0 (this site) refused"); one failing slot of two is no majority, so
    it trains on, site 1 joins at round 1, and site 2, seeing both others fail, stops."""
    tree = elastic_tree(corpus, tmp_path, store_address, steps=4, start_grace_s=3.0 if wrong == "secret" else 15.0)
    site_env = {s: {"ZEROBAND_SECRET": SECRET} for s in range(3)}
    args = {0: (tree,), 1: (tree,), 2: (tree,)}
    if wrong == "secret":
        site_env[2] = {"ZEROBAND_SECRET": "not the secret at all, sorry"}
        foreign = json.loads(json.dumps(tree))
        foreign["diloco"]["start_grace_s"] = 6.0  # decides after site 0 did, seeing both honest beats
        args[2] = (foreign,)
    if wrong == "model":
        foreign = json.loads(json.dumps(tree))
        foreign["model"]["n_layers"] = 3
        args[2] = (foreign,)
    with pytest.raises(AssertionError) as e:
        run_sites(_by_site, 3, 1, (args, wrong == "secret"), site_env=site_env, timeout=120)
    message = str(e.value)
    assert "site 2 rank 0: PeerRefused" in message and "site 0 rank 0" not in message and "site 1" not in message
    assert ("wrong or missing shared secret" if wrong == "secret" else "n_layers") in message
    assert_identical(tree, [0, 1], 4, SECRET)
    if wrong == "secret":  # the case of issue 23 did happen: round 0 alone, then site 1 joined
        decided = [r["members"] for r in site_records(tmp_path, 0, "membership") if r["event"] == "decision"]
        assert decided[0] == [0] and decided[1] == [0, 1], decided


def _by_site(args: dict, site_1_late: bool = False) -> dict:
    import os

    from zeroband import seams

    site = int(os.environ["ZEROBAND_SITE_RANK"])
    if site_1_late and site < 2:
        seams.use(seams.Seams(outer=lambda outer, model: _LatePeer(outer, site)))
    return _train(*args[site])


class _LatePeer:
    """Site 1 (its heartbeat already beating) starts its rounds only once site 0 has decided round
    0, so site 0 decides it alone; site 0 holds its first boundary until site 1 arrived there, so
    site 1 joins the run rather than racing site 0's inner steps. Bounded: on a failure, move on."""

    def __init__(self, inner, site: int) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "site", site)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.inner, name, value)

    def _until(self, key: str) -> None:
        m, deadline = self.inner.membership, time.monotonic() + 60
        while m.signed.read(m.prefix + key) is None and time.monotonic() < deadline:  # verified: site 2 writes too
            time.sleep(0.02)

    def start(self, resumed: bool = False) -> None:
        if self.site == 1:
            self._until("r0/a0/members")
        self.inner.start(resumed)

    def after_inner_step(self, step: int, sync_point: bool = False):
        if self.site == 0 and step == 2:
            self._until("r1/a0/arrive/1")
        return self.inner.after_inner_step(step, sync_point)


def test_etcd_member_loss(corpus, tmp_path):
    from tests.etcd_cluster import INSTALL_HINT, etcd_binary, start_cluster

    if etcd_binary() is None:
        pytest.skip(INSTALL_HINT)
    cluster = start_cluster(3)
    try:
        # dead_after_s well above etcd's ~1 s leader failover: a store hiccup is not a site death
        tree = elastic_tree(corpus, tmp_path, cluster.url("elastic-test"), steps=12, dead_after_s=8.0, heartbeat_s=0.5)
        killer = threading.Timer(6.0, lambda: cluster.kill(cluster.leader()))
        killer.start()
        out = run_sites(_train, 2, 1, (tree,), timeout=150)
        killer.join()
        assert sum(m.alive for m in cluster.members) == 2
        assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 12
        assert [r["sites_used"] for r in outer_records(tmp_path, 0)] == [2] * 6
        assert_identical(tree, [0, 1], 12)
    finally:
        cluster.stop()


def test_time_budget_rounds_weight_by_tokens(corpus, tmp_path, store_address):
    """round_seconds: a slow site (4x the batch) runs fewer inner steps per round; nobody idles."""
    tree = elastic_tree(corpus, tmp_path, store_address, steps=6, round_seconds=1.5, log_checksum=True)
    slow = json.loads(json.dumps(tree))
    slow["train"]["global_batch"] = 16
    out = run_sites(_by_site, 2, 1, ({0: (tree,), 1: (slow,)},), timeout=120)
    fast_steps, slow_steps = out[(0, 0)]["steps"], out[(1, 0)]["steps"]
    assert fast_steps > slow_steps >= 3, (fast_steps, slow_steps)
    crcs = [[r["outer_crc"] for r in outer_records(tmp_path, s)] for s in (0, 1)]
    assert len(crcs[0]) == 3 and crcs[0] == crcs[1]  # 6 // 2 rounds, identical outer state after each


def _leave_then_return(tree: dict) -> dict:
    import os

    from tests.faults import uninstall

    first = _train(tree)
    if int(os.environ["ZEROBAND_SITE_RANK"]) != 2:
        return first
    assert first["steps"] == 5  # left on SIGTERM ...
    uninstall()  # the same slot comes back without the fault
    return _train(tree)  # ... and came back in the same slot


@pytest.mark.parametrize("fragments", [1, 2])
def test_site_that_left_can_rejoin(corpus, tmp_path, store_address, fragments):
    tree = elastic_tree(corpus, tmp_path, store_address, steps=40, fragments=fragments)
    out = run_sites(_leave_then_return, 3, 1, (tree,), faults="site2:step5:inner:term", timeout=150)
    assert out[(2, 0)]["steps"] == out[(0, 0)]["steps"] == 40
    assert outer_records(tmp_path, 0)[-1]["sites_used"] == 3
    assert_identical(tree, [0, 1, 2], 40)


def test_killed_store_stops_every_site_with_one_line_naming_it(corpus, tmp_path):
    """The store runs in its own process (as under `zeroband launch`); SIGKILL it mid-run. Before,
    each site ended in a C++ traceback (DistNetworkError: Connection reset by peer)."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    tree = elastic_tree(corpus, tmp_path, address, steps=400)
    metrics = tmp_path / "t" / "site0" / "metrics.jsonl"

    def kill_after_a_round(store) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (metrics.is_file() and '"kind": "outer"' in metrics.read_text()):
            time.sleep(0.2)
        store.kill()

    with store_process(["127.0.0.1", port], lambda cmd: cmd) as store:
        killer = threading.Thread(target=kill_after_a_round, args=(store,), daemon=True)
        killer.start()
        out = run_sites(_main, 2, 1, (_args(tree),), timeout=110)
        killer.join()
    for site in (0, 1):
        code, err = out[(site, 0)]
        errors = [line for line in err.splitlines() if line.startswith("zeroband: error:")]
        assert code == 1 and "Traceback" not in err and len(errors) == 1, err[-3000:]
        assert f"coordination store {address} stopped answering" in errors[0] and "Fix: restart it" in errors[0], errors


@pytest.mark.parametrize("fragments", [1, 2])
def test_every_holder_dead_the_restarted_sites_reform_the_run(corpus, tmp_path, store_address, fragments):
    """scripts/chaos.py --quick hung here: each site died (and was restarted) before the next one
    died, so every live site was a fresh joiner and none would propose a round; they waited until
    join_timeout_s. Now the fresh sites form it, the lowest one's checkpoint handed to the other.
    With fragments, that round syncs none (it names no fragment): the next one is a holder's."""
    tree = elastic_tree(corpus, tmp_path, store_address, steps=12, join_timeout_s=40.0, fragments=fragments)
    tree["checkpoint"] = {"interval": 2, "keep_last": 3}
    first = run_sites(_train, 2, 1, (tree,), faults="site0:step5:inner:kill,site1:step5:inner:kill",
                      allow_death=True, timeout=120)
    assert all(isinstance(first[(s, 0)], Died) for s in (0, 1)), first
    out = run_sites(_train, 2, 1, (tree,), timeout=120)  # the store kept the run's rounds
    assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 12
    reformed = [r for r in site_records(tmp_path, 1, "membership")
                if r["event"] == "commit" and r["round"] > 0 and r["joined"] == [0, 1]]
    assert reformed and reformed[0]["members"] == [0, 1], site_records(tmp_path, 1, "membership")
    assert_identical(tree, [0, 1], 12)


def test_a_late_sites_work_joins_the_next_merge_and_its_documents_commit_once(corpus, tmp_path, store_address):
    """Site 1 comes to round 2 (step 4) 5 s late, after the 1 s grace window: the round goes on
    without it. Site 0 is slow in the next round (5 s at step 5), so site 1 waits at round 3 as a
    joiner. With diloco.late_weight = 0.5 it brings round 2's pseudo-gradient to round 3's merge (2
    sites used, where a dropped round leaves 1: test_fragments.py's late site) and the ledger, which
    held its lease a round (tests/unit/test_ledger.py), commits the documents it read then. Every
    document commits once and the replicas end identical."""
    late_weight = 0.5
    from zeroband.data.ledger import audit, chain
    from zeroband.tools.report import ledger_records

    tree = elastic_tree(corpus, tmp_path, store_address, steps=10, late_weight=late_weight)
    out = run_sites(_train, 2, 1, (tree,), faults="site1:step4:inner:late,site0:step5:inner:late", timeout=150)
    assert out[(0, 0)]["steps"] == out[(1, 0)]["steps"] == 10
    by_step = {r["step"]: r for r in outer_records(tmp_path, 0)}
    assert by_step[4]["sites_used"] == 1 and by_step[6]["sites_used"] == (2 if late_weight else 1), by_step
    records, off = chain(ledger_records(tmp_path / "t" / f"site{s}" / "metrics.jsonl" for s in (0, 1)))
    assert off == {"differing": [], "superseded": [], "missing": []}, off
    left, after = records[2], records[3]  # round 0 is the start; outer steps at 2, 4 (round 2), 6
    assert (left["held"], "1" in after["committed"]) == (([1], True) if late_weight else ([], False)), (left, after)
    found = audit(records)
    assert found["committed"] == found["committed_once"] > 0 and found["lost"] == [], found
    assert not (found["twice"] or found["held_twice"] or found["committed_and_held"] or found["broken_chains"]), found
    assert_identical(tree, [0, 1], 10)
