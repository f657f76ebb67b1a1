"""`omniroll.train`: the trainer (layer 8: it builds on agent_loop, weights, sampling; nothing below imports it), with
the algorithms of `trainer.algorithm` in `omniroll.train.algorithms` (one file each; their list:
`omniroll.config.algorithms.ALGORITHMS`).

Public pieces for a custom loop: `TrajectoryBatch` (the rows a rollout returns), `CleanBatch` (the rows of a
forward-process rollout), `recompute_log_probs` (the rollout's log-prob under the current weights, with autograd,
bitwise equal with the rollout's weights), `group_advantages`, `ppo_clip_loss`, `decoupled_ppo_loss` (the asynchronous
trainer's off-policy loss), `kl_to_reference`, `Policy`, and `Trainer` for the whole loop (`FlowGRPOTrainer`, its former
name, is the same class). `NoLearningSignal`: what `Trainer.train` raises when every GRPO group has been tied for
`trainer.signal_check.stop_after_tied_steps` steps (`LearningSignalCheck`, report/signal_check.py).
"""

from omniroll.engine.execution import execution_mode
from omniroll.train.policy import Policy
from omniroll.train.recompute import enable_gradient_checkpointing, recompute_log_probs, trajectory_velocity
from omniroll.train.trajectory_batch import TrajectoryBatch
from omniroll.train.advantages import Advantages, group_advantages
from omniroll.train.algorithms.ppo import decoupled_ppo_loss, kl_to_reference, ppo_clip_loss
from omniroll.train.algorithms.terms import LossTerms
from omniroll.train.clean_batch import CleanBatch
from omniroll.train.report.signal_check import LearningSignalCheck, NoLearningSignal

__all__ = [
    "Advantages", "LossTerms", "group_advantages", "kl_to_reference", "ppo_clip_loss", "decoupled_ppo_loss",
    "enable_gradient_checkpointing", "execution_mode", "trajectory_velocity", "CleanBatch", "recompute_log_probs",
    "TrajectoryBatch", "Trainer", "FlowGRPOTrainer", "Policy", "WeightVersionError", "LearningSignalCheck",
    "NoLearningSignal",
]


def __getattr__(name):  # the trainer pulls in Ray and the agent loop: import it on first use
    if name in ("Trainer", "FlowGRPOTrainer", "WeightVersionError"):
        from omniroll.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
