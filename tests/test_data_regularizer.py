"""`trainer.data_regularizer` (DDRL's idea): the flow-matching loss on the task world's renders. The renders pass the
world's checker, the VAE encoding inverts the decode on the shipped shapes model, the loss is a function of (step,
optimizer step), reaches the LoRA and tells the world's pictures from scrambled ones, and a run logs it."""

import json

import numpy as np
import pytest
import torch

from omniroll.config import ConfigError, load_config
from omniroll.tasks.renders import check_render_size, render_task_prompt

SHAPES_PROMPTS = ["a red circle", "a circle above a square", "two triangles", "a red circle and a blue square"]


def test_a_render_passes_its_worlds_checker_in_the_layout_a_model_decodes_to():
    from omniroll.tasks.moving_shapes.grammar import parse_prompt as parse_clip
    from omniroll.tasks.moving_shapes.judge import score_clip
    from omniroll.tasks.shapes.grammar import parse_prompt
    from omniroll.tasks.shapes.report import score_picture

    for i, prompt in enumerate(SHAPES_PROMPTS):
        picture = render_task_prompt("shapes", prompt, i)
        assert picture.shape == (3, 64, 64) and picture.dtype == np.uint8
        assert score_picture(parse_prompt(prompt), picture.transpose(1, 2, 0)).strict
        assert np.array_equal(picture, render_task_prompt("shapes", prompt, i))
    assert not np.array_equal(render_task_prompt("shapes", SHAPES_PROMPTS[0], 0),
                              render_task_prompt("shapes", SHAPES_PROMPTS[0], 1))
    clip_prompt = "a red circle moving left"
    clip = render_task_prompt("moving_shapes", clip_prompt, 3)
    assert clip.shape == (9, 3, 64, 64) and score_clip(parse_clip(clip_prompt), clip).strict


def test_the_size_the_world_prompts_and_the_world_itself_are_checked_by_name():
    check_render_size("shapes", 64, 64, 1, SHAPES_PROMPTS, "f")
    with pytest.raises(ValueError, match=r"f: the shapes world renders 64 x 64 px, 1 frame\(s\); .* got 32 / 64 / 1"):
        check_render_size("shapes", 32, 64, 1, SHAPES_PROMPTS, "f")
    with pytest.raises(ValueError, match="f: the moving_shapes world renders 64 x 64 px, 9 frame"):
        check_render_size("moving_shapes", 64, 64, 1, [], "f")
    with pytest.raises(ValueError, match="f: the shapes world cannot render the training prompt 'a blue car'"):
        check_render_size("shapes", 64, 64, 1, ["a red circle", "a blue car"], "f")
    with pytest.raises(ValueError, match="f: the 'text' world has no renderer"):
        check_render_size("text", 64, 64, 1, [], "f")


def config(model, size=64, **trainer):
    return load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": model, "max_batch_size": 16, "num_threads": 1},
        "pipeline": {"height": size, "width": size, "num_inference_steps": 4, "guidance_scale": 1.0,
                     "max_sequence_length": 8, "output_type": "both"},
        "agent": {"num_workers": 1},
        "reward": {"num_workers": 1, "functions": {"shapes": {"fn": "shapes"}}},
        "n": 2, "prompt_length": 77, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"algorithm": "awm", "prompts": SHAPES_PROMPTS, "prompts_per_step": 2, "lr": 0.01,
                    "micro_batch_size": 2, "steps": 2, "num_threads": 1,
                    "data_regularizer": {"weight": 0.5, "batch": 2}, **trainer},
    })


def test_the_config_refuses_a_regulariser_it_cannot_render_for_before_any_work(tiny_sd3_path):
    config(tiny_sd3_path)
    with pytest.raises(ConfigError, match="trainer.data_regularizer: the shapes world renders 64 x 64 px"):
        config(tiny_sd3_path, size=32)
    with pytest.raises(ConfigError, match="cannot render the training prompt 'a blue car'"):
        config(tiny_sd3_path, prompts=["a blue car"], prompts_per_step=1)
    with pytest.raises(ConfigError, match="data_regularizer: .* use it with world_size 1"):
        config(tiny_sd3_path, world_size=2)
    with pytest.raises(ConfigError, match="weight"):
        config(tiny_sd3_path, data_regularizer={"weight": 0.0})


@pytest.fixture(scope="module")
def shapes_policy():
    from omniroll.models import resolve_model
    from omniroll.train.policy import Policy

    return Policy(resolve_model("shapes"), "lora", 4, 8.0)


