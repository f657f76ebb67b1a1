"""The moving-shapes world's rewards: its exact clip checker (`omniroll.tasks.moving_shapes`), usable as
`reward.functions.<name>.fn: moving_shapes` (partial credit, for RL: the share of the prompt's requirements met),
`moving_shapes_continuous` (the same requirements graded) or `moving_shapes_strict` (pass / fail); and
`moving_shapes_last_frame`, a per-frame image reward: the shapes world's partial credit on the clip's last frame
against what that frame must show (`omniroll.tasks.moving_shapes.last_frame`), which no motion reaches (the reward
that shows why video needs its own).

**An object the prompt does not name voids the clip's credit**: the world's scenes hold exactly the named objects,
and the checker's rules, which look for the named ones, pass a clip that draws more (`ClipJudgement.extra`). Trained
on the rules' credit alone, the video demo taught extra objects: the share of clips with one rose from 6 % to 19-48 %
(docs/moving_shapes.md). So every reward here is 0 for a clip with an extra object, and the rules' credit otherwise.

Each returns, per sample, a dict: `score` (the reward) and extras that land in the row's `extra_info` as
`<name>/<key>` and that the trainer averages per step into metrics.jsonl and the trackers (`reward/<name>/<key>`):
`strict`, `partial` and `continuous` of every sample, the checker's own (the rules', as evaluations report them),
`extra` (1.0 when the clip shows more objects than its prompt names: averaged per step, the share of such clips),
`<category>` (its strict pass by the rules) for the sample's own category only; `motion`, the clip's mean tracked
displacement in pixels (averaged per step it is the motion meter, which shows a policy collapsing to static clips
whatever the reward says); and `motion_<category>`, the same value under
the sample's own category's key, so that the meter can be read on the prompts that ask for motion (`motion_direction`,
`motion_two_motions`) apart from the order and change prompts, whose objects stand still. `moving_shapes_last_frame`
adds `frame_partial` and `frame_strict`, the frame's own verdicts, beside the clip's. A sample that is not a video
(an image), a clip the checker cannot read, or a prompt outside the grammar is that row's error, with the reason (the
row fails, the others are scored; never a reward of 0); `check_prompts` finds such prompts before anything starts.
"""

from __future__ import annotations

from omniroll.reward.task_scorers import task_scorer
from omniroll.tasks.moving_shapes.grammar import PromptError, check_prompts, parse_prompt
from omniroll.tasks.moving_shapes.judge import ClipJudgement, score_clip
from omniroll.tasks.moving_shapes.last_frame import last_frame_prompt


def _values(samples, score: str) -> list:
    """One dict per sample, or the error instance of a sample that cannot be scored (it fails that row alone,
    `RewardManager`)."""
    out = []
    for s in samples:
        if not s.is_video:
            out.append(ValueError(f"sample {s.sample_id!r} is an image of shape {tuple(s.image.shape)}; the "
                                  f"moving-shapes reward scores videos [T, 3, H, W]"))
            continue
        try:
            spec = parse_prompt(s.prompt)
            j = score_clip(spec, s.image)
        except (PromptError, ValueError) as e:
            out.append(e)
            continue
        strict = float(j.strict)
        values = {"strict": strict, "partial": j.partial, "continuous": j.continuous, "extra": float(j.extra)}
        if score == "last_frame":
            frame = last_frame(spec, s.image)
            values = {**values, "frame_partial": frame.partial, "frame_strict": float(frame.strict)}
            reward = frame.partial  # the per-frame reward: the last frame's own credit
        else:
            reward = reward_of(j, score)
        out.append({"score": reward, **values, spec.tag: strict, "motion": j.motion,
                    f"motion_{spec.tag}": j.motion})
    return out


def reward_of(j: ClipJudgement, score: str) -> float:
    """The reward `score` ("partial", "continuous" or "strict") of a judgement: the rules' credit, 0 with an extra
    object (module doc)."""
    return 0.0 if j.extra else float(getattr(j, score))


def last_frame(spec, clip):
    """The shapes checker's judgement of the clip's last frame against `last_frame_prompt(spec)`."""
    from omniroll.tasks.shapes.grammar import parse_prompt as parse_picture_prompt
    from omniroll.tasks.shapes.report import score_picture

    return score_picture(parse_picture_prompt(last_frame_prompt(spec)), clip[-1])


def moving_shapes_partial(samples) -> list[dict]:
    """Partial credit in [0, 1]: the share of the prompt's requirements the clip meets
    (`omniroll.tasks.moving_shapes.rules`); 0 with an extra object (module doc)."""
    return _values(samples, "partial")


def moving_shapes_continuous(samples) -> list[dict]:
    """Continuous credit in [0, 1]: the requirements graded by how nearly each is met (how far the object moved
    along its direction, how steadily, its colour's share, ...), so a clip nearer a pass earns more; 0 with an extra
    object (module doc)."""
    return _values(samples, "continuous")


def moving_shapes_strict(samples) -> list[dict]:
    """Strict success: 1.0 when the clip meets every requirement and shows no extra object, else 0.0."""
    return _values(samples, "strict")


def moving_shapes_last_frame(samples) -> list[dict]:
    """A per-frame image reward: the shapes world's partial credit on the clip's last frame against what that frame
    must show ("a red circle moving left" -> "a red circle"), blind to motion, order and change; the clip checker's
    verdicts and the motion are logged beside it."""
    return _values(samples, "last_frame")


#: registry name -> factory (added to `omniroll.reward.scorers.SCORER_REGISTRY`)
MOVING_SHAPES_SCORERS = {name: task_scorer(fn, check_prompts, "the moving-shapes rewards") for name, fn in (
    ("moving_shapes", moving_shapes_partial), ("moving_shapes_continuous", moving_shapes_continuous),
    ("moving_shapes_strict", moving_shapes_strict), ("moving_shapes_last_frame", moving_shapes_last_frame))}
