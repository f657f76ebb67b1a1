"""The shapes-video model's training data: batches drawn per step from the seed, the VAE's curriculum, and the
two-motion layout that places only the transformer's two-motion clips."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from omniroll.models.shapes_video.recipe import TOY


def test_a_training_batch_is_a_function_of_seed_and_step_and_the_curriculum_starts_with_single_frames():
    from omniroll.models.shapes_video.data import TrainingClips
    from omniroll.models.shapes_video.vae import vae_batch
    from omniroll.tasks.moving_shapes.render import render_prompt
    from omniroll.tasks.moving_shapes.splits import split_prompts

    data = TrainingClips()
    caps, clips = data.batch(5, 7, 3)
    caps2, clips2 = TrainingClips().batch(5, 7, 3)
    assert caps == caps2 and np.array_equal(clips, clips2) and clips.shape == (3, 9, 3, 64, 64)
    other_caps, other = data.batch(5, 8, 3)
    assert other_caps != caps or not np.array_equal(other, clips)
    assert set(caps) | set(other_caps) <= set(split_prompts("train"))
    drawn, seeds = data.draws(5, 7, 3)  # the batch's captions and render seeds, without its clips
    assert drawn == caps and np.array_equal(np.stack([render_prompt(c, s) for c, s in zip(drawn, seeds)]), clips)
    first = vae_batch(data, TOY.vae, 5, 0)
    last = vae_batch(data, TOY.vae, 5, TOY.vae.steps - 1)
    assert first.shape == (TOY.vae.image_batch, 3, 1, 64, 64) and last.shape == (TOY.vae.clip_batch, 3, 9, 64, 64)
    assert float(first.min()) >= -1 and float(first.max()) <= 1


def test_the_two_motion_layout_places_the_transformers_two_motion_clips_only_and_older_runs_resume(tmp_path):
    from omniroll.models.shapes_video.data import TrainingClips
    from omniroll.models.shapes_video.pretrain import encode_latents
    from omniroll.models.shapes_video.recipe import ShapesVideoRecipe
    from omniroll.models.shapes_video.resume import check_recipe
    from omniroll.models.shapes_video.vae import build_vae, encode_means
    from omniroll.tasks.moving_shapes.grammar import parse_prompt
    from omniroll.tasks.moving_shapes.render import render_prompt

    weights = {"direction": 1.0, "two_motions": 3.0, "order": 1.0, "change": 1.0}
    caps, clips = TrainingClips(weights).batch(5, 7, 12)
    left_caps, left = TrainingClips(weights, two_motions_layout="first_left").batch(5, 7, 12)
    _, seeds = TrainingClips(weights).draws(5, 7, 12)
    two = [parse_prompt(c).tag == "two_motions" for c in caps]
    assert left_caps == caps and any(two) and not all(two)
    for c, s, a, b, is_two in zip(caps, seeds, clips, left, two):
        assert np.array_equal(b, render_prompt(c, s, layout="first_left"))
        assert is_two or np.array_equal(a, b)  # the layout moves two-motion clips only
    assert any(not np.array_equal(a, b) for a, b, is_two in zip(clips, left, two) if is_two)
    with pytest.raises(ValueError, match=r"two_motions_layout must be one of \['any', 'first_left'\], got 'left'"):
        TrainingClips(two_motions_layout="left")

    # the recipe's field reaches the transformer's latents (the VAE's clips keep the world's layout)
    recipe = dataclasses.replace(TOY, two_motions_layout="first_left", category_weights={"two_motions": 1.0})
    vae = build_vae(TOY.vae)
    (tmp_path / "latents").mkdir()
    with torch.no_grad():
        got_caps, means = encode_latents(vae, recipe, str(tmp_path / "latents"), False)
        want_caps, want = TrainingClips({"two_motions": 1.0}, two_motions_layout="first_left").batch(
            recipe.latent_data_seed, 0, TOY.dit.num_latents)
        assert got_caps == want_caps and torch.equal(means, encode_means(vae, want))
    with pytest.raises(ValueError, match="two_motions_layout must be one of"):
        ShapesVideoRecipe.from_dict({**TOY.to_dict(), "two_motions_layout": "left"})

    # a recipe.json written before the field reads as the world's layout, and that run resumes; another layout not
    older = TOY.to_dict()
    del older["two_motions_layout"]
    assert ShapesVideoRecipe.from_dict(older).two_motions_layout == "any"
    (tmp_path / "resume").mkdir()
    (tmp_path / "resume" / "recipe.json").write_text(json.dumps(older))
    check_recipe(str(tmp_path / "resume"), TOY.to_dict(), written_before={"two_motions_layout": "any"})
    with pytest.raises(ValueError, match=r"another recipe \(sections \['two_motions_layout'\]"):
        check_recipe(str(tmp_path / "resume"), recipe.to_dict() | {"category_weights": TOY.category_weights},
                     written_before={"two_motions_layout": "any"})
