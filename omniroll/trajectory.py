"""Alias of `omniroll.trajectory_file` (the trajectory layout), kept for one release: the README used this path."""

from omniroll.trajectory_file import *  # noqa: F401,F403
