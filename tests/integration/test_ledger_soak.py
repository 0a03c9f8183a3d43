"""The data ledger under churn, at the corpus level (issue 34): three elastic sites on a
corpus small enough that an epoch lasts a few rounds; site 2 joins late; faults of each kind (SIGKILL
of the workers, SIGTERM, SIGSTOP until the others drop the site, SIGKILL of the whole process group:
one of each in CI, six with ZEROBAND_SOAK=1), each victim restarted as a joiner; then a full stop, a
fresh store, and a relaunch from the checkpoints. The run's records must show, per epoch: no
document read twice, none left unread behind a later epoch, every lease at its bound after every
commit; and round numbers that go on through the relaunch.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests import chaos
from tests.helpers import WORDS, _train, elastic_tree
from tests.multiproc import fork_site, free_port
from zeroband.data.ledger import audit
from zeroband.store.client import open_store
from zeroband.tools.report import data_clean, epoch_lines, ledger_records

# CI injects one fault of each kind; the soak (ZEROBAND_SOAK=1, README "Tests") six of each. Either
# way the churn goes on until EPOCHS epochs of the corpus were dealt, so the records cross that many.
SITES, PER_KIND, DEAD_AFTER_S, EPOCHS = 3, 6 if os.environ.get("ZEROBAND_SOAK") else 1, 2.0, 4
KINDS = ("kill", "term", "stop", "group")


def small_corpus(path: Path, n_docs: int = 60) -> Path:
    """Documents of 15-45 words of the test tokenizer's vocabulary: an epoch is a few rounds."""
    rng = random.Random(1)
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 45)))}) + "\n")
    return path


class Site:
    """One site slot: a process forked from pytest per incarnation (tests/multiproc.py `fork_site`:
    no torch import per restart), leading its own process group as a launcher's session does."""

    def __init__(self, site: int, tree: dict, logs: Path) -> None:
        self.site, self.tree, self.logs = site, tree, logs
        self.pid: int | None = None
        self.incarnations, self.started = 0, 0.0

    def start(self) -> None:
        self.pid = fork_site(_train, (self.tree,), self.site, SITES, self.logs / f"site{self.site}.log")
        self.incarnations, self.started = self.incarnations + 1, time.time()

    @property
    def running(self) -> bool:
        if self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] == self.pid:
            self.pid = None
        return self.pid is not None

    def signal(self, sig: int, group: bool = False) -> None:
        if self.running:
            assert self.pid is not None
            (os.killpg if group else os.kill)(self.pid, sig)

    def stop(self, timeout_s: float) -> None:
        """Once SIGTERMed (`signal`): wait for it to save and leave, SIGKILL its group after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            time.sleep(0.1)
        self.signal(signal.SIGKILL, group=True)
        while self.running:
            time.sleep(0.05)


class Churn:
    """One fault at a time, on a site that holds the run's state while another one does too (so a
    holder is always left), kinds in turn; each victim is started again (a join) as soon as it is
    gone, and so is any site that exits on its own."""

    def __init__(self, sites: list[Site], metrics: list[Path]) -> None:
        self.sites, self.metrics, self.tail = sites, metrics, chaos.DecisionTail(metrics)
        self.done: list[tuple[str, int]] = []
        self.victim: Site | None = None
        self.stopped_at = self.restarted_at = 0.0
        self.gave_up: list[int] = []  # sites that exited without a fault

    def holders(self) -> set[int]:
        """Sites that hold the run's state: members of the newest commit, in an incarnation older than it."""
        commits = chaos.membership_events(self.metrics, "commit")
        newest = commits[-1] if commits else {"members": [], "time": 0.0}
        return {s for s in newest["members"] if self.sites[s].running and self.sites[s].started < newest["time"]}

    def tick(self) -> None:
        p = self.victim
        if p is not None:
            if p.running:
                if self.stopped_at and (chaos.first_exclusion(self.tail.read(), p.site, self.stopped_at)
                                        or time.time() - self.stopped_at > 4 * DEAD_AFTER_S + 1):
                    p.signal(signal.SIGKILL)  # dropped by the others: now it may die
                    self.stopped_at = 0.0
                return
            p.start()
            self.victim, self.restarted_at = None, time.time()
        for q in self.sites:  # a site that gave up on its own (a RoundTimeout on a starved CPU): back too
            if q.incarnations and not q.running:
                self.gave_up.append(q.site)
                q.start()
                self.restarted_at = time.time()
        holders = self.holders()
        ready = [p for p in self.sites if p.running and p.site in holders]
        if len(ready) >= 2 and len(self.done) < PER_KIND * len(KINDS):
            self.inject(KINDS[len(self.done) % len(KINDS)], ready[len(self.done) % len(ready)])

    def inject(self, kind: str, p: Site) -> None:
        sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP, "group": signal.SIGKILL}[kind]
        p.signal(sig, group=kind == "group")
        self.stopped_at = time.time() if kind == "stop" else 0.0
        self.done.append((kind, p.site))
        self.victim = p


