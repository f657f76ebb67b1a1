"""What a clip's last frame must show, as a shapes-world prompt: the still picture a per-frame image reward judges
(`reward.functions.<name>.fn: moving_shapes_last_frame`), which no motion, order or change can reach.

    direction    "a red circle moving left"                     -> "a red circle"
    two_motions  "a square moving up and a triangle moving down" -> "a square and a triangle"
    order        "a red circle appears, then a blue square"      -> "a red circle and a blue square" (both are there at
                                                                    the end: the first stays when the second comes)
    change       "a square turning from blue to green"           -> "a green square" (the colour it ends with)

Every renderer clip's last frame passes the shapes checker on its prompt, and so does every clip frozen to it, reversed
where the last frame stays the same, or moving the other way: the reward of the experiment that shows why video
needs its own reward (docs/moving_shapes.md).
"""

from __future__ import annotations

from omniroll.tasks.moving_shapes.grammar import ClipSpec


def last_frame_prompt(spec: ClipSpec) -> str:
    """The shapes-world prompt of what `spec`'s clip shows in its last frame (module doc)."""
    if spec.tag == "change":
        (a,) = spec.actors
        return f"a {a.becomes} {a.shape}"
    if spec.tag in ("direction", "two_motions", "order"):
        return " and ".join(a.words() for a in spec.actors)
    raise ValueError(f"unknown tag {spec.tag!r}")
