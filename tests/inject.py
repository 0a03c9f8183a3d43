"""Run the `zeroband` command with faults armed (test side only: it lives in the checkout, not the wheel).

    python -m tests.inject --faults site1:step6:allreduce:kill -- train CONFIG --k v ...
    python -m tests.inject --faults site1:step6:allreduce:nan -- launch CONFIG --sites 2

from the checkout's root (or with it on PYTHONPATH). The seams of tests/faults.py are installed in this process (zeroband/seams.py), then the
command runs in-process (`zeroband.cli.main`). Under `launch`, every site's ranks are started
through this entry point too (the `site_command` seam), with the same schedule; each rank keeps
the entries of its own site and rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from tests.faults import install
from zeroband import seams

ENTRY = "tests.inject"
CHECKOUT = Path(__file__).resolve().parent.parent


def entry_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the checkout first on PYTHONPATH, so that `python -m
    tests.inject` is found from any directory, in every process a launch starts below it."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env


def inject_command(command: list[str], faults: str, site: int | None = None) -> list[str]:
    """`command` (a site command that runs `-m zeroband.train ARGS`) with the faults armed."""
    at = next(i for i in range(len(command) - 1) if command[i:i + 2] == ["-m", "zeroband.train"])
    own = [] if site is None else ["--site", str(site)]
    return [*command[:at], "-m", ENTRY, "--faults", faults, *own, "--", "train", *command[at + 2:]]


def site_of(argv: list[str]) -> int | None:
    """The site a trainer's arguments name (`--<section>.site_rank N`), if any."""
    for flag, value in zip(argv, argv[1:]):
        if flag.startswith("--") and flag.endswith(".site_rank"):
            return int(value)
    return None


def arm_sites(faults: str) -> None:
    """`zeroband launch` starts its sites through the `site_command` seam: arm the faults in them too."""
    installed = seams.current()
    seams.use(replace(installed, site_command=lambda command, site: inject_command(command, faults, site)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {ENTRY}", description=__doc__.splitlines()[0])
    parser.add_argument("--faults", required=True, help="site<N>:step<N>:<point>:<action>[:rank<N>],...")
    parser.add_argument("--site", type=int, default=None, help="this process's site (default: from the arguments)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the `zeroband` command's arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    site = args.site if args.site is not None else site_of(command)
    install(args.faults, site=site if site is not None else int(os.environ.get("ZEROBAND_SITE_RANK", "0")))
    arm_sites(args.faults)
    os.environ.update(entry_env())  # the sites a launch starts run this module too
    from zeroband.cli import main as zeroband_main

    return zeroband_main(command)


if __name__ == "__main__":
    sys.exit(main())
