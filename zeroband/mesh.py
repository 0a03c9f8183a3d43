"""The two kinds of process group a rank belongs to.

- the **site mesh** (axis "fsdp"): every rank of this site, over the fast local network; FSDP2
  shards the model over it. It is the default process group that torchrun sets up; `Topology`
  holds it with the coordination store.
- the **global group** (zeroband/comm/group.py): rank i of every site, built from the
  coordination store; only these groups cross the WAN. A fixed run has one for the whole run
  (`fixed_global_group`), handed to its outer method; an elastic membership builds one per generation.
  Sites of different shapes (issue 26) have one group per lane instead (zeroband/comm/layout.py):
  `Topology.lanes`, the first of which is the group handed on.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zeroband.comm.group import (
    OPEN,
    SECRET,
    GlobalGroup,
    admission_mark,
    incarnation_prefix,
    new_global_group,
    rendezvous,
)
from zeroband.comm.layout import Lane, my_lanes, uniform
from zeroband.comm.link import LinkPolicy
from zeroband.store.client import open_store
from zeroband.store.etcd import EtcdAccess
from zeroband.trust.mac import WireAuth
from zeroband.trust.secret import RunSecret
from zeroband.trust.signed import SignedStore, exchange, stop_keepers
from zeroband.world import World

__all__ = ["OPEN", "SECRET", "GlobalGroup", "Topology", "admission_mark", "fixed_global_group", "init_site_group",
           "gloo_threads", "init_topology", "new_global_group", "rendezvous", "shutdown"]


@dataclass
class Topology:
    world: World
    site_mesh: DeviceMesh | None  # None: never sharded (sim.py's one-rank sites)
    store: dist.Store | None = None  # the coordination store (DiLoCo runs)
    secret: RunSecret | None = None  # the run's shared secret, resolved once (None: one site, or sites.insecure)
    timeout_s: float = 600.0  # sites.timeout_s: how long a cross-site wait may take
    fingerprint: dict[str, str] = field(default_factory=dict)  # settings every site must share (train.py)
    site_ranks: list[int] = field(default_factory=list)  # every site's rank count, once shared (fixed runs)
    # sites of different shapes: this rank's lanes and their groups, in the run's lane order (comm/layout.py)
    lanes: list[tuple[Lane, GlobalGroup]] = field(default_factory=list)

    def site_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Reduce over this site's ranks (a no-op with one rank)."""
        if self.world.ranks_per_site > 1:
            dist.all_reduce(tensor, op=op)


