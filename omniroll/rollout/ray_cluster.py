"""Ray itself: join a cluster or start a local one, say which, and place actors (pack / spread, custom resources).

    info = connect_ray(address=None)      # RAY_ADDRESS or `address` joins that cluster; otherwise a local one starts
    print(describe(info))                 # "Ray: joined 10.0.0.1:6379 (3 nodes, 24 CPUs, 8 GPUs)"
    group = ActorPlacement.create("replicas", 4, {"CPU": 1, "GPU": 1}, "spread")
    options = group.options(i)            # for ray.remote(...).options(**options): bundle i of the group
    group.remove()

`pack` and `spread` are Ray placement-group strategies (`PACK`, `SPREAD`) with one bundle per actor: `spread` puts
actors on distinct nodes when it can. An actor that asks for no resource at all (reward and agent-loop workers take
no CPU by default) has no bundle to place: `spread` then uses Ray's SPREAD scheduling strategy and `pack` leaves it
to Ray. Nothing here knows about omniroll's actors; `omniroll.agent_loop.cluster.RolloutCluster` composes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

PLACEMENTS = ("pack", "spread")


@dataclass
class ClusterInfo:
    """Which Ray this process talks to. `mode`: "joined" (an existing cluster at `address`), "local" (started here)
    or "attached" (Ray was already initialised in this process); `started` says whether `connect_ray` started it."""

    mode: str
    address: str
    nodes: int
    cpus: float
    gpus: float
    started: bool


def connect_ray(address: Optional[str] = None, num_cpus: Optional[int] = None) -> ClusterInfo:
    """Join the cluster at `address` (else `RAY_ADDRESS`), or start a local one (never a `ray start` cluster that
    happens to run on this machine); reuse Ray when already initialised."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        mode, started = "attached", False
    elif address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        mode, started = "joined", True
    else:
        kw = {} if num_cpus is None else {"num_cpus": num_cpus}
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False, **kw)
        mode, started = "local", True
    res = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return ClusterInfo(mode, ray.get_runtime_context().gcs_address, nodes, float(res.get("CPU", 0)),
                       float(res.get("GPU", 0)), started)


def describe(info: ClusterInfo) -> str:
    what = {"joined": "joined", "local": "started a local cluster at", "attached": "using the cluster at"}[info.mode]
    return f"Ray: {what} {info.address} ({info.nodes} node(s), {info.cpus:g} CPUs, {info.gpus:g} GPUs)"


def node_address(node_id: str) -> Optional[str]:
    """The IP address of a live node (None when it is gone)."""
    import ray

    for n in ray.nodes():
        if n.get("NodeID") == node_id and n.get("Alive"):
            return n.get("NodeManagerAddress")
    return None


def bundle_for(num_cpus: float = 0.0, num_gpus: float = 0.0, resources: Optional[dict] = None) -> dict:
    """One actor's resources as a placement-group bundle (zero amounts left out)."""
    b = {"CPU": float(num_cpus), "GPU": float(num_gpus), **{str(k): float(v) for k, v in (resources or {}).items()}}
    return {k: v for k, v in b.items() if v > 0}


class ActorPlacement:
    """Where the `count` actors of one role go: a placement group with one bundle per actor (or, for actors that ask
    for nothing, Ray's own scheduling). `field` names the config key in errors (e.g. "replicas.placement")."""

    def __init__(self, field: str, count: int, bundle: dict, strategy: str, group: Any = None):
        self.field, self.count, self.bundle, self.strategy, self.group = field, count, bundle, strategy, group

    @classmethod
    def create(cls, field: str, count: int, bundle: dict, strategy: str = "pack",
               timeout_s: float = 60.0) -> "ActorPlacement":
        """Reserve the bundles now; raises ValueError naming `field` when the cluster cannot hold them in time."""
        if strategy not in PLACEMENTS:
            raise ValueError(f"{field}: must be one of {PLACEMENTS}, got {strategy!r}")
        if not bundle or count < 1:
            return cls(field, count, bundle, strategy)
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([dict(bundle) for _ in range(count)], strategy=strategy.upper())
        if not group.wait(timeout_seconds=timeout_s):
            remove_placement_group(group)
            raise ValueError(f"{field}: {count} x {bundle} could not be placed ({strategy}) within {timeout_s:g}s; "
                             f"the cluster has {_resources()} (lower the count or the per-actor resources, or add "
                             f"nodes that have them)")
        return cls(field, count, bundle, strategy, group)

    def options(self, index: int) -> dict:
        """`ray.remote(...).options(**this)` for actor `index`: its bundle, or Ray's scheduling strategy."""
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=index, placement_group_capture_child_tasks=False)}
        return {"scheduling_strategy": "SPREAD"} if self.strategy == "spread" else {}

    def remove(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - best effort: Ray may be gone already
                pass


def _resources() -> str:
    import ray

    res = ray.available_resources()
    keep = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store_memory"))}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) + " available"
