"""Tiny SD3 checkpoint builder and SD3Adapter, against real diffusers / transformers components."""

from __future__ import annotations

import json
import os

import pytest
import torch

from omniroll.models import SD3Adapter, build_tiny_sd3, load_adapter, stack_conditioning
from omniroll.models.base import Conditioning
from omniroll.models.tiny import MARKER_FILE, resolve_config

MSL = 16


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            full = os.path.join(d, n)
            out[os.path.relpath(full, root)] = open(full, "rb").read()
    return out


@pytest.fixture(scope="module")
def adapter(tiny_sd3_path):
    return SD3Adapter.from_pretrained(tiny_sd3_path)


# ---------------------------------------------------------------------------------------------- builder
def test_build_is_deterministic_and_seed_dependent(tmp_path, tiny_sd3_path):
    a = _files(build_tiny_sd3(str(tmp_path / "a"), seed=0))
    b = _files(tiny_sd3_path)
    assert a.keys() == b.keys()
    assert any(k.endswith(".safetensors") for k in a)
    for k in a:
        assert a[k] == b[k], f"{k} differs between two builds with seed 0"
    c = _files(build_tiny_sd3(str(tmp_path / "c"), seed=1))
    weights = [k for k in a if k.endswith(".safetensors")]
    assert all(a[k] != c[k] for k in weights)
    assert all(a[k] == c[k] for k in a if "tokenizer" in k)  # tokenizers do not depend on the seed


def test_build_reuses_complete_checkpoint_and_rebuilds_on_mismatch(tmp_path):
    path = build_tiny_sd3(str(tmp_path / "x"), seed=3)
    weight = os.path.join(path, "transformer", "diffusion_pytorch_model.safetensors")
    mtime = os.stat(weight).st_mtime_ns
    assert build_tiny_sd3(path, seed=3) == path
    assert os.stat(weight).st_mtime_ns == mtime  # not rebuilt
    before = open(weight, "rb").read()
    build_tiny_sd3(path, seed=4)
    assert open(weight, "rb").read() != before
    assert json.load(open(os.path.join(path, MARKER_FILE)))["seed"] == 4


def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        build_tiny_sd3(str(tmp_path / "p"), preset="huge")
    with pytest.raises(ValueError, match="seed"):
        build_tiny_sd3(str(tmp_path / "p"), seed=-1)
    with pytest.raises(ValueError, match="num_layerz"):
        build_tiny_sd3(str(tmp_path / "p"), num_layerz=3)
    with pytest.raises(ValueError, match="joint_attention_dim"):
        build_tiny_sd3(str(tmp_path / "p"), joint_attention_dim=64)


def test_configs_follow_the_dimension_rules():
    for preset in ("tiny", "bench"):
        cfg = resolve_config(preset)
        tr = cfg["transformer"]
        assert tr["caption_projection_dim"] == tr["num_attention_heads"] * tr["attention_head_dim"]
        assert tr["pooled_projection_dim"] == 2 * cfg["clip"]["projection_dim"]
        assert tr["joint_attention_dim"] == cfg["t5"]["d_model"]
    bench = resolve_config("bench", num_layers=6, t5={"d_model": 128})
    assert bench["transformer"]["num_layers"] == 6
    assert bench["transformer"]["joint_attention_dim"] == 128
    assert bench["transformer"]["caption_projection_dim"] >= 256