def init_site_group(world: World, timeout: timedelta) -> None:
    """The site's default process group: torchrun's env:// rendezvous, or a 1-rank group."""
    if dist.is_initialized():
        return
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    if "MASTER_ADDR" in os.environ and world.ranks_per_site > 1:
        dist.init_process_group(world.backend, rank=world.rank, world_size=world.ranks_per_site, timeout=timeout)
    else:
        dist.init_process_group(world.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def init_topology(
    world: World, store_address: str | None, run_name: str, timeout_s: float, backend: str, host_store: bool = True,
    secret: RunSecret | None = None, access: EtcdAccess | None = None,
) -> Topology:
    """The site mesh, and (for DiLoCo) the coordination store. The cross-site groups are not part of
    it: `fixed_global_group` builds a fixed run's, an elastic membership one per generation."""
    timeout = timedelta(seconds=timeout_s)
    init_site_group(world, timeout)
    mesh = init_device_mesh(world.device.type, (world.ranks_per_site,), mesh_dim_names=("fsdp",))
    store = None
    if store_address is not None:
        is_host = host_store and world.site_rank == 0 and world.rank == 0
        store = open_store(store_address, is_host, timeout, secret, access)
    return Topology(world, mesh, store, secret, timeout_s=timeout_s)


def fixed_global_group(topology: Topology, run_name: str, backend: str = "gloo", mark: str = OPEN,
                       policy: LinkPolicy | None = None, shapes: Callable[[], list[tuple[int, ...]]] | None = None) -> GlobalGroup:
    """Rank i of every site for the whole run (fixed DiLoCo, cross-site data parallel), over the store.
    With `shapes` (the model's parameter shapes), the sites first share their rank counts: where they
    differ, this rank's lane groups go to `topology.lanes` and the first of them is returned."""
    if shapes is not None:
        topology.site_ranks = share_site_ranks(topology, run_name)
        if not uniform(topology.site_ranks):
            world = topology.world
            for lane in my_lanes(shapes(), topology.site_ranks, world.site_rank, world.rank):
                topology.lanes.append((lane, _lane_group(topology, run_name, lane.name(), backend, mark, policy)))
            return topology.lanes[0][1]
    return _lane_group(topology, run_name, f"shard{topology.world.rank}", backend, mark, policy)


def _lane_group(topology: Topology, run_name: str, name: str, backend: str, mark: str, policy: LinkPolicy | None) -> GlobalGroup:
    """The group `name` (`shard{r}`: rank r of every site) of every site, over the store."""
    world, timeout_s, store = topology.world, topology.timeout_s, topology.store
    assert store is not None, "a global group needs the coordination store (sites.store)"
    auth = WireAuth.from_secret(topology.secret, run_name)
    # a fresh prefix per start: a persistent store's keys of earlier starts are never read
    prefix = incarnation_prefix(store, f"zeroband/{run_name}/{name}/start/", world.site_rank,
                                world.site_count, timeout_s, auth.subkey("arrive"))
    return new_global_group(store, prefix, world.site_rank, world.site_count, timedelta(seconds=timeout_s),
                            backend, mark=mark, auth=auth, policy=policy)


def share_site_ranks(topology: Topology, run_name: str) -> list[int]:
    """Every site's rank count, in site order: rank 0 of each site publishes its own under this start's
    fresh prefix (signed with the run's secret), reads the others' and hands the list to its site."""
    world, timeout_s, store = topology.world, topology.timeout_s, topology.store
    assert store is not None, "sharing site shapes needs the coordination store (sites.store)"
    counts = torch.zeros(world.site_count, dtype=torch.int64, device=world.device)
    if world.rank == 0:
        auth = WireAuth.from_secret(topology.secret, run_name)
        prefix = incarnation_prefix(store, f"zeroband/{run_name}/shapes/start/", world.site_rank, world.site_count,
                                    timeout_s, auth.subkey("arrive"))
        keys = {s: f"{prefix}ranks/{s}" for s in range(world.site_count)}
        values = exchange(SignedStore(store, auth.subkey("shapes")), keys, world.site_rank, str(world.ranks_per_site),
                          "sharing every site's rank count", timeout_s)
        counts = torch.tensor([int(values[s] or b"0") for s in range(world.site_count)], device=world.device)
    if world.ranks_per_site > 1:
        dist.broadcast(counts, src=0)
    return [int(c) for c in counts.tolist()]


# Native threads of a ProcessGroupGloo: its work loops and gloo's transport loop (/proc comm names)
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def shutdown(topology: Topology | None = None, *groups: GlobalGroup | None) -> None:
    """Deterministic exit: every thread that may call into torch is ended here, in this order, while
    the interpreter is fully alive, never left to its finalization.

    Why (issue 23): at finalization CPython 3.11 ends any other thread that next takes the GIL with
    pthread_exit; inside a C++ frame (a c10d store call or torch op returning, a gloo worker dropping
    the last reference to a tensor that Python created) that unwinding meets a noexcept destructor and
    the process dies with "terminate called without an active exception" (SIGABRT) after its run.
    ProcessGroupGloo's destructor releases the GIL while it joins its workers, so a site group
    destroyed by finalization (module teardown) is one such case. `destroy_process_group` only
    unregisters it: the object, its two work loops and gloo's transport loop live on for as long as
    the site mesh references it. Hence:

    1. the cross-site groups `groups` and the topology's lane groups close (transport threads joined);
    2. garbage is collected while the process group exists: a finished run's model, optimizer and
       FSDP state form reference cycles holding gloo works and their tensors;
    3. the process group is destroyed and the topology's site mesh, its last owner, dropped: the
       C++ group is freed now, on this thread, joining its threads (`gloo_threads` is then empty,
       unless the caller still holds the model or the mesh).
    """
    stop_keepers()  # the store values this site kept for slower peers (trust/signed.py): nobody is left to read them
    lanes = [g for _, g in topology.lanes] if topology is not None else []
    for group in [*groups, *lanes]:
        if group is not None:
            group.close()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if topology is not None:
        topology.site_mesh = None
        topology.lanes.clear()
        _forget_dtensor_caches()
        gc.collect()


def _forget_dtensor_caches() -> None:
    """DTensor keeps every mesh it saw in caches (sharding propagation in Python and C++, redistribution
    planners, mesh topology, transform plans: lru_caches keyed by specs that hold the mesh), so the site
    mesh and its process group would live as long as the process. They are only caches: emptied here,
    every torch.distributed lru_cache found among the live objects included, so the group can be freed
    at shutdown. tests/integration/test_exit.py fails should a torch upgrade keep the mesh elsewhere."""
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_sharding_prop_cache()
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    for obj in [*gc.get_objects(), *_module_level_objects("torch.distributed")]:
        # type(), not isinstance(): isinstance reads __class__, and torch.distributed.reduce_op's
        # __getattribute__ warns (FutureWarning) on any attribute read.
        if type(obj) is functools._lru_cache_wrapper and str(getattr(obj, "__module__", "")).startswith(
                "torch.distributed"):
            obj.cache_clear()


def _module_level_objects(package: str) -> list[object]:
    """The globals of `package`'s loaded modules and the attributes of their classes (a static or class
    method's function): objects made at import. gc.get_objects() misses them where the importing
    process froze its heap (gc.freeze) before forking this one, as tests/multiproc.py does."""
    found: list[object] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for value in list(vars(module).values()):
            found.append(value)
            if issubclass(type(value), type):  # a class (not isinstance: see _forget_dtensor_caches)
                found.extend(v.__func__ if type(v) in (staticmethod, classmethod) else v for v in vars(value).values())
    return found


def gloo_threads() -> list[str]:
    """The live native threads of gloo process groups in this process (Linux; [] elsewhere)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # ended while listed
            continue
        if name in GLOO_THREADS:
            names.append(name)
    return sorted(names)
