"""Pure fp32 sampling math shared by rollout and the trainer's recompute."""

from omniroll.sampling.schedule import flow_match_sigmas, shift_sigmas, time_shift_mu
from omniroll.sampling.sde import SDE_TYPES, SDEStepOutput, sde_step
from omniroll.sampling.seeds import derive_group_seed, derive_seed, make_generator
from omniroll.sampling.window import draw_sde_window

__all__ = [
    "SDE_TYPES",
    "SDEStepOutput",
    "sde_step",
    "derive_seed",
    "derive_group_seed",
    "make_generator",
    "draw_sde_window",
    "flow_match_sigmas",
    "shift_sigmas",
    "time_shift_mu",
]
