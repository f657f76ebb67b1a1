"""The engine's LoRA layers: eval mode (no dropout during rollout) and the trainer's compute dtype."""

import copy

import torch
from peft import LoraConfig, get_peft_model
from weights_helpers import TARGETS, forward, tiny_transformer

from omniroll.weights import LoRAManager, OmniTensorLoRARequest, lora_state_dict, peft_config_to_dict


def _trained_like(base, dropout=0.0, seed=3):
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                        target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return pm


def _request(pm, version=1):
    return OmniTensorLoRARequest(lora_name=f"v{version}", lora_int_id=version,
                                 peft_config=peft_config_to_dict(pm.peft_config["default"]),
                                 lora_tensors=lora_state_dict(pm))


def test_injected_lora_layers_are_in_eval_mode_so_dropout_is_off():
    base = tiny_transformer(0)
    pm = _trained_like(base, dropout=0.5)
    module = tiny_transformer(0)
    LoRAManager(module).add_lora(_request(pm))
    assert not any(m.training for m in module.modules())
    first = forward(module)
    assert torch.equal(forward(module), first)
    assert torch.equal(first, forward(pm.eval()))  # PEFT's own model in eval mode


def test_same_request_and_seed_give_same_pixels_with_a_dropout_lora(tiny_sd3_path):
    from omniroll import DiffusionEngine, GenerationRequest, SamplingParams

    engine = DiffusionEngine.from_pretrained(tiny_sd3_path, max_batch_size=4)
    try:
        pm = _trained_like(engine.adapter.denoiser, dropout=0.5)
        engine.add_lora(_request(pm), version=1)
        sp = SamplingParams(height=32, width=32, num_inference_steps=3, max_sequence_length=8, guidance_scale=2.0)
        req = GenerationRequest(request_id="r", prompt="a red car", seed=5, sampling_params=sp)
        a, b = engine.generate([req]), engine.generate([req])
        assert torch.equal(a[0].diffusion_output, b[0].diffusion_output)
        assert torch.equal(a[0].log_probs, b[0].log_probs)
    finally:
        engine.shutdown()


def test_adapter_computes_in_the_trainers_dtype_on_a_bf16_engine():
    base = tiny_transformer(0).to(torch.bfloat16)
    trainer = _trained_like(base).eval()  # PEFT keeps a bf16 base's adapter in fp32 (autocast_adapter_dtype)
    assert {p.dtype for n, p in trainer.named_parameters() if "lora_" in n} == {torch.float32}
    engine_side = copy.deepcopy(base)
    mgr = LoRAManager(engine_side)
    mgr.add_lora(_request(trainer))
    assert {p.dtype for n, p in engine_side.named_parameters() if "lora_" in n} == {torch.float32}
    x = {k: v.to(torch.bfloat16) if v.is_floating_point() and k != "timestep" else v
         for k, v in __import__("weights_helpers").inputs().items()}
    assert torch.equal(forward(engine_side, x), forward(trainer, x))
    # a bf16 update (a trainer computing its adapter in bf16) is rebuilt in bf16, not copied into the fp32 one
    bf16 = {k: v.to(torch.bfloat16) for k, v in lora_state_dict(trainer).items()}
    req = _request(trainer, 2)
    req.lora_tensors, req.load_inplace = bf16, True
    mgr.add_lora(req)
    assert {p.dtype for n, p in engine_side.named_parameters() if "lora_" in n} == {torch.bfloat16}
    # an explicit adapter_dtype wins
    pinned = copy.deepcopy(base)
    LoRAManager(pinned, adapter_dtype=torch.float32).add_lora(req)
    assert {p.dtype for n, p in pinned.named_parameters() if "lora_" in n} == {torch.float32}
