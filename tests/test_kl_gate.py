"""`trainer.kl_gate` (omniroll/train/kl_gate.py): GARDO's gate on the KL term: ranks with ties, the rows the trained
reward rates furthest above the others, the KL of the rows outside the gate dropped, the config's refusals, and
training runs where the gate opens on disagreement and stays shut without it."""

import pytest
import torch

from omniroll.config import ConfigError
from omniroll.train.algorithms.terms import gated, with_kl
from omniroll.train.kl_gate import kl_gate_rows, mean_ranks


def test_ranks_share_ties_and_the_gate_takes_the_largest_positive_disagreements():
    assert mean_ranks(torch.tensor([0.5, 0.1, 0.5, 0.9])).tolist() == [2.5, 1.0, 2.5, 4.0]
    total = torch.tensor([0.9, 0.2, 0.5, 0.8])
    other = torch.tensor([0.1, 0.3, 0.5, 0.9])  # u = [4 - 1, 1 - 2, 2 - 3, 3 - 4] = [3, -1, -1, -1]
    assert kl_gate_rows(total, [other], 0.5).tolist() == [1.0, 0.0, 0.0, 0.0]  # 2 places, 1 row with u > 0
    assert kl_gate_rows(total, [total.clone()], 1.0).tolist() == [0.0] * 4  # no disagreement: no gate
    agree, flip = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.4, 0.3, 0.2, 0.1])
    # against two: u = rank(total) - mean(rank(agree), rank(flip)) = rank(total) - 2.5
    assert kl_gate_rows(torch.tensor([1.0, 2.0, 3.0, 4.0]), [agree, flip], 0.25).tolist() == [0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="at least one reward function"):
        kl_gate_rows(total, [], 0.1)


def test_a_row_outside_the_gate_keeps_no_kl_and_a_gated_row_weighs_kl_beta():
    policy_loss, kl = torch.tensor(1.0), torch.tensor([0.4, 0.8, 1.2, 1.6])
    gate = torch.tensor([0.0, 1.0, 0.0, 1.0])
    loss, kl_term = with_kl(policy_loss, gated(kl, gate), 0.5)
    assert float(kl_term) == pytest.approx((0.8 + 1.6) / 4) and float(loss) == pytest.approx(1.0 + 0.5 * 0.6)
    assert gated(kl, None) is kl and gated(None, gate) is None


def config(model, against=("pixels",), share=0.5, **trainer):
    from test_train import train_config

    return train_config(model, functions={
        "colour": {"fn": "prompt_colour"},
        "same": {"fn": "prompt_colour", "weight": 0.0},  # the trained reward itself: no disagreement
        "pixels": {"fn": "tests.reward_fns:mean_pixel", "weight": 0.0}},
        **{"steps": 2, "kl_beta": 0.5, "kl_gate": {"against": list(against), "share": share}, **trainer})


def test_the_config_refuses_a_gate_without_a_kl_term_an_unknown_function_or_ranks(tiny_sd3_path):
    with pytest.raises(ConfigError, match="kl_gate: gates the KL term, and kl_beta 0"):
        config(tiny_sd3_path, kl_beta=0.0)
    with pytest.raises(ConfigError, match="trainer.kl_gate.against: 'judge' is not a reward function"):
        config(tiny_sd3_path, against=("judge",))
    with pytest.raises(ConfigError, match="use it with world_size 1"):
        config(tiny_sd3_path, world_size=2)
    with pytest.raises(ConfigError, match="share"):
        config(tiny_sd3_path, share=0.0)


