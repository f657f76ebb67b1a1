"""The moving-shapes rewards: registered scorers with strict, partial, graded credit, per-category extras and the
motion meter, which a scored batch carries into the step's metrics.jsonl; rows that cannot be scored fail alone."""

import asyncio
import json

import numpy as np
import pytest

from omniroll.reward import RewardManager, RewardSample
from omniroll.reward.scorers import SCORER_REGISTRY, build_scorer, prompt_problems, scorer_problems
from omniroll.tasks.moving_shapes.cheats import apply_order, cheat_order
from omniroll.tasks.moving_shapes.render import render_prompt

PROMPTS = ["a red circle moving left", "a square moving up and a triangle moving down",
           "a red circle appears, then a blue square", "a square turning from blue to green"]


def _samples():
    out = [RewardSample(sample_id=f"s{i}", prompt=p, image=render_prompt(p, i)) for i, p in enumerate(PROMPTS)]
    frozen = apply_order(out[0].image, cheat_order("frozen", 9))
    out.append(RewardSample(sample_id="frozen", prompt=PROMPTS[0], image=frozen))
    out.append(RewardSample(sample_id="image", prompt=PROMPTS[0], image=out[0].image[0]))
    out.append(RewardSample(sample_id="bad", prompt="a red circle moving sideways", image=out[0].image))
    out.append(RewardSample(sample_id="one", prompt=PROMPTS[0], image=out[0].image[:1]))  # a video of one frame
    return out


def test_the_rewards_are_registered_and_refuse_kwargs_and_prompts_outside_the_grammar():
    assert {"moving_shapes", "moving_shapes_continuous", "moving_shapes_strict",
            "moving_shapes_last_frame"} <= set(SCORER_REGISTRY)
    assert scorer_problems("moving_shapes", {"x": 1}) == ["kwargs: the moving-shapes rewards take no kwargs, got "
                                                          "['x']"]
    with pytest.raises(ValueError, match="takes no kwargs"):
        build_scorer("moving_shapes_strict", {"x": 1})
    lines = prompt_problems("moving_shapes", PROMPTS + ["a red circle moving sideways"])
    assert len(lines) == 1 and lines[0].startswith("prompt 4: ") and "nearest valid prompt" in lines[0]


def test_scored_rows_carry_credit_the_category_and_the_motion_meter_and_bad_rows_fail_alone():
    mgr = RewardManager({"ms": {"fn": "moving_shapes", "max_retries": 0},
                         "strict": {"fn": "moving_shapes_strict", "weight": 0.0, "max_retries": 0},
                         "graded": {"fn": "moving_shapes_continuous", "weight": 0.0, "max_retries": 0}})
    res = asyncio.run(mgr.score(_samples()))
    assert [r.score for r in res[:4]] == [1.0] * 4 and all(r.components["graded"] == 1.0 for r in res[:4])
    for r, tag in zip(res, ("direction", "two_motions", "order", "change")):
        assert r.extra_info[f"ms/{tag}"] == 1.0 and r.extra_info["strict/strict"] == 1.0
        assert not any(f"ms/{other}" in r.extra_info for other in ("direction", "two_motions", "order", "change")
                       if other != tag)
    assert 24 <= res[0].extra_info["ms/motion"] <= 40 and res[2].extra_info["ms/motion"] == 0.0
    for r, tag in zip(res[:5], ("direction", "two_motions", "order", "change", "direction")):  # its own category's
        assert r.extra_info[f"ms/motion_{tag}"] == r.extra_info["ms/motion"]
        assert sum(k.startswith("ms/motion_") for k in r.extra_info) == 1
    frozen = res[4]  # the right circle, the right colour, no motion: partial credit 2 / 3, strict 0, motion 0
    assert frozen.status == "ok" and frozen.score == pytest.approx(2 / 3) and frozen.extra_info["ms/extra"] == 0.0
    assert frozen.components["strict"] == 0.0 and frozen.extra_info["ms/motion"] == 0.0
    assert 0.0 < frozen.components["graded"] < 1.0
    image, bad = res[5], res[6]
    assert image.status == "failed" and image.score is None and "is an image" in image.error
    assert bad.status == "failed" and bad.score is None and "nearest valid prompt" in bad.error
    assert res[7].status == "failed" and "at least 2 frames" in res[7].error


def test_an_object_the_prompt_does_not_name_voids_the_credit_though_the_rules_pass_the_clip():
    """A clip of "a red circle moving left" with a blue square moving up pasted in (no overlap): the rules pass it,
    every reward gives it 0, and `extra` is logged."""
    from omniroll.tasks.moving_shapes.judge import frames_hwc

    prompt = PROMPTS[0]
    alone, other = frames_hwc(render_prompt(prompt, 2)), frames_hwc(render_prompt("a blue square moving up", 102))
    background = alone[0, 0, 0]
    mine, theirs = (alone != background).any(-1), (other != background).any(-1)
    both = alone.copy()
    both[theirs & ~mine] = other[theirs & ~mine]
    samples = [RewardSample(sample_id=name, prompt=prompt, image=clip.transpose(0, 3, 1, 2))
               for name, clip in (("alone", alone), ("both", both))]
    mgr = RewardManager({"ms": {"fn": "moving_shapes", "max_retries": 0},
                         "strict": {"fn": "moving_shapes_strict", "weight": 0.0, "max_retries": 0},
                         "graded": {"fn": "moving_shapes_continuous", "weight": 0.0, "max_retries": 0}})
    alone_r, both_r = asyncio.run(mgr.score(samples))
    assert alone_r.score == 1.0 and alone_r.components["strict"] == 1.0 and alone_r.extra_info["ms/extra"] == 0.0
    assert both_r.extra_info["ms/strict"] == 1.0 and both_r.extra_info["ms/partial"] == 1.0  # the rules pass it
    assert both_r.extra_info["ms/extra"] == 1.0
    assert both_r.score == 0.0 and both_r.components["strict"] == 0.0 and both_r.components["graded"] == 0.0


