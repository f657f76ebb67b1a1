"""`WeightPush`: the trainer's weights to every replica of the rollout cluster, one version at a time, with every ack
checked.

    push = WeightPush(cluster, transport="auto", timeout_s=60.0, log=print)
    push.send(weights, version=3, partial=True)     # -> the acks, one per replica, each at version 3

The trainer chooses what is sent and how in-flight samples meet it (omniroll/train/trainer.py `_sync`); this file
owns the sending. Replicas whose node left the cluster are dropped first, with one line; a send that fails because a
receiver disappeared meanwhile is completed on the survivors that do not hold the version yet; any other failure,
and any ack at another version or a missing ack, raises `WeightPushError` naming the version.
"""

from __future__ import annotations

from typing import Callable

from omniroll.weights import WeightSender, WeightSyncError


class WeightPushError(RuntimeError):
    """A push that did not leave every replica at the version sent."""


class WeightPush:
    """cluster: the `RolloutCluster` (its `replicas` and `prune()`); transport, timeout_s: `WeightSender`'s."""

    def __init__(self, cluster, *, transport: str, timeout_s: float, log: Callable[[str], None]):
        self.cluster, self.transport, self.timeout_s, self.log = cluster, transport, timeout_s, log
        self.sender = WeightSender(cluster.replicas, transport=transport, timeout_s=timeout_s)

    def send(self, weights, *, version: int, **policy) -> list[dict]:
        """Push `weights` as `version` to every replica (`policy`: `WeightSender.send`'s in-flight keywords). Returns
        the acks; raises `WeightPushError` unless every replica acked `version`."""
        self.drop_lost_replicas()
        try:
            acks = self.sender.send(weights, version=version, **policy)
        except WeightSyncError:
            if not self.drop_lost_replicas():
                raise
            acks = self._send_to_survivors(weights, version, policy)
        replicas = self.cluster.replicas
        bad = [a for a in acks if int(a.get("version", -1)) != version]
        if len(acks) != len(replicas) or bad:
            raise WeightPushError(f"weight sync to version {version}: acks {acks}")
        return acks

    def drop_lost_replicas(self) -> bool:
        """Drop replicas whose node left the cluster; says so in one line. Returns whether any was lost."""
        lost = self.cluster.prune()
        if lost:
            nodes = sorted({str(x["node_id"]) for x in lost})
            self.log(f"lost {len(lost)} replica(s) (node(s) {', '.join(nodes)} left the cluster): continuing with "
                     f"{len(self.cluster.replicas)} replica(s)")
            self.sender = WeightSender(self.cluster.replicas, transport=self.transport, timeout_s=self.timeout_s)
        return bool(lost)

    def _send_to_survivors(self, weights, version: int, policy: dict) -> list[dict]:
        """After a send that lost a receiver: `version` to the survivors that do not have it yet."""
        import ray

        replicas = self.cluster.replicas
        have = [int(h["weight_version"]) for h in ray.get([r.health.remote() for r in replicas])]
        behind = [r for r, v in zip(replicas, have) if v < version]
        acks = [{"version": v} for v in have if v >= version]
        if behind:
            sender = WeightSender(behind, transport=self.transport, timeout_s=self.timeout_s)
            acks += sender.send(weights, version=version, **policy)
        return acks
