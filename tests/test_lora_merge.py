"""`engine.merge_lora`: a LoRA adapter merged into the engine's weights (omniroll/weights/lora_merge.py) draws what the
unmerged adapter draws, to rounding; the base weights come back bitwise after every change (another adapter, a full
update under it, sleep, removal); the trainer refuses it where it takes a ratio (tiny SD3, CPU)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from omniroll import GenerationRequest, SamplingParams
from omniroll.config import ConfigError, load_config
from omniroll.engine.engine import DiffusionEngine
from omniroll.weights import WeightSender

PARAMS = SamplingParams(height=64, width=64, num_inference_steps=4, max_sequence_length=16)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


def req(seed):
    return GenerationRequest(request_id=f"r{seed}", prompt="a photo of a dog", seed=seed, sampling_params=PARAMS)


def peft_lora(engine, seed):
    """A PEFT-wrapped copy of the engine's transformer with random (non-zero) LoRA weights."""
    from diffusers import SD3Transformer2DModel

    module = SD3Transformer2DModel.from_config(engine.adapter.denoiser.config)
    module.load_state_dict(base_weights(engine))
    torch.manual_seed(seed)
    wrapped = get_peft_model(module.eval(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                       init_lora_weights=False))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)  # large enough to change the pictures
    return wrapped


def base_weights(engine):
    """The denoiser's base weights by their plain names (a LoRA layer's base under its own name)."""
    return {k.replace(".base_layer.", "."): v.clone() for k, v in engine.adapter.denoiser.state_dict().items()
            if ".lora_" not in k}


def perturbed(weights, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def generate(engine, seeds=(1, 2)):
    return engine.generate([req(s) for s in seeds])


def pixel_diff(x, y) -> float:
    """The largest difference of two outputs' pixels, in levels of 255."""
    return float((x.diffusion_output.float() - y.diffusion_output.float()).abs().max())


def bitwise(a, b):
    for x, y in zip(a, b):
        assert x.stop_reason == y.stop_reason == "completed"
        assert torch.equal(x.diffusion_output, y.diffusion_output) and torch.equal(x.log_probs, y.log_probs)


def test_merged_lora_draws_the_unmerged_pictures_and_gives_the_base_back_bitwise(tiny_sd3_path):
    merged = DiffusionEngine.from_pretrained(tiny_sd3_path, merge_lora=True)
    plain = DiffusionEngine.from_pretrained(tiny_sd3_path)
    try:
        base = base_weights(merged)
        base_out = generate(merged)
        bitwise(base_out, generate(plain))  # no adapter: nothing to merge
        assert base_out[0].extra_fields["execution"]["merge_lora"] is True

        # 1. an adapter: merged into the weights (the layers run no adapter branch), the unmerged one's pictures to
        #    rounding; the base tensors are kept aside untouched
        lora_1 = peft_lora(merged, seed=1)
        WeightSender([merged, plain]).send(lora_1, version=1)
        layers = [m for m in merged.adapter.denoiser.modules() if hasattr(m, "merged_adapters")]
        assert layers and all(m.merged for m in layers)
        assert not torch.equal(base_weights(merged)["transformer_blocks.0.attn.to_q.weight"],
                               base["transformer_blocks.0.attn.to_q.weight"])
        a, b = generate(merged), generate(plain)
        assert all(x.weight_version == 1 for x in a)
        moved = max(pixel_diff(x, y) for x, y in zip(a, base_out))
        diff = max(pixel_diff(x, y) for x, y in zip(a, b))
        lat = max(float((x.extra_fields["all_latents"] - y.extra_fields["all_latents"]).abs().max()
                        / y.extra_fields["all_latents"].abs().max()) for x, y in zip(a, b))  # relative to their scale
        lp = max(float((x.log_probs - y.log_probs).abs().max()) for x, y in zip(a, b))
        print(f"moved {moved}, merged vs unmerged: pixels {diff}, latents {lat:.3g}, log-probs {lp:.3g}")
        assert moved > 20 and diff <= 1, (moved, diff)
        assert lat < 1e-3 and lp < 1e-5, (lat, lp)  # the random tiny model amplifies rounding: 7e-5 measured

        # 2. another adapter of the same structure (copied in place): merged on the exact base, so it draws bitwise
        #    what an engine that only ever had this adapter draws
        lora_2 = peft_lora(merged, seed=2)
        WeightSender([merged]).send(lora_2, version=2)
        fresh = DiffusionEngine.from_pretrained(tiny_sd3_path, merge_lora=True)
        WeightSender([fresh]).send(lora_2, version=2)
        bitwise(generate(merged), generate(fresh))

        # 3. a full update under the adapter: it lands in the base, the adapter is merged on top of it
        new_base = perturbed(base, 3)
        WeightSender([merged, fresh]).send(new_base, version=3)
        check = DiffusionEngine.from_pretrained(tiny_sd3_path, merge_lora=True)
        WeightSender([check]).send(new_base, version=3)
        WeightSender([check]).send(lora_2, version=4)
        out_3 = generate(merged)
        bitwise(out_3, generate(check))
        check.shutdown()

        # 4. sleep moves the base weights, not a merged copy; after wake_up the same pictures
        merged.sleep(level=1)
        merged.wake_up()
        bitwise(out_3, generate(merged))

        # 5. removal: the base weights of the full update, bitwise, and its pictures
        merged.remove_lora(version=5)
        assert not any(hasattr(m, "merged_adapters") for m in merged.adapter.denoiser.modules())
        now = base_weights(merged)
        assert now.keys() == new_base.keys() and all(torch.equal(now[k], new_base[k]) for k in now)
        fresh.remove_lora(version=5)
        bitwise(generate(merged), generate(fresh))
        fresh.shutdown()
    finally:
        merged.shutdown()
        plain.shutdown()


def test_an_algorithm_that_takes_a_ratio_refuses_merged_rollouts(tiny_sd3_path):
    def config(algorithm):
        return load_config({
            "engine": {"model": tiny_sd3_path, "merge_lora": True},
            "algo": {} if algorithm == "awm" else {"noise_level": 1.0, "sde_type": "sde"},
            "reward": {"functions": {"colour": {"fn": "prompt_colour"}}}, "n": 2,
            "trainer": {"algorithm": algorithm, "prompts": ["a blue car"], "prompts_per_step": 1, "steps": 1},
        })

    with pytest.raises(ConfigError, match=r"engine\.merge_lora: trainer\.algorithm flow_grpo takes the ratio"):
        config("flow_grpo")
    assert config("awm").engine.engine_kwargs()["merge_lora"] is True
