"""Rewards that are smooth (linear) functions of the picture, for the gradient-signal meter's control experiment: the
same sampling and estimator as a recipe, with a reward whose dependence on the noise is nearly linear, so that what
the meter then reads is the ceiling the estimator and the denoiser allow (docs/training/tree_grpo.md).

    PYTHONPATH=. python benchmarks/grad_signal.py --config examples/shapes_flow_grpo.yaml \\
        --override reward.functions.geneval.fn=benchmarks.smooth_rewards:brightness
"""

from __future__ import annotations

import numpy as np


def brightness(samples) -> list[float]:
    """The picture's mean pixel value in [0, 1] (a linear function of its pixels), one per sample."""
    return [float(np.asarray(s.image, dtype=np.float64).mean() / 255.0) for s in samples]