@pytest.mark.slow  # slow: trains on Ray (twice)
def test_the_gate_opens_where_the_rewards_disagree_and_stays_shut_where_they_agree(ray_cluster, tiny_sd3_path,
                                                                                  tmp_path):
    from omniroll.train import Trainer

    runs = {}
    for name, against in (("agree", ("same",)), ("disagree", ("pixels",))):
        with Trainer(config(tiny_sd3_path, against=against), str(tmp_path / name), log=lambda s: None) as tr:
            runs[name] = tr.train()
    agree, disagree = runs["agree"], runs["disagree"]
    assert [m["kl_gate_share"] for m in agree] == [0.0, 0.0] and [m["kl"] for m in agree] == [0.0, 0.0]
    assert all(0 < m["kl_gate_share"] <= 0.5 for m in disagree), [m["kl_gate_share"] for m in disagree]
    assert disagree[0]["kl"] == 0.0 < disagree[1]["kl"]  # step 1 trains at the base (a fresh LoRA), step 2 has moved
    assert all(m["ratio_max_abs_dev"] == 0.0 for m in agree + disagree)


def test_the_adaptive_share_moves_as_gardo_moves_it_within_its_bounds_and_survives_a_checkpoint():
    from omniroll.train.kl_gate import AdaptiveShare

    a = AdaptiveShare(0.1, 0.02, 0.2)
    assert a.update(torch.tensor([1.0, 3.0, -2.0])) == pytest.approx(0.1)  # the first step: the starting share
    assert a.update(torch.tensor([5.0, -1.0])) == pytest.approx(0.11)  # mean of u >= 0 (5) above every kept mean (2)
    assert a.update(torch.tensor([3.0])) == pytest.approx(0.11)  # within the kept means' range: unchanged
    assert a.update(torch.tensor([0.5, -4.0])) == pytest.approx(0.099)  # below them all
    for _ in range(40):
        a.update(torch.tensor([-1.0]))  # no u >= 0: mean 0, then never below the window's minimum 0 again
    assert a.share >= 0.02 and len(a.means) == 20
    for k in range(40):
        a.update(torch.tensor([float(k + 10)]))  # rising every step
    assert a.share == pytest.approx(0.2)
    b = AdaptiveShare(0.1, 0.02, 0.2)
    b.load_state_dict(a.state_dict())
    assert b.update(torch.tensor([1.0])) == a.update(torch.tensor([1.0]))


def test_the_config_keeps_an_adaptive_share_within_its_bounds(tiny_sd3_path):
    with pytest.raises(ConfigError, match="share: with adaptive, share_min <= share <= share_max"):
        config(tiny_sd3_path, kl_gate={"against": ["pixels"], "share": 0.5, "adaptive": True})
    cfg = config(tiny_sd3_path, kl_gate={"against": ["pixels"], "share": 0.1, "adaptive": True})
    assert cfg.trainer.kl_gate.share_max == 0.2


@pytest.mark.slow  # slow: trains on Ray, then resumes
def test_an_adaptive_gate_logs_its_share_and_resumes_with_it(ray_cluster, tiny_sd3_path, tmp_path):
    from omniroll.train import Trainer

    cfg = config(tiny_sd3_path, steps=3, checkpoint_every=2,
                 kl_gate={"against": ["pixels"], "share": 0.1, "adaptive": True})
    with Trainer(cfg, str(tmp_path / "a"), log=lambda s: None) as tr:
        straight = tr.train()
    assert [m["kl_gate_target"] for m in straight][0] == pytest.approx(0.1)
    assert all(0.02 <= m["kl_gate_target"] <= 0.2 for m in straight)
    with Trainer(cfg, str(tmp_path / "b"), log=lambda s: None) as tr:
        tr.train(steps=2)
    from omniroll.train.checkpoint import find_checkpoint, read_trainer_state

    saved = read_trainer_state(find_checkpoint(str(tmp_path / "b")))["reward_controls"]
    assert len(saved["means"]) == 2 and saved["share"] == straight[1]["kl_gate_target"]
    with Trainer(cfg, str(tmp_path / "b"), resume=str(tmp_path / "b"), log=lambda s: None) as tr:
        resumed = tr.train()
    assert resumed[-1]["kl_gate_target"] == straight[-1]["kl_gate_target"]
