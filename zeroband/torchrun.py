"""torchrun whose stores listen only on the address they are given.

    python -m zeroband.torchrun --standalone --local-addr 127.0.0.1 --nproc-per-node N -m zeroband.train ...

torchrun's agent hosts two c10d TCPStore servers (the rendezvous store and the store it shares with
its workers), and c10d's server listens on every interface whatever host it is given. Here the
TCPStore class is replaced by BoundTCPStore before torchrun's modules bind the name, so both listen
only on their host: `localhost` for the standalone rendezvous, `--local-addr` for the shared store.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from zeroband.membership.store import BoundTCPStore


def main() -> None:
    dist.TCPStore = BoundTCPStore  # before torch.distributed.run (and elastic) import the name
    from torch.distributed.run import main as torchrun_main

    torchrun_main(sys.argv[1:])


def command(nproc: int, local_addr: str = "127.0.0.1") -> list[str]:
    """The argv prefix of a one-machine torchrun job whose listeners are all on `local_addr`'s host."""
    return [sys.executable, "-m", "zeroband.torchrun", "--standalone", "--local-addr", local_addr,
            f"--nproc-per-node={nproc}"]


if __name__ == "__main__":
    main()
