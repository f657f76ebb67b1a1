import os

import pytest
import torch
from tests.module_receiver import ModuleReceiver, apply_weight_update
from weights_helpers import bitwise_equal, forward, inputs, peft_copy, perturb, snapshot, tiny_transformer

from omniroll.weights import WeightSender, WeightSyncError, iter_shm_buckets
from omniroll.weights.transport import SHM_PREFIX, leftover_shm


def _mine():
    return leftover_shm(f"{SHM_PREFIX}{os.getpid()}-")


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_two_targets_full_then_lora(transport):
    trained = perturb(tiny_transformer(0))
    rxs = [ModuleReceiver(tiny_transformer(0)) for _ in range(2)]
    sender = WeightSender(rxs, bucket_bytes=8 << 10, transport=transport)
    acks = sender.send(trained, version=1)
    assert [a["version"] for a in acks] == [1, 1] and acks[0]["num_buckets"] > 2
    for rx in rxs:
        assert bitwise_equal(snapshot(rx.module), snapshot(trained))
    pm = peft_copy(trained)
    acks = sender.send(pm, version=2)
    assert all(a["mode"] == "lora" for a in acks)
    for rx in rxs:
        assert torch.equal(forward(rx.module), forward(pm))
    assert _mine() == []


class _FailingReceiver(ModuleReceiver):
    """Consumes ``after`` buckets, then raises (or returns early if ``raise_=False``)."""

    def __init__(self, module, after, raise_=True):
        super().__init__(module)
        self.after, self.raise_ = after, raise_

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False, *, manifest, buckets,
                                version):
        assert use_shm
        it = iter_shm_buckets(buckets)
        for i, _ in zip(range(self.after), it):
            pass
        it.close()
        if self.raise_:
            raise RuntimeError("receiver exploded")
        return {"version": version}


@pytest.mark.parametrize("after,raise_,match", [(0, True, "exploded"), (3, True, "exploded"),
                                                (2, False, "before consuming")])
def test_shm_no_leftovers_when_receiver_fails(after, raise_, match):
    trained = perturb(tiny_transformer(0))
    good = ModuleReceiver(tiny_transformer(0))
    bad = _FailingReceiver(tiny_transformer(0), after, raise_)
    with pytest.raises((RuntimeError, WeightSyncError), match=match):
        WeightSender([good, bad], bucket_bytes=4 << 10, transport="shm", timeout_s=30).send(trained, version=1)
    assert _mine() == []


def test_shm_rejected_manifest_leaves_module_and_shm_clean():
    trained = perturb(tiny_transformer(0))
    sd = dict(trained.state_dict(), **{"extra.weight": torch.zeros(3)})
    rx = ModuleReceiver(tiny_transformer(0))
    before = snapshot(rx.module)
    with pytest.raises(WeightSyncError, match="extra.weight"):
        WeightSender([rx], bucket_bytes=4 << 10, transport="shm", timeout_s=30).send(sd, version=1)
    assert bitwise_equal(snapshot(rx.module), before) and _mine() == []


def test_shm_bucket_count_single_slot():
    trained = perturb(tiny_transformer(0))
    rx = ModuleReceiver(tiny_transformer(0))
    (ack,) = WeightSender([rx], bucket_bytes=2 << 10, transport="shm", num_shm_slots=1).send(trained, version=4)
    assert ack["num_buckets"] > 10 and bitwise_equal(snapshot(rx.module), snapshot(trained)) and _mine() == []


def test_apply_rejects_wrong_descriptor():
    with pytest.raises(WeightSyncError, match="ShmStream"):
        apply_weight_update(tiny_transformer(0), None, manifest=[], buckets=[], peft_config=None, use_shm=True)


