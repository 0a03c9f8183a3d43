"""The coordination store under idle connections and member loss: the numbers behind
zeroband/store/guard.py (why the tcp:// store is its own server) and zeroband/store/etcd.py
(`request_timeout`).

    python scripts/bench_store.py --out docs/results    # ~2 min on 2 cores; etcd rows need `etcd`

1. Idle connections. A store on loopback with N idle TCP connections open (each connects and
   sends nothing); then a new client (a fresh process) connects and sets a key, given --client-s
   seconds. Timed while the N are open and again once they are closed, against c10d's TCPStore
   (libuv server) as it is, and against the store zeroband hosts (`host_tcp_store`: the
   store process of store/guard.py, no secret). Every store lives in a process of its own, started
   afresh per N: a store that stopped accepting clients stays that way.
2. etcd leader loss. A 3-member loopback cluster (tests/etcd_cluster.py: 50 ms heartbeat, 500 ms
   election timeout); the raft leader is SIGKILLed and the first write through zeroband's
   EtcdStore (the dead member first in its endpoint list, default request_timeout) is timed,
   --kills times, each on a fresh cluster.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import add_out_argument, cpu_name, markdown_table, output_dir, write_outputs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HOSTS = {  # python code run as its own process: hosts the store on port {port} until its stdin closes
    "c10d TCPStore": "import torch.distributed as dist; from datetime import timedelta; "
                     "s = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, "
                     "timeout=timedelta(seconds=60), use_libuv=True)",
    "zeroband (guarded)": "from datetime import timedelta; from zeroband.store.client import host_tcp_store; "
                          "s = host_tcp_store('127.0.0.1', {port}, timedelta(seconds=60))",
}
CLIENT = ("import sys, time; from datetime import timedelta; from zeroband.store.client import open_store; "
          "import torch.distributed as dist; t0 = time.monotonic()\n"
          "try:\n"
          "    s = (dist.TCPStore('127.0.0.1', {port}, is_master=False, timeout=timedelta(seconds={limit})) if {raw} "
          "else open_store('tcp://127.0.0.1:{port}', False, timedelta(seconds={limit})))\n"
          "    s.set('probe', 'v'); print(time.monotonic() - t0)\n"
          "except Exception as e:\n"
          "    print('failed', time.monotonic() - t0, type(e).__name__)")


def client_seconds(port: int, raw: bool, limit: float) -> tuple[bool, float]:
    """A fresh process connects and writes one key: (succeeded, seconds it took or until it gave up)."""
    code = CLIENT.format(port=port, raw=raw, limit=limit)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit + 30,
                             cwd=REPO).stdout.split()
    except subprocess.TimeoutExpired:
        return False, limit + 30
    if not out:
        return False, float("nan")
    return (False, float(out[1])) if out[0] == "failed" else (True, float(out[0]))


def idle_rows(counts: list[int], limit: float) -> list[dict[str, Any]]:
    from zeroband.tools.launch import free_port

    rows = []
    for store, host in HOSTS.items():
        for n in counts:
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-c", host.format(port=port) + "; import sys; sys.stdin.read()"],
                                    stdin=subprocess.PIPE, cwd=REPO)
            try:
                _wait_listening(port)
                idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
                ok_open, s_open = client_seconds(port, store.startswith("c10d"), limit)
                for s in idle:
                    s.close()
                time.sleep(0.5)
                ok_after, s_after = client_seconds(port, store.startswith("c10d"), limit)
            finally:
                proc.kill()
                proc.wait()
            rows.append({"store": store, "idle": n, "open_ok": ok_open, "open_s": s_open, "closed_ok": ok_after,
                         "closed_s": s_after})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _wait_listening(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"the store on port {port} did not listen within {timeout:g} s")


def etcd_failover(kills: int) -> list[float]:
    from datetime import timedelta

    from tests.etcd_cluster import etcd_binary, start_cluster
    from zeroband.store.client import open_store

    if etcd_binary() is None:
        print("etcd not found: no failover rows", flush=True)
        return []
    seconds = []
    for k in range(kills):
        cluster = start_cluster(3)
        try:
            dead = cluster.leader()
            order = [dead] + [i for i in range(3) if i != dead]  # the client tries the dead member first
            store = open_store("etcd://" + ",".join(cluster.members[i].endpoint for i in order) + f"/bench{k}",
                               False, timedelta(seconds=10))
            store.set("before", b"1")
            cluster.kill(dead)
            t0 = time.monotonic()
            store.set("after", b"2")
            seconds.append(time.monotonic() - t0)
        finally:
            cluster.stop()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--idle", type=int, nargs="+", default=[0, 100, 300])
    p.add_argument("--client-s", type=float, default=15.0, help="how long a new client may take to connect")
    p.add_argument("--kills", type=int, default=3)
    add_out_argument(p, "docs/results", "store.{json,md}")
    args = p.parse_args()
    out = output_dir(args.out, "store")
    idle = idle_rows(args.idle, args.client_s)
    failover = etcd_failover(args.kills)
    import torch

    def cell(ok: bool, s: float) -> str:
        return f"{s:.2f} s" if ok else f"refused after {s:.1f} s"

    md = "\n\n".join([
        "# The coordination store: idle connections and etcd leader loss", "```bash\npython scripts/bench_store.py "
        + " ".join(sys.argv[1:]) + "\n```",
        f"Machine: {cpu_name()}, torch {torch.__version__}. What each number is: the docstring of "
        "scripts/bench_store.py.",
        "## A new client's connect + first write, with N idle connections open, then after they closed",
        markdown_table(["store", "idle connections", "new client while open", "new client after they closed"],
                       [[r["store"], r["idle"], cell(r["open_ok"], r["open_s"]), cell(r["closed_ok"], r["closed_s"])]
                        for r in idle]),
        "## etcd: the first write after the raft leader is killed (3 members, client tries the dead one first)",
        "seconds: " + (", ".join(f"{s:.2f}" for s in failover) or "not measured (no etcd binary)"),
    ])
    write_outputs(out, "store", {"idle": idle, "etcd_failover_s": failover, "client_s": args.client_s}, md)


if __name__ == "__main__":
    main()
