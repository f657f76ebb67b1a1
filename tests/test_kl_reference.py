"""`trainer.kl_reference` (omniroll/train/kl_reference.py): the KL term's reference as the base model, an EMA of the
trained weights, or the trained weights reset every N steps; its arithmetic, the swap that leaves a graph built
before it untouched, the config's refusals, and a training run whose reference is the EMA computed by hand and whose
resume continues bitwise."""

import pytest
import torch

from omniroll.config import ConfigError
from omniroll.train.kl_reference import KLReference


def params(values):
    return [(f"p{i}", torch.nn.Parameter(torch.tensor(v))) for i, v in enumerate(values)]


def test_the_ema_and_the_reset_reference_move_as_defined_and_the_base_keeps_nothing():
    ps = params([[1.0, 2.0], [3.0]])
    ema, reset = KLReference("ema", ps, decay=0.75), KLReference("reset", ps, every=2)
    assert KLReference("base", ps).kept == {} and KLReference("base", ps).is_base
    with torch.no_grad():
        ps[0][1].add_(4.0)
    ema.after_update(ps, 1)
    reset.after_update(ps, 1)
    assert torch.equal(ema.kept["p0"], 0.75 * torch.tensor([1.0, 2.0]) + 0.25 * torch.tensor([5.0, 6.0]))
    assert torch.equal(reset.kept["p0"], torch.tensor([1.0, 2.0]))  # step 1 is no multiple of 2
    reset.after_update(ps, 2)
    assert torch.equal(reset.kept["p0"], torch.tensor([5.0, 6.0])) and reset.kept["p0"] is not ps[0][1].data
    with pytest.raises(ValueError, match=r"kl_reference must be one of \['base', 'ema', 'reset'\]"):
        KLReference("snapshot", ps)


def test_the_swap_stands_in_for_the_forward_and_leaves_an_earlier_graph_and_its_gradient_alone():
    w = torch.nn.Parameter(torch.tensor([2.0]))
    ref = KLReference("ema", [("w", w)], decay=0.5)
    with torch.no_grad():
        w.mul_(3.0)  # trained: 6, kept: 2
    x = torch.tensor([5.0])
    y = (w * x).sum() ** 2  # a graph on the trained value
    with torch.no_grad(), ref.swapped([("w", w)]):
        assert float((w * x).sum()) == 10.0  # the reference forward sees the kept value
    y.backward()
    assert float(w) == 6.0 and float(w.grad) == 2 * 30.0 * 5.0  # d(wx)^2/dw at w = 6, as without the swap
    state = ref.state_dict()
    other = KLReference("ema", [("w", torch.nn.Parameter(torch.tensor([0.0])))])
    other.load_state_dict(state)
    assert torch.equal(other.kept["w"], torch.tensor([2.0]))
    with pytest.raises(ValueError, match="the checkpoint's KL reference is 'ema'"):
        KLReference("reset", [("w", w)]).load_state_dict(state)


def test_the_config_refuses_a_reference_without_a_kl_term_or_with_ranks(tiny_sd3_path):
    from test_train import train_config

    with pytest.raises(ConfigError, match="kl_reference: 'ema' is what the KL term pulls towards, .* set kl_beta > 0"):
        train_config(tiny_sd3_path, kl_reference="ema")
    with pytest.raises(ConfigError, match="use it with world_size 1"):
        train_config(tiny_sd3_path, kl_reference="reset", kl_beta=0.1, world_size=2)
    with pytest.raises(ConfigError, match="kl_reference_decay"):
        train_config(tiny_sd3_path, kl_reference="ema", kl_beta=0.1, kl_reference_decay=1.0)


@pytest.mark.slow  # slow: trains on Ray
def test_an_ema_reference_is_the_ema_of_the_trained_weights_and_a_resume_continues_bitwise(ray_cluster, tiny_sd3_path,
                                                                                           tmp_path):
    from test_train import lora_weights, train_config

    from omniroll.train import Trainer

    cfg = train_config(tiny_sd3_path, steps=3, kl_beta=0.5, kl_reference="ema", kl_reference_decay=0.5,
                       checkpoint_every=1)
    seen = []
    with Trainer(cfg, str(tmp_path / "straight"), log=lambda s: None) as tr:
        start = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
        hist = tr.train(on_step=lambda m: seen.append({n: p.detach().clone()
                                                       for n, p in tr.policy.named_parameters()}))
        kept = {n: t.clone() for n, t in tr.policy.kl_reference.kept.items()}
        with tr.policy.reference():  # what every algorithm's KL term runs the model with: the kept weights
            assert all(torch.equal(p, kept[n]) for n, p in tr.policy.named_parameters())
        assert not all(torch.equal(p, kept[n]) for n, p in tr.policy.named_parameters())  # and the trained ones after
    expect = start
    for weights in seen:
        expect = {n: 0.5 * expect[n] + 0.5 * weights[n] for n in expect}
    assert all(torch.allclose(kept[n], expect[n], rtol=0, atol=1e-7) for n in expect)
    assert hist[0]["kl"] == 0.0 and all(m["kl"] > 0 for m in hist[1:])  # step 1 trains at its reference
    assert [m["ratio_max_abs_dev"] for m in hist] == [0.0] * 3
    with Trainer(cfg, str(tmp_path / "resumed"), resume=str(tmp_path / "straight" / "checkpoints" / "step_000002"),
                 log=lambda s: None) as tr:
        tr.train()
        assert all(torch.equal(tr.policy.kl_reference.kept[n], kept[n]) for n in kept)
    a = lora_weights(str(tmp_path / "straight" / "checkpoints" / "step_000003"))
    b = lora_weights(str(tmp_path / "resumed" / "checkpoints" / "step_000003"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
