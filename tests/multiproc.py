"""Run a function in real processes forked from pytest: cheap ranks of real gloo groups.

Forking skips the 4-20 s torch import that torchrun pays per process. Every child gets the
environment torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR/PORT) plus its site identity,
so the code under test runs unchanged. A child that hangs fails the test at `timeout`.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import importlib
import logging
import math
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroband.tools.launch import free_port  # noqa: F401  (the tests import it from here)

# Imported lazily by the first run in a process (data loading, the loss plot, nn.init under a device
# context, the trainer itself: compiled from source where bytecode is not written), seconds per fresh
# process: imported here once, before forking, every forked rank inherits them, as it inherits torch. The
# code under test runs unchanged (its own imports are then no-ops).
PRELOADED = ("datasets", "matplotlib.pyplot", "torch._dynamo", "zeroband.train")


@functools.cache
def preload() -> None:
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # optional (matplotlib): the run imports it, or does without, as before
            pass


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Fork inside: the children inherit this process's heap frozen (gc.freeze), so their collections
    (mesh.shutdown runs two) never walk it, nor copy its pages by touching every object: ~0.6 s of
    CPU per rank. This process thaws it at once and collects as before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def fork_event() -> Any:
    """An event the children of run_sites inherit (they are forked: their args are not pickled)."""
    return mp.get_context("fork").Event()


def freeze_self(done: Any, at_most_s: float) -> None:
    """SIGSTOP this process for good (a frozen peer that never comes back). A forked helper SIGKILLs
    it once `done` is set (whoever waited on it has seen what it needed), or after at_most_s."""
    me = os.getpid()
    if os.fork() == 0:
        done.wait(at_most_s)
        os.kill(me, signal.SIGKILL)
        os._exit(0)
    os.kill(me, signal.SIGSTOP)


def rank_env(site: int, sites: int, rank: int, ranks: int, master_port: int, store_port: int) -> dict[str, str]:
    """What torchrun (and the launcher) would give rank `rank` of `ranks` in site `site` of `sites`."""
    return {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
            "ZEROBAND_SITE_RANK": str(site), "ZEROBAND_SITE_COUNT": str(sites),
            "ZEROBAND_TEST_STORE": f"tcp://127.0.0.1:{store_port}", "OMP_NUM_THREADS": "1"}


def fork_site(fn: Callable, args: tuple, site: int, sites: int, log: Path) -> int:
    """fn(*args) as the one rank of site `site`, in a process forked from pytest and leading a process
    group of its own (what a launcher's session is: `os.killpg` ends it whole); its output goes to
    `log`, with its log records (INFO) and, on SIGUSR1, the stacks of its threads. Returns its pid: the caller signals it and reaps it (os.waitpid). Exit 0 when fn returns."""
    preload()
    with frozen_heap():
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setpgid(0, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(2, "w", buffering=1, closefd=False)  # not pytest's capture (capsys)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 pid`: every thread's stack, in `log`
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
        os.environ.update(rank_env(site, sites, 0, 1, free_port(), 0))
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0))))  # as _child
        import torch

        torch.set_num_threads(1)
        fn(*args)
        code = 0
    except BaseException:  # noqa: BLE001 -- the child reports in its log and its exit code, never to pytest
        traceback.print_exc()
    finally:
        os._exit(code)


def _child(fn: Callable, env: dict[str, str], queue: Any, key: tuple[int, int], args: tuple, faults: str) -> None:
    os.environ.update(env)
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)  # _collect: a hung rank's stacks
    # One intra-op thread per forked rank, the outer step's included (it takes the cores / local
    # ranks): libgomp cannot start a wider team in a process forked after the test process had one,
    # and the child hangs in its first parallel region. torchrun's ranks are fresh processes.
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0))))
    import torch

    if faults:  # this rank's entries of the schedule, wrapped around the code under test from outside
        from tests.faults import install

        install(faults)

    torch.set_num_threads(1)
    try:
        # Plain pickle copies tensor data: torch's queue reducers would share memory through file
        # descriptors that vanish when this process exits.
        queue.put((key, "ok", pickle.dumps(fn(*args))))
    except BaseException as e:  # report everything, including SystemExit, to the parent
        queue.put((key, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_sites(
    fn: Callable, sites: int, ranks: int | list[int], args: tuple = (), timeout: float = 120, env: dict | None = None,
    allow_death: bool = False, site_env: dict[int, dict] | None = None, faults: str = "",
) -> dict:
    """fn(*args) on `sites` x `ranks` forked processes (`ranks`: one count, or one per site); returns
    {(site, rank): result or Died}.
    `faults`: a tests/faults.py schedule armed in every child (each keeps its own entries).

    Raises if a rank raised, hung past `timeout`, or (unless allow_death) died without reporting.
    """
    preload()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store_port = free_port()
    procs = []
    with frozen_heap():
        for site in range(sites):
            master_port = free_port()
            site_ranks = ranks if isinstance(ranks, int) else ranks[site]
            for rank in range(site_ranks):
                child_env = {**rank_env(site, sites, rank, site_ranks, master_port, store_port),
                             **(env or {}), **((site_env or {}).get(site, {}))}
                p = ctx.Process(target=_child, args=(fn, child_env, queue, (site, rank), args, faults), daemon=True)
                p._zb_key = (site, rank)
                p.start()
                procs.append(p)
    return _collect(procs, queue, timeout, allow_death)


@dataclass(frozen=True)
class Died:
    """A rank that ended without reporting (killed by a signal, or os._exit)."""

    exitcode: int | None


# When pytest-timeout ends the running test (tests/conftest.py sets it): a run of ranks gives up
# REPORT_S before, so a hang fails with every rank's error and the hung ranks' stacks, not only the
# test process's own.
test_deadline = math.inf
REPORT_S = 10.0


def _collect(procs: list, queue: Any, timeout: float, allow_death: bool) -> dict:
    results: dict = {}
    errors: list[str] = []
    began = time.monotonic()
    deadline = min(began + timeout, test_deadline - REPORT_S)
    keys = [p._zb_key for p in procs]
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            key, status, value = queue.get(timeout=0.2)
        except queue_module.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            continue
        results[key] = pickle.loads(value) if status == "ok" else value
        if status == "error":
            errors.append(f"site {key[0]} rank {key[1]}: {value}")
    hung = [p for p in procs if p.is_alive() and time.monotonic() >= deadline]
    for p in hung:
        os.kill(p.pid, signal.SIGUSR1)  # its threads' stacks, on the test's captured stderr
    time.sleep(1.0 if hung else 0.0)
    for p in procs:
        p.join(timeout=0 if time.monotonic() > deadline else 5)
        if p.is_alive():
            p.kill()
            p.join()
            errors.append(f"site {p._zb_key[0]} rank {p._zb_key[1]} hung: still running after "
                          f"{time.monotonic() - began:.0f} s (its stacks are in the captured stderr)")
        elif p._zb_key not in results:
            results[p._zb_key] = Died(p.exitcode)
            if not allow_death:
                errors.append(f"site {p._zb_key[0]} rank {p._zb_key[1]} died with exit code {p.exitcode}")
    if errors:
        raise AssertionError("\n".join(errors))
    return {k: results[k] for k in keys}


def run_ranks(
    fn: Callable, ranks: int, args: tuple = (), timeout: float = 120, env: dict | None = None, allow_death: bool = False,
    faults: str = "",
) -> list:
    """fn(*args) on one site of `ranks` forked processes; results in rank order."""
    out = run_sites(fn, 1, ranks, args, timeout, env, allow_death, faults=faults)
    return [out[(0, r)] for r in range(ranks)]
