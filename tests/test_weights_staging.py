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
