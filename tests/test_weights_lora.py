import pytest
import torch
from tests.module_receiver import ModuleReceiver
from weights_helpers import bitwise_equal, forward, peft_copy, snapshot, tiny_transformer

from omniroll.weights import (LoRABindError, LoRAManager, OmniTensorLoRARequest, WeightSender, lora_state_dict,
                              normalize_lora_keys, peft_config_to_dict)


def _req(pm, name="a", int_id=1, tensors=None):
    return OmniTensorLoRARequest(lora_name=name, lora_int_id=int_id,
                                 peft_config=peft_config_to_dict(pm.peft_config["default"]),
                                 lora_tensors=lora_state_dict(pm) if tensors is None else tensors)


def _plain_modules(module):
    return [type(m).__name__ for m in module.modules()]


@pytest.fixture(scope="module")
def setup():
    base = tiny_transformer(0)
    return base, peft_copy(base, seed=3), peft_copy(base, seed=4)


def test_lora_state_dict_keys_and_normalisation(setup):
    _, pm, _ = setup
    sd = lora_state_dict(pm)
    assert len(sd) == 2 * 4 * 2 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in sd)
    assert not any(k.startswith("base_model") for k in sd)
    variants = {f"base_model.model.{k}".replace(".weight", ".default.weight"): v for k, v in sd.items()}
    assert normalize_lora_keys(variants, tiny_transformer(0)).keys() == sd.keys()
    assert normalize_lora_keys({f"transformer.{k}": v for k, v in sd.items()}, tiny_transformer(0)).keys() == sd.keys()


def test_add_lora_matches_peft_forward_and_remove_restores_base(setup):
    base, pm, _ = setup
    module = tiny_transformer(0)
    before, base_out, kinds = snapshot(module), forward(module), _plain_modules(module)
    grads = [p.requires_grad for p in module.parameters()]
    mgr = LoRAManager(module)
    assert mgr.active_lora is None and mgr.lora_int_id is None
    mgr.add_lora(_req(pm, "a", 7))
    assert mgr.active_lora == "a" and mgr.lora_int_id == 7
    assert torch.equal(forward(module), forward(pm))
    assert not torch.equal(forward(module), base_out)
    assert mgr.remove_lora() and mgr.active_lora is None
    assert torch.equal(forward(module), base_out)
    assert bitwise_equal(snapshot(module), before) and _plain_modules(module) == kinds
    assert not hasattr(module, "peft_config")
    assert [p.requires_grad for p in module.parameters()] == grads


def test_replace_same_and_new_name(setup):
    _, pm, pm2 = setup
    module = tiny_transformer(0)
    mgr = LoRAManager(module)
    mgr.add_lora(_req(pm, "a", 1))
    mgr.add_lora(_req(pm2, "b", 2))
    assert mgr.active_lora == "b" and torch.equal(forward(module), forward(pm2))
    mgr.add_lora(_req(pm, "b", 2))  # same name, new tensors
    assert torch.equal(forward(module), forward(pm))
    adapters = {k for m in module.modules() for k in getattr(m, "lora_A", {})}
    assert len(adapters) == 1  # the old adapter is gone, not just inactive


def test_bind_nothing_keeps_previous_and_base(setup):
    base, pm, _ = setup
    module = tiny_transformer(0)
    mgr = LoRAManager(module)
    base_out = forward(module)
    junk = {"nowhere.block.lora_A.weight": torch.zeros(4, 32), "nowhere.block.lora_B.weight": torch.zeros(32, 4)}
    with pytest.raises(LoRABindError, match="nowhere.block.lora_A.weight") as ei:
        mgr.add_lora(_req(pm, "junk", 9, junk))
    assert "zero modules" in str(ei.value) and mgr.active_lora is None
    assert torch.equal(forward(module), base_out)
    mgr.add_lora(_req(pm, "a", 1))
    with pytest.raises(LoRABindError):
        mgr.add_lora(_req(pm, "junk", 9, junk))
    assert mgr.active_lora == "a" and torch.equal(forward(module), forward(pm))


