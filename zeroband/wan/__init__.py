"""WAN emulation on one Linux machine: network namespaces per site, rate/delay/jitter/loss links;
a delaying TCP relay for one peer's connections (relay.py)."""

from zeroband.wan.emulator import WanEmulator, cleanup_stale, netem_available

__all__ = ["WanEmulator", "cleanup_stale", "netem_available"]
