"""Staged full updates reuse their staging tensors (`StagingPool`) without giving up the transaction: a tensor that
someone still holds is never written again, and a rejected update after reuse leaves the module as it was."""

import pytest
import torch

from omniroll.weights import ModuleReceiver, WeightSender, WeightSyncError
from weights_helpers import bitwise_equal, perturb, snapshot, tiny_transformer


def test_staging_tensors_are_reused_held_tensors_are_never_written_and_a_bad_update_changes_nothing():
    rx = ModuleReceiver(tiny_transformer(0))
    sender = WeightSender([rx], bucket_bytes=8 << 10)  # transport "auto": in-process
    name, param = next(iter(rx.module.named_parameters()))
    held = param.detach()  # someone keeps the weights of version 0 (a view of the parameter's storage)
    before = held.clone()
    versions = [perturb(tiny_transformer(0), seed=s) for s in (1, 2, 3)]
    for v, weights in enumerate(versions, start=1):
        ack = sender.send(weights, version=v)
        assert ack[0]["transport"] == "inproc" and bitwise_equal(snapshot(rx.module), snapshot(weights))
    n = len(list(rx.module.state_dict()))
    assert rx.staging.reused >= n - 1  # the third update staged into the first one's storage (not the held one)
    assert torch.equal(held, before)  # the storage still held from version 0 was never handed out again
    bad = {k: v.clone() for k, v in versions[0].state_dict().items()}
    bad[name].view(-1)[-1] = float("nan")  # one NaN rejects the whole update
    with pytest.raises(WeightSyncError, match=f"non-finite.*{name}"):
        sender.send(bad, version=4)
    assert bitwise_equal(snapshot(rx.module), snapshot(versions[-1])) and rx.version == 3
    sender.send(versions[0], version=5)  # a good update after the rejected one lands whole
    assert bitwise_equal(snapshot(rx.module), snapshot(versions[0]))


def test_nothing_is_cached_between_updates_a_replaced_parameter_gets_the_new_values_on_both_sides():
    """The sender reads its module and the receiver its targets afresh at every update (one walk each): a parameter
    object replaced on either side between two updates is what the next update reads / writes."""
    from omniroll.weights.sender import named_tensors_for

    rx = ModuleReceiver(tiny_transformer(0))
    src = perturb(tiny_transformer(0), seed=1)
    sender = WeightSender([rx], bucket_bytes=8 << 10)
    sender.send(src, version=1)
    name, _ = next(iter(rx.module.named_parameters()))
    owner_name, attr = name.rsplit(".", 1)
    new_rx_param = torch.nn.Parameter(torch.zeros_like(rx.module.get_parameter(name)))
    setattr(rx.module.get_submodule(owner_name), attr, new_rx_param)  # the receiver's parameter replaced
    setattr(src.get_submodule(owner_name), attr, torch.nn.Parameter(torch.full_like(new_rx_param, 0.5)))
    src.register_buffer("extra", torch.ones(3), persistent=False)  # not in state_dict(): never sent
    assert [n for n, _ in named_tensors_for(src, None)[0]] == list(src.state_dict())
    sender.send(src, version=2)
    assert torch.equal(rx.module.get_parameter(name), torch.full_like(new_rx_param, 0.5))
    assert bitwise_equal(snapshot(rx.module), snapshot(src))
    # a module with state-dict behaviour of its own (a hook) is read through state_dict() itself
    def drop(module, state, prefix, meta):
        del state[name]

    src._register_state_dict_hook(drop)
    assert [n for n, _ in named_tensors_for(src, None)[0]] == list(src.state_dict()) and name not in src.state_dict()
