"""Evaluation as a feature: a model (and optionally a trainer checkpoint) scored on a task world's prompts at fixed
seeds with deterministic ODE sampling (layer 8, beside `train/`: it drives an engine and reads a task's checker).

    shapes  GenEval-style strict accuracy per category on the shapes world (`omniroll eval`)
"""
