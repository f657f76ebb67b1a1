"""`omniroll export` on the tiny SD3: a trainer checkpoint (written by the trainer's own checkpoint writer) exported as
a diffusers LoRA file and as a merged pipeline, loaded by diffusers itself (`load_lora_weights`, `from_pretrained`) and
compared with omniroll's engine at the same seed and ODE sampler; bad inputs fail naming the argument and leave nothing
behind."""

import os

import pytest
import torch

from omniroll.cli import main

PROMPT = "a blue car"
SMALL = {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 4.5, "max_sequence_length": 8}


def write_run(out_dir, model, mode, seed=3):
    """A run directory whose latest checkpoint holds `mode` weights moved away from the base model (non-zero LoRA B,
    or perturbed full weights), written by the trainer's `write_checkpoint`."""
    from omniroll.config import load_config
    from omniroll.train.checkpoint import write_checkpoint
    from omniroll.train.policy import Policy
    from omniroll.train.version_store import VersionStore

    cfg = load_config({"engine": {"model": model}, "pipeline": SMALL, "n": 2,
                       "reward": {"num_workers": 1, "functions": {"colour": {"fn": "prompt_colour"}}},
                       "trainer": {"prompts": [PROMPT], "prompts_per_step": 1, "mode": mode,
                                   "lora": {"rank": 4, "alpha": 8}}})
    policy = Policy(model, mode, rank=4, alpha=8, seed=seed)  # alpha / rank = 2: the export must keep the scale
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.05 if mode == "lora" else 0.01))
    write_checkpoint(str(out_dir), 1, policy=policy, store=VersionStore(policy, 0),
                     state={"step": 1, "version": 1, "optimizer": {}, "mode": mode,
                            "config": cfg.model_dump(mode="json")})
    return str(out_dir)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_sd3_path):
    return write_run(tmp_path_factory.mktemp("lora-run"), tiny_sd3_path, "lora")


def leftovers(parent):
    return [n for n in os.listdir(parent) if n.startswith(".tmp-")]


