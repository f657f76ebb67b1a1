"""The per-timestep ratio statistics (omniroll/train/ratio_steps.py) against numbers computed by hand: the sums of two
loss terms, the record's keys per step and overall, the ranks' sums merged (`merge_stats`), fp64 digits of a ratio
within 1e-9 of 1, and the tracker names."""

import math

import pytest
import torch

from omniroll.train.parallel.shard import merge_stats
from omniroll.train.ratio_steps import add_step_sums, ratio_step_metrics, ratio_step_sums
from omniroll.train.report.tracking import tracker_name
from omniroll.train.update import UpdateStats

EPS = 0.15  # the clip range the two terms below were clipped at


def term(steps, ratios, log_prob_diff=None):
    """The sums of one loss term: rows at denoising `steps` with these ratios, clipped at EPS as the loss clips."""
    r = torch.tensor(ratios, dtype=torch.float32)
    return ratio_step_sums(torch.tensor(steps), torch.log(torch.tensor(ratios, dtype=torch.float64)).float(),
                           None if log_prob_diff is None else torch.tensor(log_prob_diff), r, (r - 1).abs() > EPS)


def two_terms():
    # term 1: steps 0, 0, 1 with ratios 1.1, 0.8 (clipped below), 1.0; term 2: steps 1, 2 with 1.3 (clipped above), 0.95
    return add_step_sums(term([0, 0, 1], [1.1, 0.8, 1.0]), term([1, 2], [1.3, 0.95]))


def test_the_record_per_step_and_overall_equals_the_hand_computed_numbers():
    m = ratio_step_metrics(two_terms())
    approx = lambda x: pytest.approx(x, rel=1e-6, abs=1e-7)  # noqa: E731 - the ratios went through fp32
    # step 0: ratios 1.1 and 0.8
    assert m["ratio_mean_ts_0"] == approx(0.95) and m["ratio_std_ts_0"] == approx(0.15)
    assert (m["clip_frac_higher_ts_0"], m["clip_frac_lower_ts_0"], m["ratio_samples_ts_0"]) == (0.0, 0.5, 2)
    assert m["log_prob_abs_diff_ts_0"] == approx((math.log(1.1) - math.log(0.8)) / 2)  # 0.1592269
    # step 1: ratios 1.0 and 1.3
    assert m["ratio_mean_ts_1"] == approx(1.15) and m["ratio_std_ts_1"] == approx(0.15)
    assert (m["clip_frac_higher_ts_1"], m["clip_frac_lower_ts_1"], m["ratio_samples_ts_1"]) == (0.5, 0.0, 2)
    assert m["log_prob_abs_diff_ts_1"] == approx(math.log(1.3) / 2)  # 0.1311821
    # step 2: one ratio, 0.95
    assert m["ratio_mean_ts_2"] == approx(0.95) and m["ratio_std_ts_2"] == approx(0.0)
    assert m["log_prob_abs_diff_ts_2"] == approx(-math.log(0.95)) and m["ratio_samples_ts_2"] == 1
    # overall: 1.1, 0.8, 1.0, 1.3, 0.95 -> mean 1.03, squared deviations .0049 .0529 .0009 .0729 .0064 (sum .138)
    assert m["ratio_mean"] == approx(1.03) and m["ratio_std"] == approx(math.sqrt(0.138 / 5))
    assert (m["clip_frac_higher"], m["clip_frac_lower"], m["ratio_samples"]) == (0.2, 0.2, 5)
    assert m["log_prob_abs_diff"] == approx((math.log(1.1) - math.log(0.8) + math.log(1.3) - math.log(0.95)) / 5)
    assert [k for k in m if "_ts_" not in k] == ["ratio_mean", "ratio_std", "clip_frac_higher", "clip_frac_lower",
                                                 "log_prob_abs_diff", "ratio_samples"]
    assert sorted({k.split("_ts_")[1] for k in m if "_ts_" in k}) == ["0", "1", "2"]