def test_the_last_frame_reward_is_the_shapes_checker_on_the_last_frame_blind_to_motion_order_and_change():
    from omniroll.tasks.moving_shapes.grammar import parse_prompt
    from omniroll.tasks.moving_shapes.last_frame import last_frame_prompt

    assert [last_frame_prompt(parse_prompt(p)) for p in PROMPTS] == [
        "a red circle", "a square and a triangle", "a red circle and a blue square", "a green square"]
    mgr = RewardManager({"frame": {"fn": "moving_shapes_last_frame", "max_retries": 0}})
    clips = [render_prompt(p, i) for i, p in enumerate(PROMPTS)]
    cheats = [np.repeat(c[-1:], len(c), axis=0) for c in clips]  # every frame the last one: static
    twin = RewardSample(sample_id="twin", prompt="a red circle moving right", image=clips[0])  # moves the other way
    res = asyncio.run(mgr.score([RewardSample(sample_id=f"c{i}", prompt=p, image=c)
                                 for i, (p, c) in enumerate(zip(PROMPTS + PROMPTS, clips + cheats))] + [twin]))
    for r, tag in zip(res[:4], ("direction", "two_motions", "order", "change")):  # the renderer's clips
        assert r.score == 1.0 and r.extra_info["frame/frame_strict"] == 1.0 and r.extra_info[f"frame/{tag}"] == 1.0
        assert r.extra_info["frame/strict"] == 1.0
    for r in res[4:]:  # static clips and the wrong direction: full reward, the clip checker fails them
        assert r.score == 1.0 and r.extra_info["frame/frame_strict"] == 1.0, r.sample_id
        assert r.extra_info["frame/strict"] == 0.0, r.sample_id
    assert [r.extra_info["frame/motion"] for r in res[4:8]] == [0.0] * 4


def test_the_motion_meter_lands_in_the_steps_metrics(tmp_path, tiny_sd3_path):
    """What the trainer logs per step: the assembled batch's reward extras, averaged (`reward_breakdown`), written to
    metrics.jsonl as `reward/<fn>/<key>`: `reward/ms/motion` is the batch's mean tracked displacement."""
    from omniroll.agent_loop.batch import DataBatch
    from omniroll.agent_loop.output_batch import RowResult, assemble
    from omniroll.config import load_config
    from omniroll.train.report.tracking import Tracker

    samples = _samples()[:5]  # four rendered clips and a frozen one
    res = asyncio.run(RewardManager({"ms": {"fn": "moving_shapes", "max_retries": 0}}).score(samples))
    rows = [RowResult(i, f"r{i}", i, reward=r) for i, r in enumerate(res)]
    batch = assemble(rows, DataBatch.from_dict(non_tensors={"uid": [f"u{i}" for i in range(5)]}), prompt_length=8,
                     max_prompt_embed_length=None, mark_failed=True, scored=True)
    cfg = load_config({"engine": {"model": tiny_sd3_path}, "n": 2,
                       "reward": {"functions": {"ms": {"fn": "moving_shapes"}}},
                       "trainer": {"prompts": PROMPTS, "logger": ["jsonl"], "steps": 1}})
    tracker = Tracker(cfg, str(tmp_path), log=lambda s: None)
    tracker.log_step({"step": 1, "reward_mean": 0.9}, batch)
    tracker.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    m = json.loads(line)
    motions = [r.extra_info["ms/motion"] for r in res]
    assert m["reward/ms/motion"] == pytest.approx(np.mean(motions)) and m["reward/ms/motion"] > 0
    assert m["reward/ms/strict"] == pytest.approx(0.8) and m["reward/ms/direction"] == pytest.approx(0.5)
    # the meter per category: over that category's rows only (the rendered and the frozen direction clips)
    assert m["reward/ms/motion_direction"] == pytest.approx((motions[0] + motions[4]) / 2)
    assert m["reward/ms/motion_order"] == pytest.approx(motions[2]) == 0.0
    with pytest.raises(ValueError, match="nearest valid prompt"):  # a config's prompts are checked before any work
        load_config({"engine": {"model": tiny_sd3_path}, "n": 2,
                     "reward": {"functions": {"ms": {"fn": "moving_shapes"}}},
                     "trainer": {"prompts": PROMPTS[:3] + ["a red circle moving sideways"], "steps": 1}})