def test_encoding_a_render_and_decoding_it_gives_the_render_back_on_the_shapes_model(shapes_policy):
    adapter = shapes_policy.adapter
    pictures = np.stack([render_task_prompt("shapes", p, 7) for p in SHAPES_PROMPTS])
    x = torch.from_numpy(pictures).float() / 127.5 - 1.0
    with torch.no_grad():
        z = adapter.encode_pixels(x)
        back = adapter.decode(z)
    assert z.shape == (4, *adapter.latent_shape(64, 64)) and z.dtype == torch.float32
    psnr = 10 * torch.log10(4.0 / ((back.clamp(-1, 1) - x) ** 2).mean())
    assert psnr > 25, float(psnr)  # the shapes VAE reconstructs its world (a random VAE: about 5 dB)
    assert 0.3 < float(z.std()) < 3.0  # in the denoiser's normalisation (shift and scale applied)


def test_the_loss_is_a_function_of_the_step_reaches_the_lora_and_knows_the_worlds_pictures(shapes_policy):
    from omniroll.train.data_regularizer import DataRegularizer

    cfg = config("shapes")
    reg = DataRegularizer(shapes_policy.adapter, "shapes", SHAPES_PROMPTS, cfg.pipeline, 0.5, 4, seed=3)
    execution = {"batch_invariant": False}
    prompts, pixels = reg.renders(5, 0)
    again, same = reg.renders(5, 0)
    assert prompts == again and np.array_equal(pixels, same) and pixels.shape == (4, 3, 64, 64)
    assert not np.array_equal(pixels, reg.renders(5, 1)[1])  # another optimizer step, other renders
    shapes_policy.adapter.denoiser.zero_grad(set_to_none=True)
    weighted, raw = reg.term(5, execution, "cpu")(0)
    weighted.backward()
    assert float(weighted.detach()) == pytest.approx(0.5 * raw)
    assert raw == pytest.approx(float(reg.loss(5, 0, execution, "cpu")))
    grads = [p.grad for p in shapes_policy.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    shapes_policy.adapter.denoiser.zero_grad(set_to_none=True)

    # the shapes model was trained on renders like these: its flow-matching loss on them is well below its loss on
    # the same pixels scrambled (what a model that had forgotten its world would see), at the same noise and timesteps
    perm = np.random.default_rng(0).permutation(64 * 64)
    scrambled = pixels.reshape(4, 3, -1)[:, :, perm].reshape(pixels.shape)
    with torch.no_grad():
        world = [float(reg.loss_of(reg.rows(prompts, pixels, execution), s, 0)) for s in range(3)]
        other = [float(reg.loss_of(reg.rows(prompts, scrambled, execution), s, 0)) for s in range(3)]
    assert max(world) < min(other), (world, other)


@pytest.mark.slow  # slow: trains on Ray
def test_a_run_with_the_regulariser_logs_its_loss_every_step(ray_cluster, tiny_sd3_path, tmp_path):
    from omniroll.train import Trainer

    with Trainer(config(tiny_sd3_path), str(tmp_path / "run"), log=lambda s: None) as tr:
        hist = tr.train()
    assert len(hist) == 2 and all(np.isfinite(m["data_loss"]) and m["data_loss"] > 0 for m in hist)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["data_loss"] for m in logged] == [m["data_loss"] for m in hist]
    assert hist[0]["data_loss"] != hist[1]["data_loss"]  # other renders, other noise, moved weights


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_encode_pixels_normalises_as_decode_denormalises(family, tmp_path):
    """decode(encode_pixels(x)) is the VAE's own decode of its posterior mean: the normalisations cancel (latents mean
    and std, or shift and scale, set away from 0 / 1 so that a mismatch shows)."""
    from omniroll.models import load_adapter
    from omniroll.models.tiny import build_tiny

    adapter = load_adapter(build_tiny(family, str(tmp_path / family)))
    vae = adapter.vae
    if family == "wan":
        z_dim = vae.config.z_dim
        vae.register_to_config(latents_mean=[0.3 * i for i in range(z_dim)],
                               latents_std=[0.5 + i for i in range(z_dim)])
        x = torch.rand(1, 5, 3, 16, 16) * 2 - 1  # [B, T, 3, H, W]: as decode returns a clip
        own = vae.decode(vae.encode(x.permute(0, 2, 1, 3, 4)).latent_dist.mean).sample.permute(0, 2, 1, 3, 4)
    else:
        vae.register_to_config(shift_factor=0.4, scaling_factor=2.5)
        x = torch.rand(1, 3, 32, 32) * 2 - 1
        own = vae.decode(vae.encode(x).latent_dist.mean).sample
    with torch.no_grad():
        z = adapter.encode_pixels(x)
        assert torch.allclose(adapter.decode(z), own.detach(), atol=1e-5)
        assert z.shape[1:] == adapter.latent_shape(x.shape[-2], x.shape[-1], x.shape[1] if x.dim() == 5 else 1)
