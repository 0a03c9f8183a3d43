#!/usr/bin/env python
"""How long a cross-site group takes to form over a long link, the first time and again.

    flock /tmp/zeroband-bench.lock python scripts/bench_form.py --out benchmarks          # ~4 min, root
    python scripts/bench_form.py --sites 2 --repeats 1 --out /tmp/form                      # a quick look
    python scripts/bench_form.py --a /work/old-checkout --out /tmp/form                     # before/after

Made for issue 36 item 5 (groups form in seconds). Each row is one run of S sites, each in its own
network namespace of the WAN emulator (zeroband/wan/emulator.py: `--rate-mbit` per uplink,
`--delay-ms` each way), with the run's secret, site 0 hosting the guarded store. Every site forms a
group as a run does (`new_global_group`, sites.streams = "auto", sites.probe_s = `--probe-s`), then a
second group on a fresh prefix (what an elastic generation or a resume does in the same process).
Per group and site: seconds from the call to its return (all sites enter together: each first
waits on a store barrier), the part spent measuring links (the probe), and the streams kept.
A row's number is the slowest site's. `--a`: also run that checkout, alternating, for a ratio.
Writes form.{json,md} to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, load_average, load_note, markdown_table, output_dir, write_outputs  # noqa: E402

SECRET = "bench-form-shared-secret-0123456789"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sites", default="4,8", help="comma separated site counts")
    p.add_argument("--repeats", type=int, default=2, help="runs per site count (and checkout)")
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--delay-ms", type=float, default=100.0, help="one way (RTT = twice this)")
    p.add_argument("--probe-s", type=float, default=3.0, help="sites.probe_s")
    p.add_argument("--a", type=Path, default=None, help="another checkout to run beside this one")
    p.add_argument("--out", type=Path, default=None, help="directory for form.{json,md}")
    p.add_argument("--site", type=int, default=None, help=argparse.SUPPRESS)  # internal: one site
    p.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.site is None:
        a.out = output_dir(a.out, "form", False)
    return a


def site(args: argparse.Namespace) -> None:
    """One site, inside its namespace: two groups, each timed from a common start."""
    os.environ["ZEROBAND_SECRET"] = SECRET
    from zeroband.comm.group import new_global_group
    from zeroband.comm.link import LinkPolicy
    from zeroband.store.client import open_store
    from zeroband.trust.mac import WireAuth
    from zeroband.watchdog import Watch

    parts = _timed_parts()
    timeout = timedelta(seconds=300)
    store = open_store(args.store, args.site == 0, timeout)
    auth = WireAuth.from_secret(SECRET.encode(), "bench-form")
    for k in range(2):
        store.add(f"bench-form/enter{k}", 1)  # a barrier: every site starts its clock together
        if args.site == 0:
            _release(store, k, args.size)
        store.wait([f"bench-form/go{k}"])
        parts.clear()
        t0 = time.perf_counter()
        group = new_global_group(store, f"bench-form/g{k}/", args.site, args.size, timeout, watch=Watch(300),
                                 auth=auth, policy=LinkPolicy("auto", args.probe_s))
        took = time.perf_counter() - t0
        links = getattr(group, "links", {}) or {}
        print(json.dumps({"group": k, "seconds": took, "probe_s": max((p.seconds for p in links.values() if not getattr(p, "reused", False)), default=0.0),
                          "streams": sorted({p.chosen or p.streams for p in links.values()}), **parts}), flush=True)
        group.gather_scalars([0.0])  # nobody closes its group while a peer still uses it
    store.add("bench-form/done", 1)
    if args.site == 0:  # the store's host stays until every site is done with it
        while int(store.add("bench-form/done", 0)) < args.size:
            time.sleep(0.1)


def _timed_parts() -> dict[str, float]:
    """Seconds of each phase of the next group's formation, filled as it runs: the store rendezvous,
    reading the peers' addresses, dialing and accepting, and the link probe. Wraps the functions in
    place (measuring them, nothing else), in this benchmark's process only."""
    from zeroband.comm import group, transport

    parts: dict[str, float] = {}

    def timed(owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:
            return

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                parts[part] = parts.get(part, 0.0) + time.perf_counter() - t0
        setattr(owner, name, wrapper)

    timed(group, "rendezvous", "rendezvous_s")
    timed(transport.Transport, "connect", "connect_s")  # dial + accept + probe
    timed(transport.Transport, "_measure", "measure_s")  # the probe, pings included
    timed(transport.Transport, "_dial_all", "dial_s")  # where the checkout has it
    timed(group, "wait_keys", "addresses_s")  # the peers' addresses in the store
    return parts


def _release(store: Any, k: int, size: int) -> None:
    while int(store.add(f"bench-form/enter{k}", 0)) < size:
        time.sleep(0.01)
    store.set(f"bench-form/go{k}", "1")


def run_once(args: argparse.Namespace, tree: Path, size: int) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from zeroband.wan import WanEmulator

    with WanEmulator(size, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms, mtu=9000, backend="tun") as wan:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--probe-s", str(args.probe_s), "--size", str(size),
               "--store", f"tcp://{wan.site_ip(0)}:29519"]
        procs = [subprocess.Popen(wan.wrap(i, [*cmd, "--site", str(i)]), cwd=tree, text=True,
                                  env={**os.environ, **wan.env(i), "PYTHONPATH": str(tree)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(size)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):  # a losing row is kept: what the first failing site said last
        site = next(i for i, p in enumerate(procs) if p.returncode)
        last = [line for line in outs[site].splitlines() if line.strip()][-1:]
        return {"failed": f"site {site}: {last[0] if last else 'exit ' + str(procs[site].returncode)}"}
    rows = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs]
    row: dict[str, Any] = {"per_site": rows}
    for k, name in ((0, "first"), (1, "again")):
        per_site = [r[k] for r in rows]
        row[f"{name}_s"] = max(r["seconds"] for r in per_site)
        row[f"{name}_probe_s"] = max(r["probe_s"] for r in per_site)
        row[f"{name}_streams"] = sorted({s for r in per_site for s in r["streams"]})
        for part in ("rendezvous_s", "addresses_s", "connect_s", "dial_s", "measure_s"):
            row[f"{name}_{part}"] = max(r.get(part, 0.0) for r in per_site)
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.site is not None:
        return site(args)
    trees = {"this": REPO, **({"A": args.a.resolve()} if args.a else {})}
    results: dict[str, Any] = {"command": " ".join(["python", "scripts/bench_form.py", *(argv or sys.argv[1:])]),
                               "trees": {k: str(v) for k, v in trees.items()}, "load_start": load_average(), "runs": []}
    for size in [int(s) for s in args.sites.split(",")]:
        for rep in range(args.repeats):
            for name in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
                row = {"tree": name, "sites": size, "rep": rep, "load": load_average(),
                       **run_once(args, trees[name], size)}
                results["runs"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "per_site"}), flush=True)
    results["load_end"] = load_average()
    table = []
    for name in trees:
        for size in sorted({r["sites"] for r in results["runs"]}):
            rs = [r for r in results["runs"] if r["tree"] == name and r["sites"] == size and "failed" not in r]
            failed = [r["failed"] for r in results["runs"] if r["tree"] == name and r["sites"] == size and "failed" in r]
            if not rs:
                table.append([name, size, *["failed"] * 4, "", f"0 of {len(failed)}: {failed[0]}"])
                continue
            table.append([name, size, *(f"{statistics.fmean(r[m] for r in rs):.2f} ({min(r[m] for r in rs):.2f}-"
                                       f"{max(r[m] for r in rs):.2f})" for m in ("first_s", "first_probe_s",
                                                                                 "again_s", "again_probe_s")),
                          ",".join(str(s) for s in rs[-1]["first_streams"]), f"{len(rs)} of {len(rs) + len(failed)}"])
    md = "\n".join([
        "## Group formation over a long link", "",
        f"`{results['command']}`: sites in the WAN emulator at {args.rate_mbit:g} Mbit/s per uplink, "
        f"{2 * args.delay_ms:g} ms RTT, a shared secret, sites.streams = \"auto\", sites.probe_s = {args.probe_s:g}. "
        "Seconds from `new_global_group` to its return on the slowest site (all enter together), the first group "
        "of the process and a second one on a fresh prefix (an elastic generation, a resume); probe: the part "
        "spent measuring links. Mean (min-max) over the runs.", "",
        markdown_table(["tree", "sites", "first s", "of which probe s", "again s", "of which probe s",
                        "streams kept", "runs"], table), "",
        "Trees: " + ", ".join(f"{k} = {v}" for k, v in results["trees"].items()) + ".", "",
        load_note(results["load_start"], results["load_end"]), ""])
    write_outputs(args.out, "form", results, md)
    return None


if __name__ == "__main__":
    main()
