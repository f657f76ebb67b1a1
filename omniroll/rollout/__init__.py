"""Rollout replicas (one DiffusionEngine per Ray actor), the in-process routing client, and Ray itself: joining a
cluster or starting a local one, placing actors (`ray_cluster`)."""

from omniroll.rollout.client import RequestError, RolloutClient, RolloutError
from omniroll.rollout.replica import RolloutReplica, create_replicas, kill_replicas
from omniroll.rollout.wire import output_from_wire, output_to_wire

__all__ = [
    "RequestError",
    "RolloutClient",
    "RolloutError",
    "RolloutReplica",
    "create_replicas",
    "kill_replicas",
    "output_from_wire",
    "output_to_wire",
]
