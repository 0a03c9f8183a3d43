"""Who is in the run: a coordination store that survives the loss of a site, and admission of sites
(shared secret + config fingerprint) before they may join a generation's process groups."""

from zeroband.membership.auth import PeerRefused, Verdict, admit, decide, flatten_fingerprint, load_secret
from zeroband.membership.etcd import EtcdStore, StoreTimeout, StoreUnavailable
from zeroband.membership.store import open_store

__all__ = [
    "EtcdStore", "PeerRefused", "StoreTimeout", "StoreUnavailable", "Verdict", "admit", "decide",
    "flatten_fingerprint", "load_secret", "open_store",
]