def commits_since(path: Path, since: float) -> int:
    return sum(1 for r in chaos.read_records(path, "membership") if r.get("event") == "commit" and r["time"] > since)


def run(tree: dict, logs: Path, churn: bool, deadline_s: float) -> tuple[list[Site], Churn | None]:
    """The sites on `tree`'s store (with `churn`: site 2 starts once a round was committed without
    it, then the faults) until every site has committed three rounds since the last fault (and, with
    `churn`, EPOCHS epochs were dealt), then a full stop: every site SIGTERMed (each saves and leaves)."""
    metrics = [Path(tree["output_dir"]) / tree["name"] / f"site{s}" / "metrics.jsonl" for s in range(SITES)]
    sites = [Site(s, tree, logs) for s in range(SITES)]
    driver = Churn(sites, metrics) if churn else None
    began, deadline = time.time(), time.monotonic() + deadline_s
    try:
        for p in sites[: SITES - 1 if churn else SITES]:
            p.start()
        while True:
            assert time.monotonic() < deadline, f"not done in {deadline_s:.0f} s: {driver and driver.done}"
            if churn and not sites[-1].incarnations and commits_since(metrics[0], began):
                sites[-1].start()  # a new site, joining the run
            if driver is not None:
                driver.tick()
            quiet = driver is None or (len(driver.done) == PER_KIND * len(KINDS) and driver.victim is None)
            since = began if driver is None else driver.restarted_at
            if quiet and all(commits_since(path, since) >= 3 for path in metrics) and (
                    not churn or len(audit(ledger_records(metrics)).get("epochs", [])) >= EPOCHS):
                return sites, driver
            time.sleep(0.2)
    finally:
        for p in sites:
            p.signal(signal.SIGUSR1)  # the stacks of every thread, in the site's log (tests/multiproc.py)
        time.sleep(0.5)
        for p in sites:  # all at once: each saves and leaves at about the same round
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        for p in sites:
            p.stop(timeout_s=20)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks process groups")
def test_churn_and_relaunch_read_every_document_once_per_epoch(corpus, tmp_path, store_address, capsys):
    tree = elastic_tree(corpus, tmp_path, store_address, steps=100_000, start_grace_s=3.0,
                        dead_after_s=DEAD_AFTER_S, sites={"timeout_s": 30})
    tree["data"].update(path=str(small_corpus(tmp_path / "small.jsonl")), span_docs=2)
    tree["checkpoint"] = {**tree.get("checkpoint", {}), "interval": 20, "keep_last": 2}
    (tmp_path / "logs").mkdir()
    began = time.monotonic()
    sites, driver = run(tree, tmp_path / "logs", churn=True, deadline_s=420)
    metrics = [tmp_path / tree["name"] / f"site{s}" / "metrics.jsonl" for s in range(SITES)]
    assert driver is not None and sorted(k for k, _ in driver.done) == sorted(KINDS * PER_KIND)
    assert sum(1 for d in chaos.read_decisions(metrics) if 2 in d.fresh and d.site == 0) >= 2, "site 2 joined once"
    first = audit(ledger_records(metrics))
    churn_s = time.monotonic() - began

    fresh_store = f"tcp://127.0.0.1:{free_port()}"  # a full stop: the store goes too
    host = open_store(fresh_store, True, timedelta(seconds=60))
    relaunched = time.time()
    run({**tree, "sites": {**tree["sites"], "store": fresh_store}}, tmp_path / "logs", churn=False, deadline_s=120)
    del host
    found = audit(ledger_records(metrics))
    after = sorted({r["round"] for r in ledger_records(metrics) if r["time"] > relaunched})
    with capsys.disabled():
        print(f"\nsoak: {churn_s:.0f} s of churn ({sum(p.incarnations for p in sites)} incarnations, exits without "
              f"a fault {driver.gave_up}), "
              f"{time.monotonic() - began:.0f} s with the relaunch; rounds {found['first_round']}-"
              f"{found['last_round']} (before the relaunch: -{first['last_round']}, after it from {after[0]})")
        print("\n".join(epoch_lines(found)))
    for d in (first, found):
        assert data_clean(d), {k: v for k, v in d.items() if k != "lease_max"}
        assert len(d["epochs"]) >= EPOCHS and d["committed"] == d["committed_once"] > 0
    # the relaunch's rounds go on from its checkpoint's (the lowest site's: rounds the others saved after it
    # are undone with their training), and the audit's line runs from round 0 through them
    assert found["first_round"] == 0 and 0 < after[0] and after[-1] == found["last_round"], after
