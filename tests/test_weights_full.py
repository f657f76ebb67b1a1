import pytest
import torch
from tests.module_receiver import ModuleReceiver
from weights_helpers import bitwise_equal, forward, perturb, snapshot, tiny_transformer

from omniroll.weights import (FullWeightLoader, WeightManifest, WeightSender, WeightSyncError, pack_buckets,
                              peft_base_name)


def _apply(module, named, bucket_bytes=4096, **kw):
    loader = FullWeightLoader(module, **kw)
    loader.begin(WeightManifest.from_named_tensors(named))
    for b in pack_buckets(named, bucket_bytes):
        loader.load_bucket(b)
    return loader.finish()


def test_full_sync_bitwise_and_forward_equal():
    trained = perturb(tiny_transformer(0))
    reference = tiny_transformer(0)
    reference.load_state_dict(trained.state_dict())
    fresh = tiny_transformer(0)
    rx = ModuleReceiver(fresh)
    acks = WeightSender([rx], bucket_bytes=16 << 10).send(trained, version=3)
    assert acks[0]["version"] == 3 and acks[0]["mode"] == "full" and acks[0]["num_buckets"] > 1
    assert acks[0]["max_bucket_bytes"] <= max(16 << 10, max(t.numel() * 4 for t in trained.state_dict().values()))
    assert bitwise_equal(snapshot(fresh), snapshot(trained))
    assert torch.equal(forward(fresh), forward(reference))


def test_bf16_sent_into_fp32_module_and_name_map():
    trained = perturb(tiny_transformer(0))
    named = [(f"base_model.model.{n}", p.detach().to(torch.bfloat16)) for n, p in trained.named_parameters()]
    fresh = tiny_transformer(0)
    stats = _apply(fresh, named, name_map=peft_base_name)
    assert stats["num_tensors"] == len(named)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, trained.get_parameter(n).to(torch.bfloat16).float()), n


def _expect_rejected(named, match, **kw):
    module = tiny_transformer(0)
    before = snapshot(module)
    with pytest.raises(WeightSyncError, match=match) as ei:
        _apply(module, named, **kw)
    assert bitwise_equal(snapshot(module), before)
    return str(ei.value)


def test_unknown_missing_shape_dtype_rejected_before_touching():
    src = perturb(tiny_transformer(0))
    named = [(n, p.detach()) for n, p in src.named_parameters()]
    msg = _expect_rejected(named + [("blocks.99.nope.weight", torch.zeros(2))], "unknown")
    assert "blocks.99.nope.weight" in msg
    msg = _expect_rejected(named[2:], "missing")
    assert named[0][0] in msg and named[1][0] in msg
    bad = [(n, torch.zeros(3, 3) if i == 5 else t) for i, (n, t) in enumerate(named)]
    msg = _expect_rejected(bad, "shape")
    assert named[5][0] in msg
    bad = [(n, t.to(torch.int32) if i == 4 else t) for i, (n, t) in enumerate(named)]
    assert named[4][0] in _expect_rejected(bad, "dtype")
    assert named[0][0] in _expect_rejected(named + named[:1], "duplicate")


def test_partial_update_and_protocol_errors():
    src = perturb(tiny_transformer(0))
    named = [(n, p.detach()) for n, p in src.named_parameters()][:3]
    module = tiny_transformer(0)
    _apply(module, named, allow_partial=True)
    for n, t in named:
        assert torch.equal(module.get_parameter(n), t)
    loader = FullWeightLoader(module, allow_partial=True)
    loader.begin(WeightManifest.from_named_tensors(named))
    with pytest.raises(WeightSyncError, match=named[2][0]):
        loader.finish()
    loader.begin(WeightManifest.from_named_tensors(named[:1]))
    b = next(pack_buckets(named, 1 << 20))
    with pytest.raises(WeightSyncError, match=named[1][0]):
        loader.load_bucket(b)


def test_full_update_under_active_lora_updates_base_and_keeps_adapter():
    from weights_helpers import peft_copy

    from omniroll.weights import LoRAManager, OmniTensorLoRARequest, lora_state_dict, peft_config_to_dict

    trained = perturb(tiny_transformer(0))
    module = tiny_transformer(0)
    rx = ModuleReceiver(module)
    pm = peft_copy(tiny_transformer(0))
    rx.lora_manager.add_lora(OmniTensorLoRARequest("a", 1, peft_config=peft_config_to_dict(pm.peft_config["default"]),
                                                   lora_tensors=lora_state_dict(pm)))
    WeightSender([rx], bucket_bytes=16 << 10).send(trained, version=2)
    assert rx.lora_manager.active_lora == "a"
    rx.lora_manager.remove_lora()
    assert bitwise_equal(snapshot(module), snapshot(trained))
    assert isinstance(LoRAManager(module), LoRAManager)
