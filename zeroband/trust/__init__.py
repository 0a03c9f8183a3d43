"""Keys, tags and sealing: the run secret, admission proofs, per-session message keys, signed
store values. The lowest layer of cross-site code: it imports nothing above zeroband/watchdog.py."""

from zeroband.trust.auth import PeerRefused, Verdict, admit, decide, flatten_fingerprint, load_secret

__all__ = ["PeerRefused", "Verdict", "admit", "decide", "flatten_fingerprint", "load_secret"]
