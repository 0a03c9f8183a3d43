"""Keys, tags and sealing: the run secret, admission proofs, per-session message keys, signed
store values. The lowest layer of cross-site code: it imports nothing above zeroband/watchdog.py."""

from zeroband.trust.auth import PeerRefused, Verdict, admit, decide, flatten_fingerprint
from zeroband.trust.secret import RunSecret, resolve_secret

__all__ = ["PeerRefused", "RunSecret", "Verdict", "admit", "decide", "flatten_fingerprint", "resolve_secret"]
