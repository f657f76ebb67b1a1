"""`RewardControls`: what a training step adds against reward hacking, in one object the trainer calls at three
points of a step: GARDO's diversity bonus on the advantages (`trainer.diversity_bonus`, diversity.py), GARDO's KL gate
with its fixed or adaptive share (`trainer.kl_gate`, kl_gate.py) and DDRL's data regulariser
(`trainer.data_regularizer`, data_regularizer.py) in the update's plan, and the metrics they log. (The KL's
reference, `trainer.kl_reference`, is the policy's: kl_reference.py.)

    controls = RewardControls(config)                        # before the policy exists
    controls.start(adapter, prompts)                         # the data regulariser needs the model
    adv = controls.advantages(adv, batch, uids)              # the diversity bonus (or adv as it is)
    plan = UpdatePlan(..., **controls.plan(step, batch, rewards, rows))
    m.update(controls.metrics(plan, stats))                  # kl_gate_share, kl_gate_target, data_loss
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from omniroll.train.data_regularizer import DataRegularizer, data_regularizer
from omniroll.train.diversity import diversity_bonus
from omniroll.train.kl_gate import AdaptiveShare, adaptive_share, step_kl_gate


class RewardControls:
    """config: the run's; `gate_share` (the adaptive share, None when fixed or off) is what checkpoints keep."""

    def __init__(self, config: Any):
        self.config, self.tc = config, config.trainer
        self.gate_share: Optional[AdaptiveShare] = adaptive_share(config)
        self.data: Optional[DataRegularizer] = None

    def start(self, adapter, prompts: list[str]) -> None:
        """Build what needs the trained model: the data regulariser (None when off)."""
        self.data = data_regularizer(self.config, adapter, prompts)

    def advantages(self, adv, batch, uids: list):
        """The step's `Advantages` with the diversity bonus when `trainer.diversity_bonus` is on."""
        return diversity_bonus(adv, batch, uids, self.tc.adv_clip_max) if self.tc.diversity_bonus else adv

    def plan(self, step: int, batch, rewards: torch.Tensor, rows, device) -> dict:
        """The `UpdatePlan` fields of step `step`: its KL gate over the rollout `batch` (None: off) and the data
        regulariser's term on the rows' execution mode (None: off)."""
        return {"kl_gate": step_kl_gate(self.config, batch, rewards, self.gate_share),
                "data_term": self.data.term(step, rows.execution, device) if self.data is not None else None}

    def metrics(self, plan, stats) -> dict:
        """kl_gate_share (the share gated), kl_gate_target (the adaptive share), data_loss: those that are on."""
        m = {}
        if plan.kl_gate is not None:
            m["kl_gate_share"] = float(plan.kl_gate.mean())
        if self.gate_share is not None:
            m["kl_gate_target"] = self.gate_share.share
        if stats.data_loss is not None:
            m["data_loss"] = stats.data_loss
        return m

    def state_dict(self) -> Optional[dict]:
        """What a checkpoint keeps (the adaptive share's state; None when there is none)."""
        return self.gate_share.state_dict() if self.gate_share is not None else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.gate_share is not None and state is not None:
            self.gate_share.load_state_dict(state)
