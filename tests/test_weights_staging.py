"""What a full update keeps between updates, and the transaction it never gives up.

* A staged update (bytes from another process: shm, the object store) reuses its staging tensors (`StagingPool`): a
  tensor that someone still holds is never written again.
* An in-process update (buckets that reference the sender's tensors) needs no staging copy: the sender's tensors are
  checked as they arrive and copied into the parameters' own storage at the commit.
* Either way a rejected update changes nothing, and the module trees that both sides keep (`ModuleTree`) are read
  again as soon as a module changes."""

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from tests.module_receiver import ModuleReceiver
from weights_helpers import bitwise_equal, perturb, snapshot, tiny_transformer

from omniroll.weights import WeightSender, WeightSyncError
from omniroll.weights.tree import ModuleTree


def test_staged_updates_reuse_their_staging_tensors_held_tensors_are_never_written_and_a_bad_update_changes_nothing():
    rx = ModuleReceiver(tiny_transformer(0))
    sender = WeightSender([rx], bucket_bytes=8 << 10, transport="shm")  # another process's bytes: staged
    name, param = next(iter(rx.module.named_parameters()))
    held = param.detach()  # someone keeps the weights of version 0 (a view of the parameter's storage)
    before = held.clone()
    versions = [perturb(tiny_transformer(0), seed=s) for s in (1, 2, 3)]
    for v, weights in enumerate(versions, start=1):
        ack = sender.send(weights, version=v)
        assert ack[0]["transport"] == "shm" and bitwise_equal(snapshot(rx.module), snapshot(weights))
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


@pytest.mark.parametrize("where", ["first", "last"])
def test_in_process_updates_land_in_the_parameters_own_storage_and_a_nan_in_any_bucket_changes_nothing(where):
    rx = ModuleReceiver(tiny_transformer(0))
    sender = WeightSender([rx], bucket_bytes=8 << 10)  # transport "auto": in-process, buckets by reference
    storage = {k: p.data_ptr() for k, p in rx.module.named_parameters()}
    src = perturb(tiny_transformer(0), seed=1)
    ack = sender.send(src, version=1)
    assert ack[0]["transport"] == "inproc" and ack[0]["num_buckets"] > 2
    assert bitwise_equal(snapshot(rx.module), snapshot(src))
    assert {k: p.data_ptr() for k, p in rx.module.named_parameters()} == storage  # copied in, not swapped
    assert len(rx.staging) == 0  # and no staging copy was made
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)  # the sender's tensors are not shared with the receiver
    assert not bitwise_equal(snapshot(rx.module), snapshot(src))
    names = list(src.state_dict())
    bad = {k: v.clone() for k, v in perturb(tiny_transformer(0), seed=2).state_dict().items()}
    bad[names[0] if where == "first" else names[-1]].view(-1)[0] = float("inf")
    landed = snapshot(rx.module)
    with pytest.raises(WeightSyncError, match="non-finite"):
        sender.send(bad, version=2)
    assert bitwise_equal(snapshot(rx.module), landed) and rx.version == 1  # not one bucket of it landed


def test_a_module_tree_is_current_until_any_module_changes_what_a_walk_reads():
    def changes(module):
        block = module.transformer_blocks[0]
        yield "parameter replaced", lambda: setattr(block.attn.to_q, "weight", torch.nn.Parameter(torch.zeros(32, 32)))
        yield "parameter removed", lambda: delattr(block.attn.to_q, "bias")
        yield "parameter added", lambda: block.attn.register_parameter("extra", torch.nn.Parameter(torch.ones(2)))
        yield "buffer added", lambda: block.register_buffer("count", torch.zeros(1))
        yield "buffer made non-persistent", lambda: module.transformer_blocks[1].register_buffer(
            "b", torch.zeros(1), persistent=False)
        yield "module replaced", lambda: setattr(block.attn, "to_k", torch.nn.Linear(32, 32))
        yield "child added", lambda: module.add_module("head", torch.nn.Linear(2, 2))
        yield "dict replaced", lambda: setattr(block.norm1, "_parameters", dict(block.norm1._parameters))
        yield "state-dict hook", lambda: block.attn._register_state_dict_hook(lambda *a: None)

    for what, change in changes(tiny_transformer(0)):
        module = tiny_transformer(0)
        tree = ModuleTree(module)
        with torch.no_grad():
            next(module.parameters()).data = torch.zeros(3)  # new values, shape, even storage: same tree
        assert tree.current(), what
        dict(changes(module))[what]()
        assert not tree.current(), what


def test_kept_trees_follow_a_module_that_changed_between_updates_on_either_side():
    """The sender and the receiver keep the walk of their module between updates: a parameter replaced on either
    side, a buffer that stops persisting, a state-dict hook or a LoRA adapter injected into the sender's module is what
    the next update reads or writes."""
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
    with torch.no_grad():  # a new shape through .data keeps the tree: the manifest (and its bucket layout) follow
        src.get_parameter(name).data = torch.zeros(3)
    with pytest.raises(WeightSyncError, match=f"shape mismatch: {name}"):
        sender.send(src, version=3)
    with torch.no_grad():
        src.get_parameter(name).data = torch.full_like(new_rx_param, 0.25)
    sender.send(src, version=3)
    assert torch.equal(rx.module.get_parameter(name), torch.full_like(new_rx_param, 0.25))

    # a module with state-dict behaviour of its own (a hook) is read through state_dict() itself
    def drop(module, state, prefix, meta):
        del state[name]

    handle = src._register_state_dict_hook(drop)
    assert [n for n, _ in named_tensors_for(src, None)[0]] == list(src.state_dict()) and name not in src.state_dict()
    with pytest.raises(WeightSyncError, match=f"missing parameter.*{name}"):
        sender.send(src, version=4)
    handle.remove()
    sender.send(src, version=4)  # the hook removed: read from the tree again
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q"]), src)  # LoRA layers replace modules
    ack = sender.send(src, version=5)
    assert ack[0]["mode"] == "lora" and ack[0]["num_tensors"] == 2 * len(src.transformer_blocks)
