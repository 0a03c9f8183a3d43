"""torchrun whose stores listen only on the address they are given.

    python -m zeroband.torchrun --standalone --local-addr 127.0.0.1 --nproc-per-node N -m zeroband.train ...

torchrun's agent hosts two c10d TCPStore servers (the rendezvous store and the store it shares with
its workers), and c10d's server listens on every interface whatever host it is given. Here the
TCPStore class is replaced by BoundTCPStore before torchrun's modules bind the name, so both listen
only on their host: `localhost` for the standalone rendezvous, `--local-addr` for the shared store.

A rank that fails ends the job with one line (`FIRST_FAILURE`, naming the rank and its exit), not
torchrun's 40-line traceback and report; the ranks' own output says why. SIGTERM (SIGINT, SIGHUP)
to the agent is passed on to the ranks by torchrun, which then raises SignalException: the job
exits 0 when every rank then exited 0 (an elastic site left cleanly), else with the first failure.
The agent dies with its parent (`zeroband launch`): PR_SET_PDEATHSIG sends it SIGTERM, which it
passes on, so no rank outlives its supervisor.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import torch.distributed as dist

from zeroband.store.client import BoundTCPStore
from zeroband.store.guard import die_with_parent

FIRST_FAILURE = "zeroband.torchrun: first failure:"


def main() -> int:
    die_with_parent(os.getppid(), signal.SIGTERM)
    # before torch.distributed.run (and elastic) import the name; setattr: a class is no assignable name
    setattr(dist, "TCPStore", BoundTCPStore)  # noqa: B010
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    workers = _track_workers()
    try:
        torchrun_main(sys.argv[1:])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(failure_line(rank, failure.local_rank, failure.exitcode, len(e.failures)), file=sys.stderr, flush=True)
        return exit_status(failure.exitcode)
    except SignalException as e:
        line, code = signalled(signal.Signals(e.sigval).name, [p.poll() for p in workers])
        print(line, file=sys.stderr, flush=True)
        return code
    return 0


def _track_workers() -> list[subprocess.Popen]:
    """The ranks' processes as torchrun starts them (their exit codes, once a signal ended the job)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as handler

    workers: list[subprocess.Popen] = []
    popen = handler.SubprocessHandler._popen

    def tracked(self: Any, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        workers.append(popen(self, args, env))
        return workers[-1]

    setattr(handler.SubprocessHandler, "_popen", tracked)  # noqa: B010
    return workers


def signalled(name: str, codes: list[int | None]) -> tuple[str, int]:
    """(the job's one line, its exit status) once `name` stopped it and torchrun stopped the ranks,
    whose exit codes are `codes` (None: still running when torchrun gave up on it)."""
    failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
    if codes and not failed:
        return f"zeroband.torchrun: {name}: every rank ({len(codes)}) exited cleanly", 0
    by_signal = 128 + signal.Signals[name].value
    if not failed:
        return f"zeroband.torchrun: {name} before any rank started", by_signal
    rank, code = failed[0]
    if code is None:
        return f"{FIRST_FAILURE} local rank {rank} still running after {name}; {len(failed)} rank(s) failed", by_signal
    return failure_line(rank, rank, code, len(failed)), exit_status(code)


def failure_line(rank: int, local_rank: int, exitcode: int, failures: int) -> str:
    how = f"killed by signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
    return f"{FIRST_FAILURE} rank {rank} (local rank {local_rank}), {how}; {failures} rank(s) failed"


def exit_status(exitcode: int) -> int:
    """The job's exit status for its first failure: the rank's own, 128 + N for signal N."""
    return 128 - exitcode if exitcode < 0 else (exitcode or 1)


def command(nproc: int, local_addr: str = "127.0.0.1") -> list[str]:
    """The argv prefix of a one-machine torchrun job whose listeners are all on `local_addr`'s host."""
    return [sys.executable, "-m", "zeroband.torchrun", "--standalone", "--local-addr", local_addr,
            f"--nproc-per-node={nproc}"]


if __name__ == "__main__":
    sys.exit(main())
