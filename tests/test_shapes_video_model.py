"""The shapes-video model's pretraining at toy size: the decode without the clamp, a run interrupted twice and
resumed ending bitwise where an uninterrupted run ends, snapshots bitwise the checkpoints of shorter runs, and its
checkpoint running in the engine through the Wan adapter (its training data: test_shapes_video_data.py)."""

import dataclasses
import json
import shutil

import pytest
import torch

from omniroll.models.shapes_video import REMAKE, WHAT
from omniroll.models.shipped import verified
from omniroll.models.shapes_video.recipe import TOY

TOY_EVERY_2 = ["--override", "resume_every=2"]


def tensors_of(ckpt) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(ckpt.rglob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[f"{f.relative_to(ckpt)}:{k}"] = v
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The toy recipe (state saved every 2 steps, a snapshot at step 2) run once through the CLI."""
    from omniroll.cli import main

    out = tmp_path_factory.mktemp("sv") / "a"
    assert main(["pretrain", "shapes-video", "--toy", "--out", str(out), "--quiet", "--snapshot-every", "2",
                 *TOY_EVERY_2]) == 0
    return out


def test_decode_unclamped_is_diffusers_decode_before_its_clamp_and_passes_gradient_beyond_it():
    from omniroll.models.shapes_video.vae import build_vae, decode_unclamped

    vae = build_vae(TOY.vae)
    z = torch.randn(1, TOY.vae.z_dim, 2, 8, 8, generator=torch.Generator().manual_seed(0)) * 50
    with torch.no_grad():
        raw = decode_unclamped(vae, z)
        assert torch.equal(raw.clamp(-1, 1), vae.decode(z).sample)
    assert raw.shape == (1, 3, 5, 32, 32)  # 1 + 4k frames from 1 + k latent frames
    beyond = raw.abs() > 1
    assert beyond.any(), "the test needs pixels beyond the clamp"
    z.requires_grad_(True)
    decode_unclamped(vae, z)[beyond].sum().backward()
    assert z.grad.abs().sum() > 0  # diffusers' clamped decode gives these pixels zero gradient
    z.grad = None
    vae.decode(z).sample[beyond].sum().backward()
    assert z.grad is None or z.grad.abs().sum() == 0


def test_the_foreground_phase_weighs_object_pixels_and_is_the_plain_loss_at_weight_one():
    from omniroll.models.shapes_video.vae import build_vae, pixel_weights, vae_step

    x = torch.full((2, 3, 5, 16, 16), -0.2)
    x[0, :, :, 4:8, 6:10] = torch.tensor([0.9, -0.9, -0.9]).view(3, 1, 1, 1)  # a red object
    x[1, 2, :, 2:3, 2:4] = -0.25  # within the threshold of the background: not an object
    recipe = dataclasses.replace(TOY.vae, foreground_weight=7.0)
    w = pixel_weights(x, recipe)
    assert w.shape == (2, 1, 5, 16, 16) and float(w[0, 0, :, 4:8, 6:10].min()) == 7.0
    assert float(w.sum()) == 2 * 5 * 16 * 16 + 6.0 * 5 * 4 * 4  # the object's pixels, and no other
    vae = build_vae(TOY.vae)
    plain, _ = vae_step(vae, x, TOY.vae, torch.Generator().manual_seed(3))
    at_one, _ = vae_step(vae, x, dataclasses.replace(TOY.vae, foreground_weight=1.0), torch.Generator().manual_seed(3),
                         foreground=True)
    weighted, _ = vae_step(vae, x, recipe, torch.Generator().manual_seed(3), foreground=True)
    assert torch.allclose(plain, at_one, rtol=1e-5) and not torch.allclose(plain, weighted, rtol=1e-3)


@pytest.mark.slow  # slow: trains a model (the toy recipe, twice)
def test_an_interrupted_pretraining_resumes_to_the_bitwise_same_checkpoint(uninterrupted, tmp_path):
    from omniroll.models.shapes_video.pretrain import pretrain

    recipe = dataclasses.replace(TOY, resume_every=2)
    out = tmp_path / "b"
    seen = []

    def stop_at(where):
        def on_step(phase, step):
            seen.append((phase, step))
            if (phase, step) == where:
                raise KeyboardInterrupt

        return on_step

    with pytest.raises(KeyboardInterrupt):  # in the VAE's clip steps, one step after a save
        pretrain(recipe, str(out), progress=False, log=lambda s: None, on_step=stop_at(("vae", 3)))
    assert not (out / "checkpoint").exists()
    seen.clear()
    with pytest.raises(KeyboardInterrupt):  # in the VAE's foreground-weighted steps, before their first save
        pretrain(recipe, str(out), progress=False, log=lambda s: None, on_step=stop_at(("vae_foreground", 1)))
    assert seen == [("vae", 3), ("vae", 4), ("vae_foreground", 1)]  # step 3 was not saved: it is run again
    seen.clear()
    first = pretrain(recipe, str(out), progress=False, log=lambda s: None, on_step=stop_at(None), until="vae")
    assert seen == [("vae_foreground", 1), ("vae_foreground", 2)]  # the plain phase is done: none of it again
    assert first["checkpoint"] is None and first["vae_check"]["clips"] == TOY.check_clips
    assert json.loads((out / "pretrain.json").read_text())["until"] == "vae" and not (out / "checkpoint").exists()
    seen.clear()
    with pytest.raises(KeyboardInterrupt):  # in the transformer, one step after a save
        pretrain(recipe, str(out), progress=False, log=lambda s: None, on_step=stop_at(("transformer", 3)))
    assert seen[0] == ("transformer", 1)  # the VAE's phase is done: no step of it runs again
    seen.clear()
    record = pretrain(recipe, str(out), progress=False, log=lambda s: None, on_step=stop_at(None))
    assert seen == [("transformer", 3), ("transformer", 4)]
    a, b = uninterrupted / "checkpoint", out / "checkpoint"
    assert (a / "SHA256SUMS").read_text() == (b / "SHA256SUMS").read_text()
    ta, tb = tensors_of(a), tensors_of(b)
    assert sorted(ta) == sorted(tb) and len(ta) > 50
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert json.loads(json.dumps(record["recipe"])) == json.loads((a / "recipe.json").read_text())
    assert record["vae_check"] == first["vae_check"]
    assert len(record["steps_seconds_all_runs"]) == 2 and record["steps_seconds_all_runs"]["vae"] > 0
    with pytest.raises(ValueError, match="dit"):  # another recipe in the same directory is refused
        pretrain(dataclasses.replace(recipe, dit=dataclasses.replace(recipe.dit, steps=5)), str(out), progress=False)


@pytest.mark.slow  # slow: trains a model (the toy recipe)
def test_the_pretrained_checkpoint_is_a_wan_pipeline_the_engine_samples_clips_from(uninterrupted):
    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
    from omniroll.config import load_config

    ckpt = uninterrupted / "checkpoint"
    assert verified(str(ckpt), WHAT, REMAKE) == str(ckpt)
    assert json.loads((ckpt / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    defaults = json.loads((ckpt / "omniroll_defaults.json").read_text())["pipeline"]
    assert (defaults["num_frames"], defaults["height"], defaults["max_sequence_length"]) == (9, 64, 12)
    record = json.loads((uninterrupted / "pretrain.json").read_text())
    assert record["vae_check"]["clips"] == TOY.check_clips and 0 <= record["vae_check"]["strict_overall"] <= 1
    assert record["seconds_per_step"]["transformer"] > 0 and (uninterrupted / "loss_curve.png").is_file()
    engine = DiffusionEngine.from_pretrained(str(ckpt), max_batch_size=2)
    try:
        cfg = load_config({"engine": {"model": str(ckpt)}})  # the checkpoint's defaults: 9 frames, 64 px, 12 tokens
        sp = SamplingParams(**{**cfg.sampling_params(), "num_inference_steps": 2})
        out = engine.generate([GenerationRequest(request_id="r", prompt="a red circle moving left", seed=0,
                                                 sampling_params=sp)])[0]
    finally:
        engine.shutdown()
    assert out.diffusion_output.shape == (9, 3, 64, 64) and out.diffusion_output.dtype == torch.uint8
    assert out.log_probs.shape == (1,) and torch.isfinite(out.log_probs).all()
    assert out.extra_fields["all_latents"].shape[1:] == (TOY.vae.z_dim, 3, 16, 16)


#: 10 steps at the toy's shift 3: timesteps >= 875 (the first expert) for steps 0-2, the second expert after; a window
#: of 2 drawn in [2, 4) is steps 2 and 3, across the switch
SWITCHING = dict(num_inference_steps=10, noise_level=0.8, sde_type="sde", sde_window_size=2, sde_window_range=(2, 4))


@pytest.fixture(scope="module")
def two_experts(uninterrupted, tmp_path_factory):
    """The toy checkpoint's two-expert copy, through the CLI."""
    from omniroll.cli import main

    out = tmp_path_factory.mktemp("sv2") / "two"
    assert main(["pretrain", "shapes-video", "--two-experts", "--from", str(uninterrupted / "checkpoint"), "--out",
                 str(out)]) == 0
    return out / "checkpoint"


@pytest.mark.slow  # slow: trains a model (the toy recipe)
def test_two_experts_of_one_transformer_draw_its_clips_bitwise_and_switch_at_the_boundary(uninterrupted, two_experts,
                                                                                        tmp_path, capsys):
    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams
    from omniroll.cli import main
    from omniroll.models import resolve_model

    index = json.loads((two_experts / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == index["transformer"]
    assert verified(str(two_experts), WHAT, REMAKE) == str(two_experts)
    assert (two_experts / "omniroll_defaults.json").read_text() == (
        uninterrupted / "checkpoint" / "omniroll_defaults.json").read_text()  # its task and defaults
    with pytest.raises(Exception, match=r"max_sequence_length must be an int in \[1, 12\], got 128"):
        engine = DiffusionEngine.from_pretrained(str(two_experts), max_batch_size=8)
        try:  # its BERT has 12 positions: a longer text is refused before any work, naming the field
            engine.generate([GenerationRequest(request_id="long", prompt="a red circle moving left", seed=0,
                                               sampling_params=SamplingParams(**SWITCHING, max_sequence_length=128))])
        finally:
            engine.shutdown()
    sp = SamplingParams(**SWITCHING, logprobs=True, max_sequence_length=12)
    outs = {}
    for name, path in (("one", uninterrupted / "checkpoint"), ("two", two_experts)):
        engine = DiffusionEngine.from_pretrained(str(path), max_batch_size=8)
        try:
            outs[name] = engine.generate([GenerationRequest(request_id=f"{name}{i}", prompt=p, seed=5 + i,
                                                            sampling_params=sp)
                                          for i, p in enumerate(["a red circle moving left",
                                                                 "a square turning from blue to green"])])
        finally:
            engine.shutdown()
    for a, b in zip(outs["one"], outs["two"]):
        assert torch.equal(a.diffusion_output, b.diffusion_output) and torch.equal(a.log_probs, b.log_probs)
        assert "expert_indices" not in a.extra_fields
        assert b.extra_fields["sde_window"] == (2, 4) and b.extra_fields["expert_indices"].tolist() == [0, 1]
        assert b.extra_fields["all_timesteps"][0] >= 875 > b.extra_fields["all_timesteps"][1]

    for argv, words in (([], "needs --from MODEL"), (["--from", str(two_experts)], "already has two experts"),
                        (["--from", str(uninterrupted / "checkpoint"), "--boundary-ratio", "1.5"],
                         "boundary_ratio must be in (0, 1)"),
                        (["--from", resolve_model("shapes")], "not a Wan checkpoint"),
                        (["--from", str(uninterrupted / "checkpoint"), "--install"], "--install: not with")):
        assert main(["pretrain", "shapes-video", "--two-experts", "--out", str(tmp_path / "x"), *argv]) == 2
        assert words in capsys.readouterr().err
        assert not (tmp_path / "x" / "checkpoint").exists()


@pytest.mark.slow  # slow: trains a model (the toy recipe) and starts Ray
def test_flow_grpo_trains_both_experts_with_exact_ratios_across_the_switch(ray_cluster, two_experts, tmp_path):
    from omniroll.config import load_config
    from omniroll.train import Trainer
    from omniroll.train.checkpoint import find_checkpoint
    from omniroll.train.policy import Policy

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle moving left\na square turning from blue to green\n")
    window = {k: v for k, v in SWITCHING.items() if k != "num_inference_steps"}
    cfg = load_config({
        "replicas": {"count": 1, "num_cpus": 1},
        "engine": {"model": str(two_experts), "max_batch_size": 8, "num_threads": 1},
        "pipeline": {"num_inference_steps": 10}, "algo": window,
        "agent": {"num_workers": 1},  # a reward that differs between clips (a toy model passes no checker)
        "reward": {"num_workers": 1, "functions": {"bright": {"fn": "tests.reward_fns:mean_pixel"}}},
        "n": 2, "seed": 0, "val_kwargs": {"n": 1},
        "trainer": {"algorithm": "flow_grpo", "prompts_file": str(prompts), "prompts_per_step": 2, "lr": 0.01,
                    "micro_batch_size": 4, "steps": 2, "num_threads": 1, "adv_clip_max": 5.0,
                    "lora": {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}},
    })
    with Trainer(cfg, str(tmp_path / "run"), log=lambda _: None) as tr:
        hist = tr.train()
        lora = {k: v.detach().clone() for k, v in tr.policy.denoiser.named_parameters() if "lora_B" in k}
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0, 0.0]  # step 2 rolled out with step 1's weights
    moved = {k.split(".")[0] for k, v in lora.items() if v.abs().sum() > 0}
    assert moved == {"transformer", "transformer_2"}, sorted(lora)[:4]  # the window's two steps train both experts
    again = Policy(str(two_experts), "lora", 4, 8, ["to_q", "to_k", "to_v", "to_out.0"])
    again.load(find_checkpoint(str(tmp_path / "run")))  # the checkpoint keeps each expert's adapter
    assert all(torch.equal(v, dict(again.denoiser.named_parameters())[k]) for k, v in lora.items())


def test_the_cli_refuses_what_shapes_video_does_not_have_before_any_work(tmp_path, capsys):
    from omniroll.cli import main

    assert main(["pretrain", "shapes-video", "--toy", "--out", str(tmp_path / "x"), "--install"]) != 0
    assert "--install: only a full run" in capsys.readouterr().err  # a toy is never the shipped model
    assert main(["pretrain", "shapes-video", "--out", str(tmp_path / "x"), "--override", "vae.clip_steps=-1"]) != 0
    assert "vae.clip_steps" in capsys.readouterr().err
    assert main(["pretrain", "shapes-video", "--out", str(tmp_path / "x"), "--override",
                 "vae.foreground_weight=0.5"]) != 0
    assert "vae.foreground_weight must be a number >= 1.0" in capsys.readouterr().err
    assert main(["pretrain", "shapes", "--out", str(tmp_path / "x"), "--until", "vae"]) != 0
    assert "shapes-video only" in capsys.readouterr().err
    assert main(["pretrain", "shapes", "--out", str(tmp_path / "x"), "--vae-from", "shapes-video"]) != 0
    assert "shapes-video only" in capsys.readouterr().err
    assert main(["pretrain", "shapes-video", "--out", str(tmp_path / "x"), "--vae-from", str(tmp_path)]) != 0
    assert "nor a diffusers checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_in_a_log_the_progress_is_a_line_per_interval_with_the_rate_and_what_is_left():
    import io

    from omniroll.models.shapes_video.progress import LogLines

    out = io.StringIO()
    bar = LogLines(total=10, desc="vae", every_s=0.0, file=out)
    bar.reset(total=10)
    bar.n = bar.last_print_n = bar.initial = 4  # a phase resumed at step 4
    bar.refresh()
    bar.set_postfix(loss="0.1234")
    bar.update(1)
    bar.every_s = 3600.0  # no more lines until close
    bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "vae: 4/10 steps (40 %)"
    assert lines[1].startswith("vae: 5/10 steps (50 %), ") and "s/step, ~" in lines[1] and lines[1].endswith(
        "min left, loss 0.1234")
    assert lines[2].startswith("vae: 6/10 steps (60 %)") and len(lines) == 3


@pytest.mark.slow  # slow: trains a model (the toy recipe's transformer)
def test_a_run_on_another_runs_vae_trains_only_the_transformer_and_ends_bitwise_at_the_full_runs_checkpoint(
        uninterrupted, tmp_path):
    from omniroll.models.shapes_video.pretrain import pretrain

    recipe = dataclasses.replace(TOY, resume_every=2)
    seen = []
    record = pretrain(recipe, str(tmp_path / "v"), progress=False, log=lambda s: None,
                      on_step=lambda phase, step: seen.append(phase), vae_from=str(uninterrupted / "checkpoint"))
    assert set(seen) == {"transformer"} and len(seen) == TOY.dit.steps
    a, b = tensors_of(uninterrupted / "checkpoint"), tensors_of(tmp_path / "v" / "checkpoint")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    for config in ("vae/config.json", "transformer/config.json"):  # no local path recorded in what ships
        ours, theirs = tmp_path / "v" / "checkpoint" / config, uninterrupted / "checkpoint" / config
        assert ours.read_text() == theirs.read_text()
    full = json.loads((uninterrupted / "pretrain.json").read_text())
    assert record["vae_check"] == full["vae_check"] and record["vae_from"] == str(uninterrupted / "checkpoint")
    assert record["steps_seconds_all_runs"]["vae"] == 0 and (tmp_path / "v" / "loss_curve.png").is_file()
    with pytest.raises(ValueError, match="vae_from"):  # the same directory without it: another run, refused
        pretrain(recipe, str(tmp_path / "v"), progress=False, log=lambda s: None)
    other = dataclasses.replace(recipe, vae=dataclasses.replace(recipe.vae, lr=1e-4))
    with pytest.raises(ValueError, match=r"trained by another VAE recipe \(\['vae'\] differ"):
        pretrain(other, str(tmp_path / "w"), progress=False, vae_from=str(uninterrupted / "checkpoint"))
    with pytest.raises(ValueError, match=f"{tmp_path / 'recipe.json'} not found"):
        pretrain(recipe, str(tmp_path / "w"), progress=False, vae_from=str(tmp_path))
    assert not (tmp_path / "w").exists()  # refused before any work


def test_a_snapshot_is_bitwise_the_checkpoint_of_a_run_that_many_steps_long_and_a_resumed_run_writes_a_missed_one(
        uninterrupted, tmp_path):
    from omniroll.models.shapes_video.pretrain import pretrain

    recipe, vae = dataclasses.replace(TOY, resume_every=2), str(uninterrupted / "checkpoint")

    def stop_at_2(phase, step):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # after step 2's state and snapshot are saved
        pretrain(recipe, str(tmp_path / "s"), progress=False, log=lambda s: None, on_step=stop_at_2, vae_from=vae,
                 snapshot_every=2)
    snap = tmp_path / "s" / "snapshots" / "step_2"
    assert (snap / "SHA256SUMS").is_file()
    shutil.rmtree(snap)  # as if interrupted between the state's save and the snapshot's
    record = pretrain(recipe, str(tmp_path / "s"), progress=False, log=lambda s: None, vae_from=vae, snapshot_every=2)
    assert record["snapshots"] == [str(snap)]  # step 2 written again at the resumed start; none at the last step
    short = dataclasses.replace(recipe, dit=dataclasses.replace(recipe.dit, steps=2))
    pretrain(short, str(tmp_path / "two"), progress=False, log=lambda s: None, vae_from=vae)
    final = tmp_path / "s" / "checkpoint"  # and the snapshots did not disturb the run
    cli = uninterrupted / "snapshots" / "step_2"  # the CLI's, its VAE trained in the run
    for a, b in ((snap, tmp_path / "two" / "checkpoint"), (cli, snap), (final, uninterrupted / "checkpoint")):
        assert (a / "SHA256SUMS").read_text() == (b / "SHA256SUMS").read_text()
        assert (a / "recipe.json").read_text() == (b / "recipe.json").read_text()
        ta, tb = tensors_of(a), tensors_of(b)
        assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    decaying = dataclasses.replace(recipe, dit=dataclasses.replace(recipe.dit, cosine_decay=True))
    with pytest.raises(ValueError, match="snapshot_every: with dit.cosine_decay"):
        pretrain(decaying, str(tmp_path / "c"), progress=False, vae_from=vae, snapshot_every=2)
    with pytest.raises(ValueError, match="snapshot_every must be >= 0 steps, got -1"):
        pretrain(recipe, str(tmp_path / "c"), progress=False, vae_from=vae, snapshot_every=-1)
    assert not (tmp_path / "c").exists()  # refused before any work
