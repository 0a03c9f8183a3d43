"""torchrun whose stores listen only on the address they are given.

    python -m zeroband.torchrun --standalone --local-addr 127.0.0.1 --nproc-per-node N -m zeroband.train ...

torchrun's agent hosts two c10d TCPStore servers (the rendezvous store and the store it shares with
its workers), and c10d's server listens on every interface whatever host it is given. Here the
TCPStore class is replaced by BoundTCPStore before torchrun's modules bind the name, so both listen
only on their host: `localhost` for the standalone rendezvous, `--local-addr` for the shared store.

A rank that fails ends the job with one line (`FIRST_FAILURE`, naming the rank and its exit), not
torchrun's 40-line traceback and report; the ranks' own output says why.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from zeroband.store.client import BoundTCPStore

FIRST_FAILURE = "zeroband.torchrun: first failure:"


def main() -> int:
    dist.TCPStore = BoundTCPStore  # before torch.distributed.run (and elastic) import the name
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(sys.argv[1:])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(failure_line(rank, failure.local_rank, failure.exitcode, len(e.failures)), file=sys.stderr, flush=True)
        return exit_status(failure.exitcode)
    return 0


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
