"""Pure fp32 sampling math shared by rollout and the trainer's recompute.

Names resolve lazily, so importing a torch-free part (e.g. `omniroll.sampling.window.sde_window_bounds`, which
`SamplingParams` validation uses) does not import torch.
"""

import importlib

_WHERE = {
    "SDE_TYPES": "sde", "SDEStepOutput": "sde", "sde_step": "sde",
    "SOLVERS": "solvers", "SOLVER_NAMES": "solvers", "SolverState": "solvers",
    "derive_seed": "seeds", "derive_group_seed": "seeds", "derive_tree_seed": "seeds", "batch_prompt_uid": "seeds",
    "make_generator": "seeds",
    "draw_sde_window": "window", "sde_window_bounds": "window",
}

__all__ = list(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"omniroll.sampling.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'omniroll.sampling' has no attribute {name!r}")
