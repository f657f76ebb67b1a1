"""Agent loop: per-row generation tasks over rollout replicas, streaming rewards, DataProto-style batches."""

from omniroll.agent_loop.batch import DataBatch
from omniroll.agent_loop.loop import DiffusionSingleTurnAgentLoop
from omniroll.agent_loop.outputs import AgentLoopMetrics, DiffusionAgentLoopOutput
from omniroll.agent_loop.worker import AgentLoopError, DiffusionAgentLoopWorker
from omniroll.config.agent_loops import get_agent_loop_class, register, registered_names

__all__ = [
    "AgentLoopError",
    "AgentLoopManager",
    "AgentLoopMetrics",
    "RolloutCluster",
    "DataBatch",
    "DiffusionAgentLoopOutput",
    "DiffusionAgentLoopWorker",
    "DiffusionSingleTurnAgentLoop",
    "get_agent_loop_class",
    "register",
    "registered_names",
]


def __getattr__(name):
    if name == "AgentLoopManager":
        from omniroll.agent_loop.manager import AgentLoopManager

        return AgentLoopManager
    if name == "RolloutCluster":
        from omniroll.agent_loop.cluster import RolloutCluster

        return RolloutCluster
    raise AttributeError(name)
