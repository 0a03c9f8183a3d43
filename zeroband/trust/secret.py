"""The run's shared secret: resolved once, at the start of a command, into one object handed down.

Where it comes from, in this order: `sites.secret` (read by the config from `sites.secret_file` or a
config file, both mode 0600 only: zeroband/config.py), then the ZEROBAND_SECRET environment variable.
Never the command line: the CLI refuses every form of it before anything runs. `resolve_secret` is
the only function that reads either source; `train` calls it once per process (before any port
opens), `zeroband export` and `zeroband launch` once per command, and everything else gets the
`RunSecret` it returned: admission (trust/auth.py), message tags and store values (trust/mac.py,
trust/signed.py), checkpoint signatures (checkpoint.py).

A `RunSecret` never shows its value: its repr and str say only where it came from, it refuses to be
pickled (so it cannot reach a config dump, a metrics file or a child's argv by accident), and
`derive(label)` is the only way to use it: scrypt with the label as salt (n = 2^14, r = 8: 16 MiB
per guess at the secret; its time: benchmarks/kernels.md), computed once per label and process.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from typing import Any, overload

log = logging.getLogger(__name__)

SECRET_ENV = "ZEROBAND_SECRET"
MIN_SECRET_BYTES = 16
SALT = b"zeroband-admit-v1"  # the label every key of the secret is salted with (kept: keys stay the same)


def derive_key(secret: bytes, label: str) -> bytes:
    """Slow, salted key derivation: proofs on the store must not make guessing the secret cheap."""
    return hashlib.scrypt(secret, salt=SALT + b"|" + label.encode(), n=2**14, r=8, p=1, dklen=32)


class RunSecret:
    """The shared secret of a run. Use `derive(label)`; the value itself never leaves this object."""

    __slots__ = ("_value", "_keys", "source")

    def __init__(self, value: bytes, source: str) -> None:
        if len(value) < MIN_SECRET_BYTES:
            raise ValueError(f"the shared secret ({source}) is {len(value)} bytes; use at least {MIN_SECRET_BYTES} "
                             "random bytes (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        self._value, self.source = value, source
        self._keys: dict[str, bytes] = {}

    def derive(self, label: str) -> bytes:
        """A 32-byte key for one use (`label`: an admission prefix, a run's wire label, checkpoint signing)."""
        if label not in self._keys:
            self._keys[label] = derive_key(self._value, label)
        return self._keys[label]

    def __repr__(self) -> str:
        return f"RunSecret(<hidden>, from {self.source})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunSecret) and hmac.compare_digest(self._value, other._value)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        raise TypeError("a RunSecret is never pickled: hand it down in the process that resolved it")


@overload
def as_secret(secret: None) -> None: ...
@overload
def as_secret(secret: RunSecret | bytes) -> RunSecret: ...
def as_secret(secret: RunSecret | bytes | None) -> RunSecret | None:
    """A RunSecret from what a caller holds (tests and tools may hand raw bytes)."""
    return RunSecret(secret, "the caller") if isinstance(secret, bytes) else secret


def resolve_secret(config_value: str | None, insecure: bool = False, site_count: int = 1) -> RunSecret | None:
    """The run's secret, from `sites.secret` (a 0600 file) or $ZEROBAND_SECRET; None when there is
    none, which only a one-site run or `sites.insecure` may start with (one loud warning). Errors are
    one-line ConfigErrors that never echo the secret."""
    from zeroband.config import ConfigError  # config sits above trust/: imported only to raise its error

    value, source = (config_value, "sites.secret") if config_value else (os.environ.get(SECRET_ENV), SECRET_ENV)
    if value:
        try:
            return RunSecret(value.encode(), source)
        except ValueError as e:
            raise ConfigError(f"sites.secret: {e}") from None
    if site_count <= 1:
        return None
    if not insecure:
        raise ConfigError(
            f"sites.secret: a {site_count}-site run needs a shared secret, or anyone who reaches the ports can "
            f"join and corrupt it. Fix: export {SECRET_ENV}=<random string, same on every site>, or set "
            "sites.secret_file to a file of mode 0600 holding it, or sites.insecure = true to run "
            "unauthenticated (trusted networks only)"
        )
    if not _warned:
        _warned.append(True)
        log.warning("sites.insecure = true: cross-site messages are NOT authenticated nor encrypted; anyone who can "
                    "reach the store or the sites' ports can join the run or forge its messages, and anyone on "
                    "the path reads the model")
    return None


_warned: list[bool] = []