def test_partial_binding_and_shape_mismatch_name_keys(setup):
    _, pm, pm2 = setup
    module = tiny_transformer(0)
    mgr = LoRAManager(module)
    mgr.add_lora(_req(pm, "a", 1))
    good_out = forward(module)
    # add_q_proj exists but is not targeted by the config; "ghost" does not exist at all
    extra = dict(lora_state_dict(pm2), **{"transformer_blocks.0.attn.add_q_proj.lora_A.weight": torch.zeros(4, 32),
                                          "transformer_blocks.0.ghost.lora_B.weight": torch.zeros(32, 4)})
    with pytest.raises(LoRABindError) as ei:
        mgr.add_lora(_req(pm2, "b", 2, extra))
    assert set(ei.value.unmatched) == {"transformer_blocks.0.attn.add_q_proj.lora_A.weight",
                                       "transformer_blocks.0.ghost.lora_B.weight"}
    assert "add_q_proj" in str(ei.value)
    # every targeted module must receive its tensors
    partial = {k: v for k, v in lora_state_dict(pm2).items() if "to_v" not in k}
    with pytest.raises(LoRABindError, match="to_v"):
        mgr.add_lora(_req(pm2, "b", 2, partial))
    wrong = dict(lora_state_dict(pm2))
    wrong["transformer_blocks.1.attn.to_k.lora_A.weight"] = torch.zeros(5, 32)
    with pytest.raises(LoRABindError, match="to_k"):
        mgr.add_lora(_req(pm2, "b", 2, wrong))
    assert mgr.active_lora == "a" and torch.equal(forward(module), good_out)
    assert len({k for m in module.modules() for k in getattr(m, "lora_A", {})}) == 1


def test_lora_from_saved_adapter_dir(setup, tmp_path):
    _, pm, _ = setup
    pm.save_pretrained(str(tmp_path))
    module = tiny_transformer(0)
    mgr = LoRAManager(module)
    mgr.add_lora(OmniTensorLoRARequest("disk", 5, lora_path=str(tmp_path)))
    assert torch.equal(forward(module), forward(pm))


def test_sender_sends_only_lora_tensors(setup):
    base, pm, _ = setup
    module = tiny_transformer(0)
    before = snapshot(module)
    rx = ModuleReceiver(module)
    (ack,) = WeightSender([rx], bucket_bytes=1 << 10).send(pm, version=2)
    assert ack["mode"] == "lora" and ack["num_tensors"] == 16 and ack["num_buckets"] > 1
    assert torch.equal(forward(module), forward(pm))
    rx.lora_manager.remove_lora()
    assert bitwise_equal(snapshot(module), before)


def test_load_inplace_same_structure_and_fallback(setup):
    _, pm, pm2 = setup
    module = tiny_transformer(0)
    mgr = LoRAManager(module)
    mgr.add_lora(_req(pm, "a", 1))
    params = {id(p) for n, p in module.named_parameters() if "lora_" in n}
    req = _req(pm2, "b", 2)
    req.load_inplace = True
    mgr.add_lora(req)
    assert mgr.active_lora == "b" and torch.equal(forward(module), forward(pm2))
    assert {id(p) for n, p in module.named_parameters() if "lora_" in n} == params  # updated in place
    # a different structure (rank 8) falls back to a clean rebuild even with load_inplace
    pm8 = peft_copy(tiny_transformer(0), r=8, seed=5)
    req = _req(pm8, "c", 3)
    req.load_inplace = True
    mgr.add_lora(req)
    assert torch.equal(forward(module), forward(pm8))
    # in-place with a bad key set is rejected before any copy
    bad = _req(pm8, "d", 4, {k: v for k, v in lora_state_dict(pm8).items() if "to_q" not in k})
    bad.load_inplace = True
    with pytest.raises(LoRABindError, match="to_q"):
        mgr.add_lora(bad)
    assert mgr.active_lora == "c" and torch.equal(forward(module), forward(pm8))
