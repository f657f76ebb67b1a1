"""Rollout replicas (one DiffusionEngine per Ray actor), the in-process routing client, and Ray itself: joining a
cluster or starting a local one, placing actors (`ray_cluster`).

Names resolve lazily, so a process that only routes (an agent-loop worker unpickling its `RolloutClient`) does not
import the replica's engine, weights and PEFT (about 3 s of imports on the 2-core VM).
"""

import importlib

_WHERE = {
    "RequestError": "client", "RolloutClient": "client", "RolloutError": "client",
    "RolloutReplica": "replica", "create_replicas": "replica", "kill_replicas": "replica",
    "output_from_wire": "wire", "output_to_wire": "wire",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"omniroll.rollout.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'omniroll.rollout' has no attribute {name!r}")
