"""A stranger's flood of a TCP port (issue 23 item 5), as its own process (stdlib only, so it starts fast).

    python tests/flood_store.py HOST PORT [--conns 20000] [--wave 5000] [--stall 600] [--forever]
                                          [--rate 2000] [--source 127.0.0.2] [--empty] [--seconds 60]

- `--stall` connections each send 1 byte and then say nothing, held open the whole time (one the
  target closes is replaced at the next wave);
- `--conns` connections each send 8 bytes, opened `--wave` at a time: a wave is held open until it
  is complete, then reset (SO_LINGER 0: no TIME_WAIT on either side eats the ephemeral ports). This
  process raises its RLIMIT_NOFILE soft limit to the hard one; where that is under conns + stall
  (20,000 here), the connections cannot all be open at once, hence the waves.
- `--forever`: waves until SIGTERM (or `--seconds`, a bound on the whole flood);
- `--rate`: wave connections paced to this many per second (default: as fast as they open);
  `--source`: the local address they are opened from; `--empty`: they send nothing.

Prints one JSON line when done: connections opened and failed, waves, and the peak held at once.
"""

from __future__ import annotations

import argparse
import json
import resource
import select
import signal
import socket
import struct
import sys
import time


def _open(addr: tuple[str, int], payload: bytes, source: str | None = None) -> socket.socket | None:
    s = socket.socket()
    s.settimeout(1.0)
    try:
        if source:
            s.bind((source, 0))
        s.connect(addr)
        if payload:
            s.send(payload)
        return s
    except OSError:
        s.close()
        return None


def _reset(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        s.close()


def _alive(socks: list[socket.socket]) -> list[socket.socket]:
    """The stalled connections the target has not closed (a guard's challenge is read and ignored)."""
    readable = set()
    for i in range(0, len(socks), 500):  # select() is limited to fds < 1024: poll instead
        poller = select.poll()
        for s in socks[i:i + 500]:
            poller.register(s, select.POLLIN)
        readable |= {fd for fd, _ in poller.poll(0)}
    keep, dead = [], []
    for s in socks:
        if s.fileno() in readable:
            try:
                s.setblocking(False)
                data = s.recv(4096)
            except OSError:
                data = b""
            (keep if data else dead).append(s)
        else:
            keep.append(s)
    _reset(dead)
    return keep


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--conns", type=int, default=20000)
    parser.add_argument("--wave", type=int, default=5000)
    parser.add_argument("--stall", type=int, default=600)
    parser.add_argument("--forever", action="store_true")
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--source", default=None)
    parser.add_argument("--empty", action="store_true")
    parser.add_argument("--seconds", type=float, default=float("inf"))
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    addr = (args.host, args.port)
    stats = {"opened": 0, "failed": 0, "waves": 0, "stalled": 0, "peak_open": 0, "nofile": hard}
    stalled: list[socket.socket] = []
    t0 = time.monotonic()
    payload = b"" if args.empty else b"\x00" * 8
    while not stop and (args.forever or stats["opened"] < args.conns) and time.monotonic() - t0 < args.seconds:
        stalled = _alive(stalled)
        while len(stalled) < args.stall and (s := _open(addr, b"\x00", args.source)) is not None:
            stalled.append(s)
            stats["stalled"] += 1
        wave = []
        for _ in range(min(args.wave, args.conns - stats["opened"]) if not args.forever else args.wave):
            if args.rate:  # the n-th connection no earlier than n / rate after the start
                time.sleep(max(0.0, t0 + (stats["opened"] + stats["failed"]) / args.rate - time.monotonic()))
            s = _open(addr, payload, args.source)
            if s is None:
                stats["failed"] += 1
                if not wave:
                    break  # nothing listens (yet): try again in a moment
                continue
            wave.append(s)
            stats["opened"] += 1
            if stop:
                break
        stats["peak_open"] = max(stats["peak_open"], len(wave) + len(stalled))
        stats["waves"] += 1
        _reset(wave)
        if not wave:
            if stats["failed"] > 20000:
                break
            time.sleep(0.1)
    _reset(stalled)
    stats["seconds"] = round(time.monotonic() - t0, 2)
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
