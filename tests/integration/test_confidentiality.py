"""Real training runs under a capture of their cross-site traffic (tests/attackers.py `Capture`): with a secret, no sample of what a site handed its transport (the start broadcast: the
model; the pseudo-gradients; statistics; an elastic hand-over) appears on the wire, in the fixed and
the elastic mode; under `sites.insecure`, the control, every sample does. Every comm_dtype is
covered by the unit tier (in-process sites); here fp16 (fixed) and int8 (elastic).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.attackers import Capture, seen
from tests.helpers import _train, elastic_tree, tiny_overrides
from tests.multiproc import free_port, run_sites
from zeroband.store.client import open_store

SECRET = "confidentiality-tests-secret-0123456789"
pytestmark = pytest.mark.timeout(120)


def _captured(tree: dict) -> dict:
    capture = Capture()
    try:
        out = _train(tree)
        return {"steps": out["steps"], "samples": capture.samples, "wire": capture.wire()}
    finally:
        capture.close()


def _fixed(corpus: dict, tmp_path, insecure: bool) -> dict:
    tree = tiny_overrides(corpus, tmp_path, train={"steps": 4, "global_batch": 2, "micro_batch": 2})
    tree["diloco"] = {"inner_steps": 2, "comm_dtype": "fp16"}
    tree["sites"] = {"store": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 30, "streams": 2, "probe_s": 0,
                     "insecure": insecure}
    env = {} if insecure else {"ZEROBAND_SECRET": SECRET}
    return run_sites(_captured, 2, 1, (tree,), env=env, timeout=110)


def _judge(out: dict, steps: int) -> tuple[int, int, int]:
    """(samples, of which seen on the wire, captured bytes), over both sites."""
    assert [out[(s, 0)]["steps"] for s in (0, 1)] == [steps, steps]
    samples = out[(0, 0)]["samples"] + out[(1, 0)]["samples"]
    wire = out[(0, 0)]["wire"] + out[(1, 0)]["wire"]
    return len(samples), seen(samples, wire), sum(map(len, wire))


def test_a_fixed_run_sends_no_plaintext_and_without_a_secret_the_capture_sees_it(corpus, tmp_path):
    samples, found, captured = _judge(_fixed(corpus, tmp_path / "tls", insecure=False), 4)
    assert samples > 100 and captured > 200_000 and found == 0, (samples, found, captured)
    samples, found, captured = _judge(_fixed(corpus, tmp_path / "plain", insecure=True), 4)
    assert samples > 100 and found == samples, (samples, found, captured)


def test_an_elastic_run_sends_no_plaintext(corpus, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    host = open_store(address, True, timedelta(seconds=60))
    tree = elastic_tree(corpus, tmp_path, address, steps=6, comm_dtype="int8",
                        sites={"insecure": False, "streams": 2, "probe_s": 0})
    out = run_sites(_captured, 2, 1, (tree,), env={"ZEROBAND_SECRET": SECRET}, timeout=110)
    samples, found, captured = _judge(out, 6)
    assert samples > 100 and captured > 100_000 and found == 0, (samples, found, captured)
    del host
