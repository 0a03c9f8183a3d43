"""Shared fixtures: a small corpus and tokenizer built offline (helpers live in tests/helpers.py)."""

from __future__ import annotations

import math
import os
import time

import pytest

from tests.helpers import make_corpus

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from zeroband.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    jsonl = make_corpus(root / "train.jsonl")
    train_tokenizer([jsonl], 384, root / "tokenizer")
    return {"path": str(jsonl), "tokenizer": str(root / "tokenizer")}


@pytest.fixture(params=["native", "eager"])
def kernel_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with each implementation of the outer step's kernels (zeroband/comm/kernels.py),
    through its own switch; "native" needs a C compiler and skips without one."""
    from zeroband.comm.kernels import native_or_eager

    if request.param == "eager":
        monkeypatch.setenv("ZEROBAND_KERNELS", "eager")
    else:
        monkeypatch.delenv("ZEROBAND_KERNELS", raising=False)
        if native_or_eager().name != "native":
            pytest.skip("no native kernels on this machine (no C compiler): the eager run covers the code")
    return request.param


# ------------------------------------------------------------------------------------------ test tiers
# The folder is the tier. tests/unit/: in-process only (no child processes; a loopback store at most),
# the whole tier in well under a minute. tests/integration/: real forked ranks, torchrun, launchers,
# etcd, network namespaces. `pytest -m unit` / `-m integration` select a tier; `slow` (a decorator on
# the test) marks the end-to-end integration tests that take tens of seconds (`-m "not slow"`).
TIMEOUT_S = {"unit": 30, "integration": 120}  # per test; a unit test that needs longer is doing integration work


# `serial` marks the tests that measure time on the emulated link (its forwarder needs a core), run
# apart from the rest: scripts/test.sh runs ZEROBAND_TESTS=parallel under pytest-xdist, then =serial alone.
PHASES = {"parallel": lambda item: item.get_closest_marker("serial") is None,
          "serial": lambda item: item.get_closest_marker("serial") is not None}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if phase := os.environ.get("ZEROBAND_TESTS"):
        if phase not in PHASES:
            raise pytest.UsageError(f"ZEROBAND_TESTS={phase}: use parallel or serial (or leave it unset: every test)")
        config.hook.pytest_deselected(items=[item for item in items if not PHASES[phase](item)])
        items[:] = [item for item in items if PHASES[phase](item)]
    for item in items:
        tier = item.path.parent.name
        if tier not in TIMEOUT_S:
            raise pytest.UsageError(f"{item.nodeid}: a test module goes in tests/unit/ (in-process, fast) or "
                                    "tests/integration/ (real processes)")
        item.add_marker(tier)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S[tier]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """When pytest-timeout will end this test (its setup, call and teardown): tests/multiproc.py stops
    waiting for ranks before then and reports them, stacks and all."""
    from tests import multiproc

    marker = item.get_closest_marker("timeout")
    multiproc.test_deadline = time.monotonic() + float(marker.args[0]) if marker and marker.args else math.inf


@pytest.fixture
def store_address():
    """A hosted tcp:// store for the test's sites, alive until the test ends."""
    from datetime import timedelta

    from tests.multiproc import free_port
    from zeroband.store.client import open_store

    address = f"tcp://127.0.0.1:{free_port()}"
    host = open_store(address, True, timedelta(seconds=60))
    yield address
    del host
