"""The shapes model: the shipped checkpoint (integrity, its sampling defaults, loading in the engine), `omniroll
pretrain shapes` end to end on a miniature recipe, and `omniroll eval`."""

import json
import os
import shutil

import pytest
import torch

from omniroll.config import ConfigError, load_config
from omniroll.models import resolve_model, sampling_defaults
from omniroll.models.shapes import CHECKPOINT, REMAKE, WHAT
from omniroll.models.shipped import SUMS_FILE, file_digests, verified


def test_the_shipped_checkpoint_matches_its_sha256_sums_and_names_a_changed_file(tmp_path):
    path = resolve_model("shapes")
    assert path == CHECKPOINT and os.path.isfile(os.path.join(path, SUMS_FILE))
    total = sum(os.path.getsize(os.path.join(path, f)) for f in file_digests(path))
    assert total < 25e6  # it lives in git
    copy = str(tmp_path / "ckpt")
    shutil.copytree(path, copy)
    assert verified(copy, WHAT, REMAKE) == copy
    weights = os.path.join(copy, "transformer", "diffusion_pytorch_model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\0")
    with pytest.raises(FileNotFoundError, match="transformer/diffusion_pytorch_model.safetensors"):
        verified(copy, WHAT, REMAKE)


def test_a_models_sampling_defaults_sit_between_the_schema_and_the_user():
    assert sampling_defaults("tiny") == {}
    cfg = load_config({"engine": {"model": "shapes"}})
    assert (cfg.pipeline.height, cfg.pipeline.width, cfg.pipeline.max_sequence_length) == (64, 64, 12)
    cfg = load_config({"engine": {"model": "shapes"}, "pipeline": {"guidance_scale": 2.0}},
                      overrides=["pipeline.num_inference_steps=6"])
    assert (cfg.pipeline.guidance_scale, cfg.pipeline.num_inference_steps, cfg.pipeline.height) == (2.0, 6, 64)
    assert load_config({"engine": {"model": "tiny"}}).pipeline.height == 512  # the schema's
    with pytest.raises(ConfigError, match="max_sequence_length"):
        load_config({"engine": {"model": "shapes"}, "pipeline": {"max_sequence_length": 128}})


def test_a_shapes_reward_refuses_a_training_prompt_outside_the_grammar_before_anything_starts():
    raw = {"engine": {"model": "shapes"}, "n": 2, "reward": {"functions": {"geneval": {"fn": "shapes"}}},
           "trainer": {"prompts": ["a circle", "three squars"], "prompts_per_step": 1}}
    with pytest.raises(ConfigError, match=r"trainer.prompts: prompt 1: prompt 'three squars' .* nearest valid "
                                          r"prompt is 'three squares'"):
        load_config(raw)
    raw["reward"]["functions"]["strict"] = {"fn": "shapes_strict", "weight": 0.0}
    with pytest.raises(ConfigError) as e:  # two shapes rewards: the prompt is still named once
        load_config(raw)
    assert str(e.value).count("three squars") == 1


def test_the_shipped_model_generates_the_worlds_pictures_in_the_engine():
    import torch

    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams

    cfg = load_config({"engine": {"model": "shapes"}})
    engine = DiffusionEngine.from_pretrained(resolve_model("shapes"), max_batch_size=8)
    try:
        sp = SamplingParams(**{**cfg.sampling_params(), "sde_window_size": 2, "sde_window_range": (0, 4)})
        out = engine.generate([GenerationRequest(request_id="r", prompt="a red circle", seed=0, sampling_params=sp)])[0]
    finally:
        engine.shutdown()
    assert out.diffusion_output.shape == (3, 64, 64) and out.diffusion_output.dtype == torch.uint8
    assert out.log_probs.shape == (2,) and torch.isfinite(out.log_probs).all()
    assert out.extra_fields["all_latents"].shape[1:] == (4, 16, 16)