def test_the_log_prob_difference_is_its_own_when_given_and_an_empty_sum_has_no_keys():
    # GRPO-Guard: its ratio is normalised, the |log-prob difference| is the raw one it is built from
    m = ratio_step_metrics(term([4, 4], [1.0, 1.0], log_prob_diff=[-0.5, 0.25]))
    assert m["log_prob_abs_diff_ts_4"] == pytest.approx(0.375) and m["ratio_mean_ts_4"] == 1.0
    assert m["ratio_std_ts_4"] == 0.0 and "ratio_mean_ts_0" not in m
    assert ratio_step_metrics({}) == {}  # the forward-process algorithms: no ratio, no keys


def test_a_ratio_within_1e_9_of_1_keeps_its_digits():
    """fp32 rounds exp(1e-9) to 1.0; the sums take r - 1 = expm1(log r) in fp64."""
    log_r = torch.tensor([1e-9, 3e-9], dtype=torch.float32)
    m = ratio_step_metrics(ratio_step_sums(torch.tensor([0, 0]), log_r, None, torch.exp(log_r),
                                           torch.zeros(2, dtype=torch.bool)))
    assert torch.exp(log_r).tolist() == [1.0, 1.0]
    assert m["ratio_mean"] - 1.0 == pytest.approx(2e-9, rel=1e-6)
    assert m["ratio_std"] == pytest.approx(1e-9, rel=1e-4)


def test_rows_of_a_different_length_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="log_ratio has 3 values, steps has 2"):
        ratio_step_sums(torch.tensor([0, 1]), torch.zeros(3), None, torch.ones(2), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="step 0 has 2 sums"):
        add_step_sums({}, {0: [1.0, 2.0]})


def test_the_ranks_sums_merge_into_the_whole_batchs_numbers():
    """Data-parallel: each rank sums its own terms; `merge_stats` adds the sums, so a step's mean is over every rank's
    samples at it and its std comes from their sums of squares (not the mean of the ranks' stds)."""
    def stats(sums, scored):
        return UpdateStats(ratio_max_abs_dev=0.0, clip_frac=0.0, approx_kl=0.0, loss=0.0, policy_loss=0.0, kl=0.0,
                           grad_norm=1.0, optimizer_steps=2, scored=scored, ratio_steps=sums)

    rank0, rank1 = term([0, 0, 1], [1.1, 0.8, 1.0]), term([1, 2], [1.3, 0.95])
    merged = merge_stats([stats(rank0, 3), stats(rank1, 2)])
    whole = ratio_step_metrics(two_terms())
    assert ratio_step_metrics(merged.ratio_steps) == pytest.approx(whole, rel=1e-12)
    assert merged.scored == 5 and merged.optimizer_steps == 2
    # a rank without rows adds nothing
    assert ratio_step_metrics(merge_stats([stats(rank0, 3), stats({}, 0)]).ratio_steps) == \
        pytest.approx(ratio_step_metrics(term([0, 0, 1], [1.1, 0.8, 1.0])), rel=1e-12)


def test_tracker_names_are_verl_omnis_with_the_step_index_last():
    assert [tracker_name(k) for k in ("ratio_mean_ts_3", "ratio_std_ts_3", "clip_frac_higher_ts_3",
                                      "clip_frac_lower_ts_3", "log_prob_abs_diff_ts_3", "ratio_samples_ts_3",
                                      "ratio_mean", "clip_frac_higher")] == \
        ["actor/ratio_mean_ts_3", "actor/ratio_std_ts_3", "actor/pg_clipfrac_higher_ts_3",
         "actor/pg_clipfrac_lower_ts_3", "actor/logprob_abs_diff_ts_3", "actor/ratio_samples_ts_3",
         "actor/ratio_mean", "actor/pg_clipfrac_higher"]
    # not '/ts_3': MLflow's file store keeps a metric as a file, so actor/ratio_mean could not also be a folder
    assert tracker_name("other_ts_3") == "train/other_ts_3"  # only the ratio statistics are read as per-step keys
