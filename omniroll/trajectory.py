"""Alias of `omniroll.trajectory_file` (the trajectory layout), kept for one release: earlier docs used this path."""

from omniroll.trajectory_file import *  # noqa: F401,F403
