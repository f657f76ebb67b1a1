"""`RolloutCluster`: everything a rollout needs on Ray, started in one order and torn down in the reverse one.

    with RolloutCluster(cfg) as cluster:            # model resolved at construction (before Ray starts)
        out = await cluster.manager.generate_sequences_async(batch)
        cluster.replicas, cluster.reward_workers    # the actor handles

`start()`: (1) join the cluster at `RAY_ADDRESS` (or `ray_address`) or start a local Ray, and say which (address,
nodes, CPUs, GPUs); (2) the replicas, placed by `replicas.placement` / `replicas.resources` (one placement-group
bundle per replica); (3) the reward workers (`reward.placement` / `reward.resources`; none without reward
functions or with `with_rewards=False`); (4) the `AgentLoopManager` and its workers (`agent.placement` /
`agent.resources`). `close()` undoes them in reverse, each step attempted whatever the previous one did (a start that
fails midway closes what it started and re-raises); Ray is shut down only if this cluster started it.

Faults: a node that leaves the cluster costs time, never a sample. Its replicas are gone (their weights are the
trainer's: a restart could not serve the current version): their requests re-run on the survivors (the routing
client), and `prune()` drops them (the trainer calls it before each weight sync). Its reward and agent-loop workers
hold no state: Ray restarts them on a node with room for them (`omniroll.ray_nodes.RESTARTED`), and their samples
are re-scored and their chunks re-run (`RewardWorkerPool`, `AgentLoopManager`). Used by `omniroll rollout`,
`omniroll train` (`Trainer.start` / `close`), `omniroll serve --config` and the benchmarks.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from omniroll.config import OmniRollConfig, load_config


def _stderr(msg: str) -> None:
    print(f"[omniroll] {msg}", file=sys.stderr, flush=True)


class RolloutCluster:
    """config: an OmniRollConfig (or a path / dict). ray_address: a cluster to join (default: `RAY_ADDRESS`, else a
    local Ray). log: where the start-up lines go (None: silent)."""

    def __init__(self, config: Any, ray_address: Optional[str] = None, with_rewards: bool = True,
                 with_manager: bool = True, log: Optional[Callable[[str], None]] = _stderr):
        from omniroll.models import resolve_model

        self.config: OmniRollConfig = config if isinstance(config, OmniRollConfig) else load_config(config)
        self.ray_address = ray_address
        self.with_rewards, self.with_manager = with_rewards, with_manager
        self.log = log or (lambda msg: None)
        self.model: str = resolve_model(self.config.engine.model)  # a bad model fails before Ray starts
        self.info = None  # omniroll.rollout.ray_cluster.ClusterInfo once started
        self.replicas: list = []
        self.replica_nodes: list[Optional[str]] = []  # node id per replica, same order
        self.reward_workers: list = []
        self.manager = None
        self._placements: list = []

    # ------------------------------------------------------------------ start / close
    def start(self) -> "RolloutCluster":
        from omniroll.rollout.ray_cluster import connect_ray, describe

        try:
            self.info = connect_ray(self.ray_address)
            self.log(describe(self.info))
            self._start_replicas()
            if self.with_rewards and self.config.reward.functions and self.config.reward.num_workers > 0:
                self._start_reward_workers()
            if self.with_manager:
                self._start_manager()
            self._await_replicas()  # the workers' processes start while the replicas load their model
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Tear down in reverse order of `start`; every step runs (best effort), nothing raises."""
        import ray

        from omniroll.ray_nodes import kill_actors

        if self.manager is not None:
            self.manager.shutdown()
            self.manager = None
        kill_actors(self.reward_workers)
        self.reward_workers = []
        kill_actors(self.replicas)
        self.replicas, self.replica_nodes = [], []
        for p in reversed(self._placements):
            p.remove()
        self._placements = []
        if self.info is not None and self.info.started and ray.is_initialized():
            ray.shutdown()
        self.info = None

    def __enter__(self) -> "RolloutCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the pieces
    def _placement(self, field: str, count: int, bundle: dict, strategy: str):
        from omniroll.rollout.ray_cluster import ActorPlacement

        p = ActorPlacement.create(field, count, bundle, strategy)
        self._placements.append(p)
        return p

    def _start_replicas(self) -> None:
        from omniroll.rollout.ray_cluster import bundle_for
        from omniroll.rollout.replica import create_replicas

        rc = self.config.replicas
        self.log(f"starting {rc.count} replica(s) of {self.model} ({rc.placement})")
        where = self._placement("replicas.placement", rc.count,
                                bundle_for(rc.num_cpus, rc.num_gpus, rc.resources), rc.placement)
        self.replicas = create_replicas(rc.count, self.model, self.config.engine.engine_kwargs(),
                                        num_cpus=rc.num_cpus, num_gpus=rc.num_gpus,
                                        max_concurrency=rc.max_concurrency, resources=rc.resources,
                                        placement=where.options, wait_ready=False)

    def _await_replicas(self) -> None:
        """Block until every replica's engine is loaded (a bad model path or OOM raises here, and `start` tears
        everything down), then learn their nodes."""
        import ray

        from omniroll.ray_nodes import actor_node_ids

        ray.get([h.health.remote() for h in self.replicas])
        self.replica_nodes = actor_node_ids(self.replicas, timeout_s=30.0)
        nodes = sorted({n for n in self.replica_nodes if n})
        self.log(f"{len(self.replicas)} replica(s) on {len(nodes)} node(s): "
                 + ", ".join(f"{n[:8]} x{self.replica_nodes.count(n)}" for n in nodes))

    def _start_reward_workers(self) -> None:
        from omniroll.reward import create_reward_workers
        from omniroll.rollout.ray_cluster import bundle_for

        rs = self.config.reward
        where = self._placement("reward.placement", rs.num_workers, bundle_for(0.0, 0.0, rs.resources), rs.placement)
        self.reward_workers = create_reward_workers(rs.worker_config(), rs.num_workers, resources=rs.resources,
                                                    placement=where.options)

    def _start_manager(self) -> None:
        from omniroll.agent_loop.manager import AgentLoopManager
        from omniroll.rollout.ray_cluster import bundle_for

        ag = self.config.agent
        where = self._placement("agent.placement", ag.num_workers, bundle_for(0.0, 0.0, ag.resources), ag.placement)
        opts = {"resources": dict(ag.resources)} if ag.resources else {}
        self.manager = AgentLoopManager(self.config, self.replicas, self.reward_workers or None,
                                        worker_options=opts, placement=where.options)

    # ------------------------------------------------------------------ nodes and faults
    def prune(self) -> list[dict]:
        """Drop the replicas whose actors are gone (their node left the cluster); returns them as [{"replica": index
        before pruning, "node_id": ...}]. The routing clients already stop using a dead replica at its first failed
        call (the call is re-run elsewhere, same seed); pruning keeps the trainer's weight sync to the survivors. Reward
        and agent-loop workers are not pruned: Ray restarts them (`omniroll.ray_nodes.RESTARTED`)."""
        alive = _alive(self.replicas)
        lost = [{"replica": i, "node_id": self.replica_nodes[i]} for i, ok in enumerate(alive) if not ok]
        if lost and not any(alive):
            raise RuntimeError(f"every rollout replica is gone (nodes {sorted({str(x['node_id']) for x in lost})})")
        self.replicas = [h for h, ok in zip(self.replicas, alive) if ok]
        self.replica_nodes = [n for n, ok in zip(self.replica_nodes, alive) if ok]
        return lost


def _alive(handles: list, timeout_s: float = 30.0) -> list[bool]:
    """Whether each actor still answers (Ray's built-in readiness call; an actor on a node that left is dead)."""
    import ray

    refs = [h.__ray_ready__.remote() for h in handles]
    out = []
    for r in refs:
        try:
            ray.get(r, timeout=timeout_s)
            out.append(True)
        except Exception:  # noqa: BLE001 - dead, or unreachable for timeout_s: either way not usable now
            out.append(False)
    return out
