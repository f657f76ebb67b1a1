"""`RankGroup`: the trainer's data-parallel update (`trainer.world_size` N > 1; docs/training/data_parallel.md): N
`TrainerRank` Ray actors (omniroll/train/parallel/rank.py), placed by `trainer.placement` / `trainer.resources` (one
placement-group bundle each, the replicas' rules), in one torch.distributed process group.

The driver (`Trainer`) keeps the rollout, the advantages (on the whole batch), logging, checkpoints and the
weight push. Each step `update` splits the batch by whole prompt groups (omniroll/train/parallel/shard.py), ships every
rank its shard through the Ray object store, waits for all of them, adopts rank 0's weights and algorithm state into
the driver's policy and algorithm (what it pushes to the replicas, logs and checkpoints) and returns the merged
`UpdateResult`. The optimizer state stays with the
ranks, which write it to `state_dir` every step (each its shard under FSDP2, or rank 0 the replicated one); the driver
reads it only to write a checkpoint (`optimizer_state`). A rank that dies or fails ends the step with
`TrainerRankError`, one line naming the rank and its node; the other ranks are stopped, and the driver writes the last
completed step's checkpoint from its weights and the ranks' files of that step.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from omniroll.train.algorithms import UpdatePlan
from omniroll.train.parallel.shard import merge_stats, rows_per_update, shard_by_groups
from omniroll.train.update import UpdateResult


class TrainerRankError(RuntimeError):
    """A data-parallel trainer rank died or failed."""


def adopt_weights(policy, weights: dict) -> None:
    """Copy `weights` (trainable parameter name -> tensor, rank 0's) into `policy`'s trainable parameters."""
    own = dict(policy.named_parameters())
    if own.keys() != weights.keys():
        missing, extra = sorted(own.keys() - weights.keys())[:3], sorted(weights.keys() - own.keys())[:3]
        raise TrainerRankError(f"rank 0's weights do not match the trainer's policy (missing {missing}, extra {extra})")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(weights[k])


def merge_metrics(records: list[dict]) -> dict:
    """The ranks' `prepare` / `after_update` metrics as one: the maximum of a float whose key says `max`, the mean of
    other floats, rank 0's value otherwise (e.g. NFT's decay: the same on every rank). A rank without rows adds none."""
    records = [r for r in records if r] or [{}]
    out = dict(records[0])
    for k, v in out.items():
        vals = [r[k] for r in records if k in r]
        if isinstance(v, float):
            out[k] = max(vals) if "max" in k else sum(vals) / len(vals)
    return out


class RankGroup:
    """config: the OmniRollConfig; model_path: the trainer's resolved model; state_dir: where the ranks write each
    step's optimizer state (every rank's node must see it: a shared filesystem on a multi-node cluster); log: one line
    per event."""

    def __init__(self, config: Any, model_path: str, state_dir: str, log: Callable[[str], None] = print):
        self.config, self.tc, self.model_path, self.log = config, config.trainer, model_path, log
        self.state_dir = os.path.abspath(state_dir)
        self.started_from: tuple[Optional[dict], Optional[str]] = (None, None)  # the optimizer state given at start
        self.world_size = self.tc.world_size
        self.actors: list = []
        self.nodes: list[Optional[str]] = []
        self.placement = None
        self.backend: Optional[str] = None
        self.policy = None  # the driver's policy and algorithm, which adopt rank 0's after each update (`load`)
        self.algorithm = None

    # ------------------------------------------------------------------ start / stop
    def start(self, policy, optimizer, algorithm, store, sharded_optimizer: Optional[str] = None) -> "RankGroup":
        """Start the ranks and their process group; give them the trainer's weights, optimizer state (`optimizer`'s,
        or the directory of a sharded one: `sharded_optimizer`), algorithm state and kept versions (a fresh run's or a
        checkpoint's)."""
        import ray

        from omniroll.ray_nodes import actor_node_ids
        from omniroll.rollout.ray_cluster import ActorPlacement, bundle_for
        from omniroll.train.parallel.rank import TrainerRank

        tc, rs, N = self.tc, self.tc.resources, self.world_size
        # 1. Placement: one bundle per rank (pack / spread), as the replicas are placed.
        self.placement = ActorPlacement.create("trainer.placement", N, bundle_for(rs.num_cpus, rs.num_gpus,
                                                                                  rs.custom), tc.placement)
        cls = ray.remote(num_cpus=rs.num_cpus, num_gpus=rs.num_gpus, resources=dict(rs.custom) or None,
                         max_restarts=0)(TrainerRank)
        # 2. The ranks, and where they landed.
        self.actors = [cls.options(**self.placement.options(r)).remote(self.config, self.model_path, r, N,
                                                                       self.state_dir) for r in range(N)]
        self.nodes = actor_node_ids(self.actors, timeout_s=tc.sync_timeout_s)
        # 3. The process group: rank 0's node and a free port there, every rank joining at once.
        address = self._gather([self.actors[0].rendezvous.remote()], "start", ranks=[0])[0]
        self.backend = self._gather([a.init_group.remote(address, tc.sync_timeout_s) for a in self.actors],
                                    "start")[0]
        # 4. The same state on every rank.
        self.load(policy, optimizer, algorithm, store, sharded_optimizer)
        where = sorted({n for n in self.nodes if n})
        self.log(f"{N} trainer rank(s) ({self.backend}, {tc.placement}) on {len(where)} node(s): "
                 + ", ".join(f"{n[:8]} x{self.nodes.count(n)}" for n in where))
        return self

    def load(self, policy, optimizer, algorithm, store, sharded_optimizer: Optional[str] = None) -> None:
        """Give every rank `policy`'s trainable weights, the optimizer's (or `sharded_optimizer`'s) and the
        algorithm's state and the kept versions; `policy` and `algorithm` adopt rank 0's after each update."""
        import ray

        self.policy, self.algorithm = policy, algorithm

        opt = None if sharded_optimizer is not None else optimizer.state_dict()
        self.started_from = (opt, sharded_optimizer)
        state = [ray.put({k: p.detach().cpu() for k, p in policy.named_parameters()}), ray.put(opt),
                 ray.put(algorithm.state_dict()), ray.put(dict(store.snapshots)), store.current, sharded_optimizer]
        self._gather([a.load_state.remote(*state) for a in self.actors], "loading the trainer's state")

    def optimizer_state(self, step: int) -> tuple[dict, Optional[dict]]:
        """For the checkpoint of completed step `step`: (trainer_state.pt's "optimizer", the files to put beside it).
        Replicated: rank 0's state dict (read from its file); fsdp: {"sharded": "optimizer"} and the ranks'
        torch.distributed.checkpoint directory. Before the ranks' first step: the state they started from."""
        from omniroll.train.parallel.rank import optimizer_state_path

        path = optimizer_state_path(self.state_dir, step)
        if self.tc.sharding == "fsdp":
            src = os.path.join(path, "optimizer")
            src = src if os.path.isdir(src) else self.started_from[1]
            return {"sharded": "optimizer" if src else None}, ({"optimizer": src} if src else None)
        f = os.path.join(path, "optimizer.pt")
        return (torch.load(f, map_location="cpu", weights_only=True) if os.path.isfile(f)
                else self.started_from[0]), None

    def close(self, graceful: bool = True) -> None:
        """Leave the process group (graceful: each rank destroys it, 30 s at most, and the ranks' optimizer files go:
        the driver has written its checkpoints) and end the ranks."""
        from omniroll.ray_nodes import kill_actors

        if self.actors:
            import ray

            if graceful:
                try:
                    ray.get([a.close.remote() for a in self.actors], timeout=30)
                except Exception:  # noqa: BLE001 - a rank that is gone or stuck: killed below
                    pass
            kill_actors(self.actors)
            self.actors = []
            if graceful:
                shutil.rmtree(self.state_dir, ignore_errors=True)
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    # ------------------------------------------------------------------ a step
    def update(self, rows, advantages: torch.Tensor, uids: list, plan: UpdatePlan) -> UpdateResult:
        """Every rank's part of the step's update (`rows`: the whole batch; `uids`: its prompt groups); then the
        driver's policy and algorithm hold rank 0's weights and state. Returns the ranks' results merged: the stats
        (`merge_stats`), the metrics (`merge_metrics`), the slowest rank's seconds, the largest rank's peak_bytes (None
        on the CPU): what `omniroll.train.local_update.LocalUpdate.update` returns in one process."""
        import ray

        # 1. Whole prompt groups per rank; the rows of every global optimizer step.
        shards = shard_by_groups(uids, self.world_size)
        halves = plan.halves
        rows_a = [int(halves[torch.tensor(s, dtype=torch.long)].sum()) for s in shards] if halves is not None else None
        per = rows_per_update([len(s) for s in shards], plan.micro_batch_size, plan.per_update, rows_a)
        base = replace(plan, versions=None, store=None, halves=None, groups=None, components=None)  # per row: below
        # 2. Each rank its shard (object store), all at once; wait for all, stop every rank if one fails.
        refs = []
        for a, s in zip(self.actors, shards):
            idx = torch.tensor(s, dtype=torch.long)
            versions = plan.versions[idx] if plan.versions is not None else None
            part = (replace(base, components={k: v[idx] for k, v in plan.components.items()})
                    if plan.components is not None else base)
            refs.append(a.update.remote(ray.put(rows.rows(idx)), advantages[idx], part, versions, per,
                                        halves[idx] if halves is not None else None))
        outs = self._gather(refs, f"step {plan.step}'s update")
        # 3. Rank 0's weights and algorithm state into the driver's (the optimizer state stays with the ranks).
        adopt_weights(self.policy, outs[0].weights)
        self.algorithm.load_state_dict(outs[0].algorithm)
        res = [o.result for o in outs]
        peaks = [r.peak_bytes for r in res if r.peak_bytes is not None]
        return UpdateResult(stats=merge_stats([r.stats for r in res]),
                            prepared=merge_metrics([r.prepared for r in res]),
                            after=merge_metrics([r.after for r in res]), move=merge_metrics([r.move for r in res]),
                            recompute_s=max(r.recompute_s for r in res), move_s=max(r.move_s for r in res),
                            peak_bytes=max(peaks) if peaks else None)

    def rank_weights(self) -> list[dict]:
        """Every rank's trainable weights (tests: they stay equal)."""
        return self._gather([a.weights.remote() for a in self.actors], "weights")

    def algorithm_states(self) -> list[dict]:
        """Every rank's algorithm state (tests: it stays equal)."""
        return self._gather([a.algorithm_state.remote() for a in self.actors], "algorithm states")

    # ------------------------------------------------------------------ waiting, failing
    def _gather(self, refs: list, what: str, ranks: Optional[list[int]] = None) -> list:
        """The ranks' results in order. A failed rank stops them all (TrainerRankError naming it and its node); after
        the first rank finishes, the others get `sync_timeout_s` (a live rank blocked in a collective is released by
        the process group's own timeout, the same)."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        deadline = None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    results[r] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - any rank failure ends the step, named
                    self._fail(r, what, f"{type(e).__name__}: {_first_line(e)}")
            if ready and deadline is None:
                deadline = time.time() + self.tc.sync_timeout_s
            if pending and deadline is not None and time.time() > deadline:
                self._fail(min(pending.values()), what, f"did not finish within sync_timeout_s="
                                                       f"{self.tc.sync_timeout_s:g}s of the first rank")
        return [results[r] for r in ranks]

    def _fail(self, rank: int, what: str, why: str) -> None:
        from omniroll.rollout.ray_cluster import node_address

        node = self.nodes[rank] if rank < len(self.nodes) else None
        where = f"node {node[:8]} ({node_address(node) or 'gone'})" if node else "an unknown node"
        self.close(graceful=False)  # the others may be blocked in a collective with the failed one
        raise TrainerRankError(f"trainer rank {rank} on {where} failed during {what}: {why}; every rank was stopped")


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__
