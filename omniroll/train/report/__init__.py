"""What a training run reports about itself: tracking and its files, reward curves and breakdowns, validation grids,
the task evaluation, the learning-signal check, how far a step moved the policy, and peak memory per stage."""