@pytest.mark.slow  # slow: trains a model
def test_pretrain_runs_the_whole_recipe_in_miniature_and_eval_scores_its_checkpoint(tmp_path, capsys):
    from omniroll.cli import main

    out = tmp_path / "pt"
    mini = ["vae.steps=4", "vae.batch_size=4", "dit.steps=3", "dit.batch_size=4", "dit.num_latents=64",
            "check_pictures=8", "torch_threads=1"]
    assert main(["pretrain", "shapes", "--out", str(out), "--no-eval", "--quiet",
                 *sum([["--override", o] for o in mini], [])]) == 0
    record = json.loads((out / "pretrain.json").read_text())
    assert record["recipe"]["dit"]["steps"] == 3 and record["times"]["transformer_s"] > 0
    assert set(record["vae_check"]["checker_on_reconstructions"]["categories"]) <= set(
        ["single_object", "two_object", "counting", "colors", "position", "color_attr"])
    ckpt = out / "checkpoint"
    assert verified(str(ckpt), WHAT, REMAKE) == str(ckpt) and (out / "loss_curve.png").is_file()
    assert json.loads((ckpt / "omniroll_defaults.json").read_text())["pipeline"]["height"] == 64
    prompts = tmp_path / "p.txt"
    prompts.write_text("a circle\n\nthree squares\n")
    capsys.readouterr()
    assert main(["eval", "--model", str(ckpt), "--prompts", str(prompts), "--seeds", "2", "--out",
                 str(tmp_path / "ev"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "single_object" in printed and "counting" in printed and "overall" in printed
    ev = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert ev["overall"]["n"] == 4 and len(ev["pictures"]) == 4 and (tmp_path / "ev" / "eval_grid.png").is_file()
    again = tmp_path / "ev2"
    assert main(["eval", "--model", str(ckpt), "--prompts", str(prompts), "--seeds", "2", "--out", str(again),
                 "--quiet"]) == 0
    assert json.loads((again / "eval.json").read_text())["pictures"] == ev["pictures"]  # fixed seeds, the ODE


def test_eval_draws_the_configs_trainer_evaluation_seeds_unless_seeds_is_given(tmp_path):
    """`omniroll eval --config` of a training config evaluates as its trainer does (trainer.evaluation.seeds pictures
    per prompt); --seeds wins; a config without a trainer's evaluation draws 16."""
    from omniroll.cli import main
    from omniroll.cli.eval import eval_seeds

    demo = os.path.join(os.path.dirname(__file__), "..", "examples", "shapes_demo.yaml")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a circle\nthree squares\n")
    drawn = {}
    for name, flags in (("config", []), ("flag", ["--seeds", "1"])):
        assert main(["eval", "--config", demo, "--override", "trainer.evaluation.seeds=3", "--prompts", str(prompts),
                     "--steps", "2", "--out", str(tmp_path / name), "--quiet", *flags]) == 0
        drawn[name] = json.loads((tmp_path / name / "eval.json").read_text())["overall"]["n"]
    assert drawn == {"config": 6, "flag": 2}
    assert eval_seeds(load_config({"engine": {"model": "shapes"}}), None) == 16
    assert eval_seeds(load_config(demo), None) == 16 and eval_seeds(load_config(demo), 5) == 5


def test_distillation_fits_the_teachers_guided_velocity_and_leaves_the_teacher_unchanged():
    """The first step's loss is the student's (= the teacher's) distance to v_u + w (v_c - v_u): 0 at w = 1, and at
    w = 4.5 what the teacher's two velocities give, computed here apart; the teacher's weights do not move."""
    from diffusers import SD3Transformer2DModel

    from omniroll.models.shapes.distill import DistillRecipe, distill_transformer

    teacher = SD3Transformer2DModel.from_pretrained(os.path.join(resolve_model("shapes"), "transformer"))
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(8, 4, 16, 16, generator=g)
    embeds, pooled = torch.randn(3, 12, teacher.config.joint_attention_dim, generator=g), torch.randn(
        3, teacher.config.pooled_projection_dim, generator=g)
    ids = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    losses = {}
    for w in (1.0, 4.5):
        recipe = DistillRecipe(steps=2, guidance=w, batch_size=4, cfg_dropout=0.0, seed=5)
        ema, hist = distill_transformer(teacher, recipe, latents, ids, embeds, pooled, empty=2)
        losses[w] = hist[0]["loss"]
        assert len(hist) == 2 and all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert losses[1.0] < 1e-9
    # the same batch as the recipe's first step (its generator: indices, dropout draws, t, eps)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(8, (4,), generator=g)
    torch.rand(4, generator=g)
    t = torch.sigmoid(torch.randn(4, generator=g))
    eps = torch.randn(latents[idx].shape, generator=g)
    x_t = (1 - t[:, None, None, None]) * latents[idx] + t[:, None, None, None] * eps
    with torch.no_grad():
        v_c, v_u = (teacher(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=embeds[c],
                            pooled_projections=pooled[c], return_dict=False)[0]
                    for c in (ids[idx], torch.full((4,), 2)))
    assert losses[4.5] == pytest.approx(float(((4.5 - 1) * (v_c - v_u)).pow(2).mean()), rel=1e-4)


@pytest.mark.slow  # slow: trains a model
def test_pretrain_from_a_checkpoint_distils_it_into_a_cfg_free_model(tmp_path, capsys):
    """`omniroll pretrain shapes --from shapes --distill N` (in miniature): a verified checkpoint whose default guidance
    is 1.0, whose transformer moved and whose VAE and text encoders are the source's; --from without --distill is
    refused naming the flag."""
    from safetensors.torch import load_file

    from omniroll.cli import main
    from omniroll.tasks.shapes.splits import prompts_of

    out = tmp_path / "distilled"
    assert main(["pretrain", "shapes", "--from", "shapes", "--distill", "2", "--out", str(out), "--quiet",
                 "--override", "distill.num_latents=8", "--override", "distill.batch_size=4",
                 "--override", "eval_seeds=1"]) == 0
    ckpt, shipped = out / "checkpoint", resolve_model("shapes")
    assert verified(str(ckpt), WHAT, REMAKE) == str(ckpt) and (out / "loss_curve.png").is_file()
    assert json.loads((ckpt / "omniroll_defaults.json").read_text())["pipeline"]["guidance_scale"] == 1.0
    assert json.loads((ckpt / "recipe.json").read_text())["distill"]["steps"] == 2
    record = json.loads((out / "pretrain.json").read_text())
    assert record["source"] == os.path.abspath(shipped) and record["times"]["distill_s"] > 0
    # evaluated in its own regime (its default guidance, CFG off), every prompt of both splits once
    assert [record["evaluation"][s]["overall"]["n"] for s in ("train", "heldout")] == [
        len(prompts_of("train")), len(prompts_of("heldout"))]
    assert json.loads((out / "eval_train.json").read_text())["sampling"]["guidance_scale"] == 1.0
    digests, theirs = file_digests(str(ckpt)), file_digests(shipped)
    assert digests["vae/diffusion_pytorch_model.safetensors"] == theirs["vae/diffusion_pytorch_model.safetensors"]
    assert digests["text_encoder/model.safetensors"] == theirs["text_encoder/model.safetensors"]
    new, old = (load_file(os.path.join(d, "transformer", "diffusion_pytorch_model.safetensors"))
                for d in (ckpt, shipped))
    assert new.keys() == old.keys() and not all(torch.equal(new[k], old[k]) for k in new)
    capsys.readouterr()
    assert main(["pretrain", "shapes", "--from", "shapes", "--out", str(tmp_path / "no")]) == 2
    assert "--from" in capsys.readouterr().err and not (tmp_path / "no").exists()
    assert main(["pretrain", "shapes", "--from", str(ckpt), "--distill", "2", "--out", str(tmp_path / "no")]) == 2
    assert "already guidance-distilled" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_a_lora_distillation_moves_only_the_adapted_projections_and_returns_a_plain_transformer(tmp_path, capsys):
    """`distill.lora_rank` r > 0: the teacher is left as it was, and the student comes back with its adapter merged
    (the teacher's own parameter names, no LoRA layer left), moved only in the weight matrices of the adapted
    projections; a rank outside [0, 512] is refused before any work, naming the field."""
    from diffusers import SD3Transformer2DModel

    from omniroll.cli import main
    from omniroll.models.shapes.distill import LORA_TARGETS, DistillRecipe, distill_transformer

    teacher = SD3Transformer2DModel.from_pretrained(resolve_model("shapes"), subfolder="transformer")
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    c, g = teacher.config, torch.Generator().manual_seed(0)
    latents = torch.randn(8, c.in_channels, c.sample_size, c.sample_size, generator=g)
    embeds = torch.randn(3, 12, c.joint_attention_dim, generator=g)
    pooled = torch.randn(3, c.pooled_projection_dim, generator=g)
    recipe, caps = DistillRecipe(steps=3, batch_size=4, lr=1e-2, lora_rank=4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ema, hist = distill_transformer(teacher, recipe, latents, caps, embeds, pooled, empty=2)
    assert len(hist) == 3 and all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    after = ema.module.state_dict()
    torch.manual_seed(12345)  # the adapter's init comes from the recipe's seed, not torch's global generator
    again = distill_transformer(teacher, recipe, latents, caps, embeds, pooled, empty=2)[0].module.state_dict()
    assert all(torch.equal(again[k], after[k]) for k in after)
    assert after.keys() == before.keys() and not any("lora" in n for n, _ in ema.module.named_modules())
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    adapted = {k for k in after if k.endswith(".weight") and any(k.endswith(f".{t}.weight") for t in LORA_TARGETS)}
    assert moved and moved <= adapted
    capsys.readouterr()
    assert main(["pretrain", "shapes", "--from", "shapes", "--distill", "2", "--override", "distill.lora_rank=-1",
                 "--out", str(tmp_path / "no")]) == 2
    assert "distill.lora_rank must be an int in [0, 512]" in capsys.readouterr().err and not (tmp_path / "no").exists()
    assert main(["pretrain", "shapes", "--from", "shapes", "--distill", "2", "--override", "distill.lora_rank=four",
                 "--out", str(tmp_path / "no")]) == 2
    assert "got 'four'" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_eval_refuses_a_prompt_file_line_outside_the_grammar_naming_it(tmp_path, capsys):
    from omniroll.cli import main

    bad = tmp_path / "bad.txt"
    bad.write_text("a circle\na blue squre\n")
    assert main(["eval", "--model", "shapes", "--prompts", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "'a blue square'" in err
    assert main(["eval", "--model", "shapes", "--prompts", "validation", "--out", str(tmp_path / "o")]) == 2
    assert "train" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_the_shapes_rewards_stream_per_category_extras_and_fail_outside_the_grammar():
    import asyncio

    import numpy as np

    from omniroll.reward import RewardManager, RewardSample
    from omniroll.tasks.shapes.grammar import parse_prompt
    from omniroll.tasks.shapes.render import render
    from omniroll.tasks.shapes.scene import sample_scene

    rng = np.random.default_rng(0)
    prompts = ["three squares", "a red circle", "a circle left of a square"]
    samples = [RewardSample(sample_id=f"s{i}", prompt=p,
                            image=np.ascontiguousarray(render(sample_scene(parse_prompt(p), rng)).transpose(2, 0, 1)))
               for i, p in enumerate(prompts)]
    samples.append(RewardSample(sample_id="wrong", prompt="three circles", image=samples[0].image))
    samples.append(RewardSample(sample_id="bad", prompt="a dog", image=samples[0].image))
    mgr = RewardManager({"geneval": {"fn": "shapes", "max_retries": 0},
                         "strict": {"fn": "shapes_strict", "weight": 0.0, "max_retries": 0},
                         "graded": {"fn": "shapes_continuous", "weight": 0.0, "max_retries": 0}})
    res = asyncio.run(mgr.score(samples))
    assert [r.score for r in res[:4]] == [1.0, 1.0, 1.0, 0.0]
    assert res[0].extra_info["geneval/counting"] == 1.0 and "geneval/colors" not in res[0].extra_info
    assert res[3].extra_info["strict/strict"] == 0.0 and res[3].components["strict"] == 0.0
    assert [r.components["graded"] for r in res[:3]] == [1.0, 1.0, 1.0]  # the renderer's pictures: full credit
    assert res[3].components["graded"] == res[3].extra_info["graded/continuous"] == 0.0  # three squares, no circle
    assert res[4].status == "failed" and res[4].score is None and "nearest valid prompt" in res[4].error


def test_the_checker_agrees_on_the_shipped_vaes_reconstructions():
    """The ceiling of any generator with this VAE: pictures through its posterior mean and decoder still pass (the
    pretraining's own check measured 100 % on 1,200 held-out pictures)."""
    import numpy as np

    from omniroll.models import load_adapter
    from omniroll.models.shapes.data import CaptionedScenes
    from omniroll.models.shapes.vae import reconstruct
    from omniroll.tasks.shapes.report import Report, score_pictures

    vae = load_adapter(resolve_model("shapes")).vae
    caps, pics = CaptionedScenes(seed=2024).batch(120)
    rec = reconstruct(vae, pics)
    assert 10 * np.log10(255.0 ** 2 / np.mean((rec.astype(np.float64) - pics) ** 2)) > 30  # PSNR, dB
    report = Report.from_rows(score_pictures(caps, list(rec)))
    assert report.overall["strict"] >= 0.97 and min(c["strict"] for c in report.categories.values()) >= 0.9


def test_eval_of_a_checkpoint_trained_on_another_model_names_that_model(tmp_path, tiny_sd3_path, capsys):
    """A LoRA checkpoint of the tiny model evaluated on the shapes model: one line naming the model it was trained on
    (it was "internal error: LoRABindError")."""
    from omniroll.cli import main
    from tests.test_export import write_run

    run = write_run(tmp_path / "run", tiny_sd3_path, "lora")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a circle\n")
    rc = main(["eval", "--model", "shapes", "--checkpoint", run, "--prompts", str(prompts), "--seeds", "1",
               "--baseline", "none", "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "internal error" not in err
    assert "does not fit this model" in err and f"--model {tiny_sd3_path}" in err
