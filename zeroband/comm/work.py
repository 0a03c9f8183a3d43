"""What the global group needs of a process group and of its works, as structural types: torch's
c10d groups (ProcessGroupNCCL) and works satisfy them, and so do zeroband's transport (comm/transport.py).
Work itself lives in zeroband/watchdog.py, a layer below comm, which waits on works."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zeroband.watchdog import Work  # defined below comm's layer: Watch.wait takes it


class ProcessGroupLike(Protocol):
    """The point-to-point and collective calls the global group makes (comm/group.py, comm/direct.py)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> Work: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: Any, /) -> Work: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: Any, /) -> Work: ...
