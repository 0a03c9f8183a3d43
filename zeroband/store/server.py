"""A standalone TCP coordination store, so that no training site hosts it.

    python -m zeroband.store.server --port 29600 [--host 127.0.0.1]

`zeroband launch` starts one beside the sites (inside site 0's network namespace under WAN
emulation, but as its own process), so killing any site, site 0 included, leaves the store up.
It exits on SIGTERM/SIGINT or when its parent process goes away. With the run's secret in
$ZEROBAND_SECRET (the launcher hands it over) only connections that prove it read or write a key
(store/guard.py, the store process this one starts); without one the port is only flood-bounded,
not authenticated. For runs
spanning real sites, use an etcd cluster with a member per site instead (`sites.store = "etcd://..."`).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

from zeroband.store.client import host_tcp_store
from zeroband.trust.secret import SECRET_ENV, resolve_secret


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the one address it listens on")
    args = parser.parse_args(argv)
    secret = resolve_secret(None)
    if secret is None:
        print(f"store: no {SECRET_ENV}: the store port on {args.host}:{args.port} is only flood-bounded, not "
              "authenticated (sites.insecure; trusted networks only)", flush=True)
    store = host_tcp_store(args.host, args.port, timedelta(hours=24), secret)  # store/guard.py's process
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    parent = os.getppid()
    print(f"store listening on {args.host}:{args.port}", flush=True)
    while not stop and os.getppid() == parent:
        time.sleep(0.5)
    del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
