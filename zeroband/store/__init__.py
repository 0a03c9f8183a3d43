"""Coordination stores: the guarded c10d TCPStore server, its clients, and the etcd client.
Sits above zeroband/trust/ and below zeroband/comm/ and zeroband/membership/."""

from zeroband.store.client import open_store
from zeroband.store.etcd import EtcdStore, StoreTimeout, StoreUnavailable

__all__ = ["EtcdStore", "StoreTimeout", "StoreUnavailable", "open_store"]
