"""Open the coordination store that cross-site process groups are formed through, by address.

- `tcp://host:port`: a c10d TCPStore whose server runs inside one process (`is_host`). Cheap and
  dependency-free, but a single point of failure: when the host site dies no group can be formed.
- `etcd://h1:p1,h2:p2,h3:p3[/prefix]`: an EtcdStore on an etcd cluster (a member per site, 3+);
  it keeps working while a majority of members is up, so surviving sites can still regroup.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from zeroband.membership.etcd import EtcdStore, parse_endpoints

DEFAULT_ETCD_PREFIX = "zeroband"


def open_store(address: str, is_host: bool, timeout: timedelta) -> dist.Store:
    """The store at `address`. `is_host` only matters for tcp:// (that process runs the server)."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise ValueError(f"store address {address!r} needs a scheme: tcp://host:port or etcd://h1:p1,h2:p2/prefix")
    if scheme == "tcp":
        return _tcp_store(address, is_host, timeout)
    if scheme == "etcd":
        hosts, _, prefix = rest.partition("/")
        return EtcdStore(parse_endpoints(hosts), prefix.strip("/") or DEFAULT_ETCD_PREFIX, timeout)
    raise ValueError(f"store address {address!r}: unknown scheme {scheme!r} (use tcp:// or etcd://)")


def _tcp_store(address: str, is_host: bool, timeout: timedelta) -> dist.TCPStore:
    url = urlparse(address)
    if url.hostname is None or url.port is None:
        raise ValueError(f"store address {address!r} must look like tcp://host:port")
    return dist.TCPStore(
        url.hostname, url.port, is_master=is_host, timeout=timeout, wait_for_workers=False, use_libuv=True
    )