def test_tiny_checkpoint_runs_in_the_diffusers_pipeline(tiny_sd3_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    pipe.set_progress_bar_config(disable=True)
    params = sum(p.numel() for p in pipe.transformer.parameters())
    assert params < 1_000_000
    image = pipe(
        "a photo of a cat", height=64, width=64, num_inference_steps=2, guidance_scale=4.5,
        max_sequence_length=MSL, output_type="pt", generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 3, 64, 64)
    assert torch.isfinite(image).all()


def test_tokenizers_know_the_word_list(tiny_sd3_path):
    from transformers import AutoTokenizer

    clip = AutoTokenizer.from_pretrained(tiny_sd3_path, subfolder="tokenizer")
    ids = clip("a photo of a red cat").input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id and len(ids) == 8  # one token per word
    t5 = AutoTokenizer.from_pretrained(tiny_sd3_path, subfolder="tokenizer_3")
    ids = t5("a blue car near a house").input_ids
    assert ids[-1] == t5.eos_token_id == 1 and t5.pad_token_id == 0 and len(ids) == 7
    assert t5.unk_token_id not in t5("Zebra, 42!").input_ids  # unknown words fall back to characters


# ---------------------------------------------------------------------------------------------- adapter
def test_encode_shapes_and_prompt_ids(adapter):
    conds = adapter.encode_prompts(["a photo of a cat", "", "a red car"], MSL)
    assert len(conds) == 3 and all(isinstance(c, Conditioning) for c in conds)
    joint = adapter.transformer.config.joint_attention_dim
    pooled = adapter.transformer.config.pooled_projection_dim
    for c in conds:
        assert c.tensors["prompt_embeds"].shape == (77 + MSL, joint)
        assert c.tensors["pooled_prompt_embeds"].shape == (pooled,)
        assert all(t.dtype == torch.float32 for t in c.tensors.values())
        assert len(c.prompt_ids) == 77
    assert conds[0].shape_key == conds[1].shape_key
    expected = adapter.tokenizer("a photo of a cat", padding="max_length", max_length=77).input_ids
    assert conds[0].prompt_ids == expected
    # matches diffusers' own encode_prompt output for the same prompt
    with torch.no_grad():
        ref, _, ref_pooled, _ = adapter.pipeline.encode_prompt(
            "a red car", None, None, do_classifier_free_guidance=False, max_sequence_length=MSL
        )
    assert torch.equal(conds[2].tensors["prompt_embeds"], ref[0])
    assert torch.equal(conds[2].tensors["pooled_prompt_embeds"], ref_pooled[0])


def test_encode_is_row_independent(adapter):
    alone = adapter.encode_prompts(["a blue house"], MSL)[0]
    others = adapter.encode_prompts(["a dog", "a blue house", "a tree near a river", "a blue house"], MSL)
    for c in (others[1], others[3]):
        for k in alone.tensors:
            assert torch.equal(alone.tensors[k], c.tensors[k])
        assert c.prompt_ids == alone.prompt_ids
    others[1].tensors["prompt_embeds"].add_(1.0)  # rows are independent copies
    assert torch.equal(others[3].tensors["prompt_embeds"], alone.tensors["prompt_embeds"])


def test_encode_rejects_bad_sequence_length(adapter):
    assert adapter.max_sequence_length_limit == 512
    for bad in (0, 513, 3.5):
        with pytest.raises(ValueError, match="max_sequence_length"):
            adapter.encode_prompts(["a cat"], bad)
    with pytest.raises(TypeError, match="prompts"):
        adapter.encode_prompts("a cat", MSL)


def test_velocity_and_decode(adapter):
    conds = adapter.encode_prompts(["a cat", "a dog"], MSL)
    latents = torch.randn(2, *adapter.latent_shape(64, 96), generator=torch.Generator().manual_seed(0))
    assert latents.shape == (2, 16, 8, 12)
    v = adapter.velocity(latents, torch.tensor([1000.0, 250.0]), stack_conditioning(conds))
    assert v.shape == latents.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    # same call as the pipeline makes
    ref = adapter.transformer(
        hidden_states=latents, timestep=torch.tensor([1000.0, 250.0]),
        encoder_hidden_states=stack_conditioning(conds)["prompt_embeds"],
        pooled_projections=stack_conditioning(conds)["pooled_prompt_embeds"], return_dict=False,
    )[0]
    assert torch.allclose(v, ref)
    with pytest.raises(ValueError, match="timesteps"):
        adapter.velocity(latents, torch.tensor([1000.0]), stack_conditioning(conds))
    pixels = adapter.decode(latents)
    assert pixels.shape == (2, 3, 64, 96) and pixels.dtype == torch.float32


def test_velocity_in_bfloat16(tiny_sd3_path):
    bf = SD3Adapter.from_pretrained(tiny_sd3_path, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    cond = stack_conditioning(bf.encode_prompts(["a cat"], MSL))
    assert cond["prompt_embeds"].dtype == torch.float32
    v = bf.velocity(torch.randn(1, *bf.latent_shape(64, 64)), torch.tensor([500.0]), cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_sigmas_match_the_pipeline_scheduler(adapter, tiny_sd3_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    ref = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_sd3_path, subfolder="scheduler")
    assert ref.config.shift == 3.0
    for steps in (1, 2, 10):
        ref.set_timesteps(steps)
        sig = adapter.sigmas(steps, 64, 64)
        assert sig.dtype == torch.float32 and sig.shape == (steps + 1,)
        assert sig[0] == 1.0 and sig[-1] == 0.0
        assert torch.equal(sig, ref.sigmas.float())
    sig = adapter.sigmas(10, 64, 64)
    sig.zero_()  # callers get a copy of the cached schedule
    assert adapter.sigmas(10, 64, 64)[0] == 1.0


def test_sigmas_use_dynamic_shift_like_the_pipeline(adapter):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    dyn = SD3Adapter(adapter.pipeline)
    dyn.scheduler_config = {**adapter.scheduler_config, "use_dynamic_shifting": True}
    ref = FlowMatchEulerDiscreteScheduler.from_config(dyn.scheduler_config)
    c = ref.config
    mu = calculate_shift(8 * 8, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    ref.set_timesteps(4, mu=mu)
    assert torch.equal(dyn.sigmas(4, 128, 128), ref.sigmas.float())
    assert not torch.equal(dyn.sigmas(4, 128, 128), adapter.sigmas(4, 128, 128))


def test_resolution_validation_names_the_field(adapter):
    assert adapter.spatial_multiple == 16
    assert adapter.max_resolution == 64 * 16
    assert adapter.latent_shape(128, 64) == (16, 16, 8)
    with pytest.raises(ValueError, match=r"height must be a positive multiple of 16"):
        adapter.latent_shape(72, 64)
    with pytest.raises(ValueError, match=r"width must be a positive multiple of 16"):
        adapter.sigmas(4, 64, 40)
    with pytest.raises(ValueError, match=r"width must be <= 1024"):
        adapter.latent_shape(64, 2048)


def test_modules_and_load_adapter(adapter, tiny_sd3_path, tmp_path):
    mods = adapter.modules()
    assert set(mods) == {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"}
    assert adapter.denoiser is adapter.transformer
    loaded = load_adapter(tiny_sd3_path)
    assert isinstance(loaded, SD3Adapter)
    other = tmp_path / "ltx"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "LTXPipeline"}))
    with pytest.raises(ValueError, match="LTXPipeline.*StableDiffusion3Pipeline"):
        load_adapter(str(other))
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_adapter(str(tmp_path / "missing"))