def export(capsys, *argv):
    rc = main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_lora_export_loads_with_load_lora_weights_and_matches_the_engine_bitwise(lora_run, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from omniroll.export.write import export_source
    from omniroll.export.check import check_export

    to = tmp_path / "lora"
    rc, out, err = export(capsys, lora_run, "--to", to, "--check")  # a run directory: its latest checkpoint
    assert rc == 0, err
    assert "check ok (lora export vs the engine): max |latent diff| 0 " in out and "max |pixel diff| 0 " in out
    assert sorted(os.listdir(to)) == ["pytorch_lora_weights.safetensors"] and not leftovers(tmp_path)
    with safe_open(str(to / "pytorch_lora_weights.safetensors"), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("transformer.") and ".lora_" in k for k in keys)
    assert '"transformer.lora_alpha": 8' in metadata["lora_adapter_metadata"]  # the scale alpha / r survives
    # the tolerance tells a right LoRA from a wrong one: the same file with half its B (half the scale) fails
    tensors = load_file(str(to / "pytorch_lora_weights.safetensors"))
    (tmp_path / "halved").mkdir()
    save_file({k: v * 0.5 if "lora_B" in k else v for k, v in tensors.items()},
              str(tmp_path / "halved" / "pytorch_lora_weights.safetensors"), metadata=metadata)
    wrong = check_export(export_source(lora_run), str(tmp_path / "halved"), merged=False)
    assert not wrong.passed and wrong.latent_diff > 1e-2 and "FAILED" in wrong.line()


def test_merged_lora_export_loads_with_from_pretrained_and_matches_within_the_merge_rounding(lora_run, tmp_path,
                                                                                               capsys):
    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.sampling import make_generator

    to = tmp_path / "merged"
    rc, out, err = export(capsys, os.path.join(lora_run, "checkpoints", "step_000001"), "--to", to, "--merge",
                          "--check")
    assert rc == 0, err
    assert "check ok (merged export vs the engine)" in out, out
    assert not leftovers(tmp_path)
    pipe = DiffusionPipeline.from_pretrained(str(to))
    assert isinstance(pipe, StableDiffusion3Pipeline)
    # the merged weights are plain weights: omniroll's engine on them is bitwise diffusers on them (plain kernels)
    engine = DiffusionEngine.from_pretrained(str(to), batch_invariant=False)
    params = SamplingParams(**SMALL, noise_level=0.0, sde_type="ode", logprobs=False, output_type="latent")
    ours = engine.generate([GenerationRequest(request_id="m", prompt=PROMPT, seed=5, sampling_params=params)])[0]
    init = torch.randn(engine.adapter.latent_shape(32, 32), generator=make_generator(5))[None]
    engine.shutdown()
    with torch.no_grad():
        theirs = pipe(prompt=PROMPT, latents=init, output_type="latent", **SMALL).images[0]
    assert torch.equal(ours.diffusion_output, theirs)


def test_full_checkpoint_exports_merged_only(tmp_path, capsys, tiny_sd3_path):
    from safetensors.torch import load_file

    from omniroll.models.tiny import build_tiny_sd3

    run = write_run(tmp_path / "full-run", tiny_sd3_path, "full")
    rc, _, err = export(capsys, run, "--to", tmp_path / "nomerge")
    assert rc == 2 and "a full-weight checkpoint has no LoRA to export; use --merge" in err
    assert not os.path.exists(tmp_path / "nomerge") and not leftovers(tmp_path)
    other = build_tiny_sd3(str(tmp_path / "other-model"), seed=1, attention_head_dim=16)
    rc, _, err = export(capsys, run, "--to", tmp_path / "wrong", "--merge", "--model", other)
    assert rc == 2 and "CKPT " in err, err  # the model it was trained on, named (its trainer_state.pt says)
    assert f"(trained on {tiny_sd3_path!r}: --model {tiny_sd3_path}); pass --model" in err, err
    assert not os.path.exists(tmp_path / "wrong") and not leftovers(tmp_path)
    rc, out, err = export(capsys, run, "--to", tmp_path / "merged", "--merge", "--check")
    assert rc == 0, err
    assert "check ok (merged export vs the engine): max |latent diff| 0 " in out, out  # the same weights: bitwise
    trained = load_file(os.path.join(run, "checkpoints", "step_000001", "transformer",
                                     "diffusion_pytorch_model.safetensors"))
    exported = load_file(str(tmp_path / "merged" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert trained.keys() == exported.keys() and all(torch.equal(trained[k], exported[k]) for k in trained)


def test_bad_inputs_name_the_argument_and_leave_nothing(lora_run, tmp_path, capsys):
    from omniroll.models.tiny import build_tiny_sd3

    rc, _, err = export(capsys, tmp_path, "--to", tmp_path / "a")
    assert rc == 2 and f"CKPT {tmp_path}: neither a checkpoint (trainer_state.pt), a run directory" in err

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    rc, _, err = export(capsys, lora_run, "--to", tmp_path / "busy")
    assert rc == 2 and "--to" in err and "exists and is a directory that is not empty" in err
    assert os.listdir(tmp_path / "busy") == ["keep.txt"]

    other = build_tiny_sd3(str(tmp_path / "other-model"), seed=1, attention_head_dim=16)  # wider attention
    rc, _, err = export(capsys, lora_run, "--to", tmp_path / "b", "--model", other)
    assert rc == 2 and "its LoRA does not fit the base model" in err and "in_features 64" in err, err
    rc, _, err = export(capsys, lora_run, "--to", tmp_path / "c", "--model", other, "--merge")
    assert rc == 2 and "its LoRA does not fit the base model" in err, err
    assert not os.path.exists(tmp_path / "b") and not os.path.exists(tmp_path / "c") and not leftovers(tmp_path)

    rc, _, err = export(capsys, lora_run, "--to", tmp_path / "d", "--model", tmp_path / "nowhere")
    assert rc == 2 and "--model: model" in err and "nowhere" in err


@pytest.mark.parametrize("family", ["flux", "qwen-image", "wan"])
def test_other_families_export_a_lora_and_a_merge_their_pipeline_loads(family, tmp_path, capsys):
    from diffusers import DiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    from omniroll.models import build_tiny
    from omniroll.models.base import load_pipeline
    from omniroll.export.write import export_source, read_lora

    model = build_tiny(family, str(tmp_path / family), seed=0)
    run = write_run(tmp_path / "run", model, "lora")
    rc, _, err = export(capsys, run, "--to", tmp_path / "lora")
    assert rc == 0, err
    source = export_source(run)
    pipe = load_pipeline(source.pipeline_class, model)
    pipe.load_lora_weights(str(tmp_path / "lora"), adapter_name="trained")
    assert pipe.transformer.peft_config["trained"].lora_alpha == 8 and pipe.transformer.peft_config["trained"].r == 4
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="trained")
    _, trained = read_lora(source.checkpoint)
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
    rc, _, err = export(capsys, run, "--to", tmp_path / "merged", "--merge", "--check")
    assert rc == 2 and "--check: " + source.pipeline_class + " is not checked yet" in err, err
    assert not os.path.exists(tmp_path / "merged") and not leftovers(tmp_path)  # refused before anything is written
    rc, _, err = export(capsys, run, "--to", tmp_path / "merged", "--merge")
    assert rc == 0, err
    merged = DiffusionPipeline.from_pretrained(str(tmp_path / "merged"))
    assert type(merged).__name__ == source.pipeline_class
    key = sorted(trained)[0].removesuffix(".lora_A.weight")  # one adapted layer: W + (alpha / r) B A
    base = dict(load_pipeline(source.pipeline_class, model).transformer.named_parameters())[f"{key}.weight"]
    expected = base + 2.0 * trained[f"{key}.lora_B.weight"] @ trained[f"{key}.lora_A.weight"]
    fused = dict(merged.transformer.named_parameters())[f"{key}.weight"]
    assert torch.allclose(fused, expected, atol=1e-6) and not torch.allclose(fused, base, atol=1e-4)


def test_two_denoiser_models_are_refused(lora_run, tmp_path, capsys):
    from omniroll.models import build_tiny

    wan22 = build_tiny("wan2.2", str(tmp_path / "wan2.2"), seed=0)
    rc, _, err = export(capsys, lora_run, "--to", tmp_path / "out", "--model", wan22)
    assert rc == 2 and "--model: WanPipeline with two denoisers (transformer_2) is not supported by export" in err
    assert not os.path.exists(tmp_path / "out")


def test_bfloat16_export_and_check_refuses_it(lora_run, tmp_path, capsys):
    from safetensors.torch import load_file

    rc, _, err = export(capsys, lora_run, "--to", tmp_path / "checked", "--dtype", "bfloat16", "--check")
    assert rc == 2 and "--check compares float32 exports" in err and "--dtype bfloat16" in err
    assert not os.path.exists(tmp_path / "checked") and not leftovers(tmp_path)
    rc, _, err = export(capsys, lora_run, "--to", tmp_path / "bf16", "--dtype", "bfloat16")
    assert rc == 0, err
    assert {t.dtype for t in load_file(str(tmp_path / "bf16" / "pytorch_lora_weights.safetensors")).values()} \
        == {torch.bfloat16}
