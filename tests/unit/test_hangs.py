"""Every hang of issue 13 ends within its (short) timeout with a message naming the cause.

Faults come from the test side only: signals sent to real forked site processes, a plain TCP
listener in place of the store, a flood of real idle connections, mismatched secrets and
checkpoint directories. Timeouts are a few seconds, so each case takes well under a minute.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import pytest

from tests.multiproc import free_port
from zeroband.membership.resume import ResumeMismatch, decide_resume
from zeroband.tools.launch import last_error_line, progress_line


def test_store_survives_a_flood_of_idle_connections():
    """1,000 idle connections (127.0.0.1 only): without the guard, a few hundred hold a new client
    past its timeout (docs/results/store.md)."""
    from zeroband.store.client import connect_tcp_store, host_tcp_store

    port = free_port()
    server = host_tcp_store("127.0.0.1", port, timedelta(seconds=30))
    address = f"tcp://127.0.0.1:{port}"

    def client_round_trip(key: str) -> float:
        t0 = time.monotonic()
        client = connect_tcp_store("127.0.0.1", port, timedelta(seconds=5), address)
        client.set(key, "v")
        assert server.get(key) == b"v"
        return time.monotonic() - t0

    flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
    try:
        assert client_round_trip("during") < 3.0
    finally:
        for s in flood:
            s.close()
    time.sleep(0.5)
    assert client_round_trip("after") < 3.0


def test_decide_resume_takes_the_newest_common_step_or_names_who_has_what():
    assert decide_resume({0: [], 1: []}) is None
    assert decide_resume({0: [2, 4], 1: [2, 4]}) == 4
    assert decide_resume({0: [2, 4], 1: [2]}) == 2
    with pytest.raises(ResumeMismatch, match=r"site 0 has steps \[10\]; site 1 has no checkpoint"):
        decide_resume({0: [10], 1: []})


def test_launcher_lines():
    assert progress_line('{"kind": "train", "step": 20, "loss": 5.25, "tokens_per_s": 1234.5, "lr": 0.001, '
                         '"eta_s": 30}') == "site 0 step 20: loss 5.2500, 1,234 tok/s, lr 1.00e-03, eta 30 s"
    assert progress_line('{"kind": "run", "step": 0}') is None and progress_line("{cut") is None
    log = "noise\nzeroband: error: sites cannot resume together\ntorch...ChildFailedError:\n  rank: 0\n"
    assert last_error_line(log) == "zeroband: error: sites cannot resume together"
    log = "Traceback\n  File x\nRuntimeError: boom\ntorch.distributed.elastic.ChildFailedError: \n===\n"
    assert last_error_line(log) == "RuntimeError: boom"


def test_store_waits_name_the_missing_sites_and_log_while_waiting(caplog):
    import torch.distributed as dist

    from zeroband.watchdog import PeerTimeout, Ticker, wait_keys

    store = dist.HashStore()
    store.set("k/0", "x")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="zeroband.watchdog"):
        with pytest.raises(PeerTimeout, match=r"resume agreement: site 2 did not arrive within 0.6 s"):
            wait_keys(store, {0: "k/0", 2: "k/2"}, "resume agreement", 0.6, log_every_s=0.2)
        ticker = Ticker("votes", log_every_s=0.0)
        ticker.tick("the votes of sites [0, 1]")
    assert time.monotonic() - t0 < 2
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("waiting 0 s for site 2 (resume agreement)") for line in lines), lines
    assert "waiting 0 s for the votes of sites [0, 1] (votes)" in lines


def test_the_process_tree_of_a_process_that_just_exited_is_empty():
    """`zeroband launch` walks /proc for stopped processes while ranks exit: a process gone between
    two reads made its supervisor fail with FileNotFoundError on /proc/<pid>/task (CI, under load).
    A real child that has exited and been reaped has no tree, and reading it raises nothing."""
    import subprocess
    import sys

    from zeroband.tools.launch import children, descendants, stopped_process

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert children(child.pid) == [] and descendants(child.pid) == [] and stopped_process(child.pid) is None
