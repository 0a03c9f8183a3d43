"""One torchft DiLoCo replica group (1 rank) training zeroband's model on zeroband's data.

Started by scripts/bench_torchft.py, once per replica, optionally inside a WAN-emulator namespace:

    python scripts/torchft_worker.py --replica 0 --replicas 2 --lighthouse http://127.0.0.1:29510 \
        --host 127.0.0.1 --result out/replica0.json -- <zeroband config overrides>

Everything but the outer loop is zeroband's own code: `load_config`, `Llama` + `init_weights(seed)`,
`PackedBatches` (dp_rank = replica, dp_size = replicas), `build_optimizer`/`build_scheduler`, and the
trainer's `forward_backward`/`optimizer_step`. The outer loop is torchft's `DiLoCo` + `Manager` over
its reconfigurable `ProcessGroupGloo`. Per step it records the wall time, the loss and the time
spent in DiLoCo's optimizer post-hook (where torchft's quorum, all-reduce and outer step run); per
sync the quorum time and, inside a namespace, the bytes `wan0` counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/demo_diloco.toml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="http://host:port of torchft_lighthouse")
    p.add_argument("--host", default="127.0.0.1", help="address this replica advertises (store, manager)")
    p.add_argument("--result", type=Path, required=True, help="JSON file written at the end")
    p.add_argument("--timeout", type=float, default=300.0, help="torchft collective / quorum timeout, s")
    p.add_argument("--bucket-mb", type=int, default=0, help="DiLoCo use_bucketization with this cap; 0: per parameter")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then zeroband --section.key value overrides")
    args = p.parse_args(argv)
    args.overrides = [o for o in args.overrides if o != "--"]
    return args


def iface_counters() -> dict[str, int] | None:
    """tx/rx bytes of this namespace's WAN interface (`ip netns exec` mounts the namespace's sysfs)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "")
    base = Path("/sys/class/net") / name / "statistics"
    if name in ("", "lo") or not base.is_dir():
        return None
    return {k: int((base / f"{k}_bytes").read_text()) for k in ("tx", "rx")}


class Recorder:
    """Per-step and per-sync timings, filled in by wrappers around torchft's hooks."""

    def __init__(self) -> None:
        self.step_end: list[float] = []
        self.losses: list[float] = []
        self.hook_s: list[float] = []
        self.syncs: list[dict[str, Any]] = []
        self._quorum_s = 0.0

    def wrap_hook(self, hook: Callable[..., None], sync_every: int) -> Callable[..., None]:
        def timed(*a: Any) -> None:
            sync = (len(self.hook_s) + 1) % sync_every == 0
            before, t0 = (iface_counters() if sync else None), time.time()
            hook(*a)
            t1 = time.time()
            self.hook_s.append(t1 - t0)
            if sync:
                self.syncs.append(self._sync_record(t0, t1, before))

        return timed

    def wrap_quorum(self, start_quorum: Callable[..., None]) -> Callable[..., None]:
        def timed(*a: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            start_quorum(*a, **kw)
            self._quorum_s = time.perf_counter() - t0

        return timed

    def _sync_record(self, t0: float, t1: float, before: dict[str, int] | None) -> dict[str, Any]:
        rec: dict[str, Any] = {"step": len(self.hook_s), "start": t0, "end": t1, "sync_s": t1 - t0,
                               "quorum_s": self._quorum_s}
        after = iface_counters()
        if before is not None and after is not None:
            rec.update(tx_bytes=after["tx"] - before["tx"], rx_bytes=after["rx"] - before["rx"])
        return rec


def build(cfg: Any, replica: int, replicas: int) -> tuple[Any, Any, Any, list]:
    """Model (seeded like zeroband's), inner AdamW + schedule, this replica's data, the val batches."""
    import torch

    from zeroband.data.loader import PackedBatches
    from zeroband.data.tokenizer import TextTokenizer
    from zeroband.models.llama import Llama
    from zeroband.optim import build_optimizer, build_scheduler

    torch.manual_seed(cfg.train.seed)
    tokenizer = TextTokenizer.load(cfg.data.tokenizer)
    data = PackedBatches(cfg.data, tokenizer, replica, replicas, "train")
    val = PackedBatches(cfg.data, tokenizer, 0, 1, "val").val_batches(cfg.eval.batches, cfg.train.micro_batch)
    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    optimizer = build_optimizer(list(model.parameters()), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    return model, (optimizer, scheduler), data, val


def make_manager(args: argparse.Namespace) -> tuple[Any, Any]:
    """This replica group's TCPStore (it is the group's only rank) and a synchronous-quorum Manager."""
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=args.timeout)
    store = TCPStore(args.host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
        min_replica_size=args.replicas, use_async_quorum=False,  # DiLoCo requires a synchronous quorum
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
        store_addr=args.host, store_port=store.port, lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}", hostname=args.host,
        init_sync=False,  # every replica starts from the same seeded weights, as in zeroband
    )
    return store, manager


def run_steps(args: argparse.Namespace, cfg: Any, rec: Recorder) -> tuple[Any, list]:
    import torch
    from torchft.local_sgd import DiLoCo

    from zeroband.step import forward_backward, optimizer_step

    model, (optimizer, scheduler), data, val = build(cfg, args.replica, args.replicas)
    store, manager = make_manager(args)
    h = cfg.diloco.inner_steps
    outer = torch.optim.SGD(model.parameters(), lr=cfg.diloco.outer_lr, momentum=cfg.diloco.outer_momentum,
                            nesterov=cfg.diloco.nesterov and cfg.diloco.outer_momentum > 0)
    manager.start_quorum = rec.wrap_quorum(manager.start_quorum)
    bucket = {"use_bucketization": True, "bucket_cap_mb": args.bucket_mb} if args.bucket_mb else {}
    diloco = DiLoCo(manager, [model], optimizer, outer, sync_every=h, pin_memory=False, **bucket)
    diloco._step_post_hook = rec.wrap_hook(diloco._step_post_hook, h)  # before __enter__ registers it
    accum, device = cfg.grad_accum_steps(1), torch.device("cpu")
    try:
        with diloco:
            for _ in range(cfg.train.steps):
                batches = [data.next_batch(cfg.train.micro_batch) for _ in range(accum)]
                rec.losses.append(forward_backward(model, batches, device).item())
                optimizer_step(model, optimizer, cfg.optim.grad_clip)  # the sync runs in its post-hook
                scheduler.step()
                rec.step_end.append(time.time())
    finally:
        manager.shutdown(wait=False)
        del store
    return model, val


def val_loss(model: Any, batches: list) -> float:
    import torch

    from zeroband.models.llama import cross_entropy_loss

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            total += cross_entropy_loss(model(inputs), targets).item() * targets.numel()
            count += targets.numel()
    return total / count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.result = args.result.resolve()
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    from importlib.metadata import version

    import torch

    from zeroband.config import load_config

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(CONFIG, args.overrides)
    rec, t_start = Recorder(), time.time()
    model, val = run_steps(args, cfg, rec)
    params = sum(p.numel() for p in model.parameters())
    result = {
        "replica": args.replica, "replicas": args.replicas, "bucket_mb": args.bucket_mb, "torchft_version": version("torchft"),
        "torch_version": torch.__version__, "threads": torch.get_num_threads(), "start": t_start,
        "step_end": rec.step_end, "losses": rec.losses, "hook_s": rec.hook_s, "syncs": rec.syncs,
        "val_loss": val_loss(model, val), "numel": params, "payload_bytes": 4 * params,
        "param_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    args.result.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
