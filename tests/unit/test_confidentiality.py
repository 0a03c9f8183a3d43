"""Nothing a site sends to another crosses the wire in the clear (issue 35 item 1: TLS 1.3).

A `Capture` (tests/attackers.py) records both sides of the traffic: every connection a transport dials crosses a relay
in the test's own process (zeroband/wan/relay.py, no delay) that keeps each direction's bytes, and
every message handed to a transport is sampled (32-byte windows inside each stream's slice, before
it is sent). The attacker's view is the relay's: a sample found in it is plaintext on the wire.
With a secret no sample is found; under `sites.insecure` every one is (the control: the capture
and the sampling do see plaintext when it is there). Here: in-process sites, every wire format;
tests/integration/test_confidentiality.py: real training runs, fixed and elastic.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.attackers import Capture, seen
from tests.unit.test_transport import KEY
from zeroband.comm.group import GlobalGroup
from zeroband.comm.reduce import SiteStats, reduce_across_sites
from zeroband.comm.transport import Transport
from zeroband.config import codec_names

WIRES = codec_names()  # every codec file in zeroband/comm/codecs/, as the config validates them


def _site(group: GlobalGroup, model: torch.Tensor, grads: list[torch.Tensor], wire: str, errors: list) -> None:
    try:
        group.broadcast(model, 0)  # the start broadcast: the model
        reduce_across_sites(grads, SiteStats(float(sum(g.double().square().sum() for g in grads)), 0.0), group,
                            wire, 1 << 14)
    except BaseException as e:  # reported by the test's thread
        errors.append(e)


def exchange_under(capture_key: bytes | None, wire: str) -> tuple[list[bytes], list[bytes]]:
    """Two in-process sites (2 streams each way) broadcast a model with a known pattern and
    all-reduce pseudo-gradients as `wire`, under a capture: (samples, captured streams)."""
    capture = Capture()
    try:
        group = [Transport(r, 2, "test/gen0/", capture_key, 10, 2, host="127.0.0.1") for r in range(2)]
        addresses = {r: t.address for r, t in enumerate(group)}
        threads = [threading.Thread(target=t.connect, args=(addresses,)) for t in group]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        groups = [GlobalGroup(t, t.rank, 2, prefix="test/gen0/") for t in group]
        pattern = torch.arange(50_000, dtype=torch.float32).mul_(1.0009765625)  # the "model": a known byte pattern
        errors: list[BaseException] = []
        work = [threading.Thread(target=_site, args=(
            g, pattern.clone() if g.rank == 0 else torch.zeros_like(pattern),
            [torch.randn(300, 70, generator=torch.Generator().manual_seed(g.rank)), torch.full((999,), 0.25)],
            wire, errors)) for g in groups]
        for th in work:
            th.start()
        for th in work:
            th.join()
        assert not errors, errors
        for t in group:
            t.close()
        return capture.samples, capture.wire()
    finally:
        capture.close()


@pytest.mark.parametrize("wire", WIRES)
def test_no_plaintext_tensor_bytes_cross_the_wire(wire):
    samples, captured = exchange_under(KEY, wire)
    # 8 windows per message (2 streams x Capture.PER_SLICE): at least the broadcast and three messages
    # of the exchange (a sparse gather sends fewest), and the 200 KB model crossed
    assert len(samples) >= 32 and sum(map(len, captured)) > 200_000
    assert seen(samples, captured) == 0


def test_the_capture_sees_every_sample_without_a_secret():
    """The control: sites.insecure sends plaintext, and the capture finds every sample in it."""
    samples, captured = exchange_under(None, "fp16")
    assert len(samples) > 100 and seen(samples, captured) == len(samples)


def test_the_wire_formats_are_read_from_the_config():
    """The parametrization above takes diloco.comm_dtype's values from the codec registry the config
    validates against; if that stops listing them, this fails rather than the tests above running none."""
    assert {"fp32", "fp16", "bf16", "int8", "int4", "sparse"} <= set(WIRES)