def test_ray_actor_receiver(ray_cluster):
    """One receiver actor (a separate process), fed by Ray object refs, then by shm."""
    ray = ray_cluster
    actor = ray.remote(ModuleReceiver).options(num_cpus=0).remote(tiny_transformer(0))
    for version, transport in [(5, "ray"), (60, "shm")]:
        trained = perturb(tiny_transformer(0), seed=version)
        sender = WeightSender([actor], bucket_bytes=16 << 10, transport=transport, timeout_s=60)
        (ack,) = sender.send(trained, version=version)
        assert ack["version"] == version and ack["num_buckets"] > 1
        # round 2 lands under round 1's LoRA adapter: compare the base weights by plain name
        remote = {k.replace(".base_layer.", "."): v for k, v in ray.get(actor.state_dict.remote()).items()
                  if ".lora_" not in k}
        assert bitwise_equal(remote, snapshot(trained))
        pm = peft_copy(trained, seed=version)
        (ack,) = sender.send(pm, version=version + 10)
        assert ack["mode"] == "lora"
        # another process (other torch thread count): not bitwise, but within float rounding
        torch.testing.assert_close(ray.get(actor.forward.remote(**inputs())), forward(pm), atol=1e-6, rtol=1e-6)
        assert _mine() == []
    ray.kill(actor)


def test_shm_reuse_keeps_two_slots_until_close_and_drops_them_on_error():
    trained = perturb(tiny_transformer(0))
    rx = ModuleReceiver(tiny_transformer(0))
    sender = WeightSender([rx], bucket_bytes=8 << 10, transport="shm", reuse_shm=True)
    sender.send(trained, version=1)
    kept = _mine()
    assert len(kept) == 3  # control + two slots
    sender.send(perturb(trained, seed=9), version=2)
    assert _mine() == kept and bitwise_equal(snapshot(rx.module), snapshot(trained))
    sender.close()
    assert _mine() == []
    with WeightSender([rx, _FailingReceiver(tiny_transformer(0), 1)], bucket_bytes=8 << 10, transport="shm",
                      reuse_shm=True, timeout_s=30) as s2:
        with pytest.raises(RuntimeError, match="exploded"):
            s2.send(trained, version=3)
        assert _mine() == []


def test_a_shm_descriptor_opens_only_files_its_sender_created(tmp_path):
    """The control file is mapped read-write: a descriptor naming a file outside /dev/shm, a link in /dev/shm with a
    sender's name, another sender's slot or a file too small for its layout is refused naming the field, and the
    file it named is left untouched. A sender's own descriptor passes."""
    import dataclasses

    from omniroll.weights.buckets import BucketEntry
    from omniroll.weights.transport import SHM_DIR, ShmChannel, check_descriptor

    plan = [[BucketEntry("w", "float32", (4,), 0, 16)]]
    victim = tmp_path / "victim"
    victim.write_bytes(b"\x07" * 4096)
    ch, other = ShmChannel(plan, num_receivers=1), ShmChannel(plan, num_receivers=1)
    link = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{'0' * 12}-ctrl")  # a sender's name, a link to the victim
    try:
        good = ch.descriptor(0)
        assert check_descriptor(good, use_shm=True) is good
        os.symlink(victim, link)
        cases = [(dataclasses.replace(good, ctrl=str(victim)), r"ShmStream.ctrl: .*victim' is not a file a weight "
                                                               r"sender creates"),
                 (dataclasses.replace(good, ctrl=link, slots=[link[:-4] + "slot0"]),
                  r"ShmStream.ctrl: .* is not a regular file of this user"),
                 (dataclasses.replace(good, slots=other.descriptor(0).slots), "come from different senders"),
                 (dataclasses.replace(good, receiver=5), r"ShmStream.ctrl: .* at least 112 bytes"),
                 (dataclasses.replace(good, slots=[good.slots[0].replace("slot0", "slot1")]),
                  r"ShmStream.slots\[0\]: .* is not a file a weight sender creates")]
        for bad, match in cases:
            with pytest.raises(WeightSyncError, match=match):
                check_descriptor(bad, use_shm=True)
            with pytest.raises(WeightSyncError, match=match):
                next(iter_shm_buckets(bad))
        assert victim.read_bytes() == b"\x07" * 4096
    finally:
        ch.close()
        other.close()
        if os.path.islink(link):
            os.unlink(link)
    assert _mine() == []
