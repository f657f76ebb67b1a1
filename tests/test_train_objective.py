"""The asynchronous trainer's off-policy objective (decoupled PPO), as pure functions: it reduces bitwise to
PPO-clip when nothing is stale, truncates the behaviour weight at its cap, and that weight is the ratio of the two
policies' densities of the window step (not of the recorded mean log-probs)."""

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from omniroll.sampling.sde import sde_step
from omniroll.train.algorithms.ppo import decoupled_ppo_loss, density_log_ratio_scale, ppo_clip_loss


def test_decoupled_loss_is_ppo_clip_bitwise_when_prox_is_behaviour_and_truncates_the_weight():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(16, generator=g)
    adv = torch.randn(16, generator=g)
    grads = []
    for fn in ("ppo", "decoupled"):
        logp = (old + 1e-3 * torch.randn(16, generator=torch.Generator().manual_seed(1))).requires_grad_(True)
        t = (ppo_clip_loss(logp, old, adv, 2e-4) if fn == "ppo"
             else decoupled_ppo_loss(logp, old.clone(), old.clone(), adv, 2e-4, 2.0))
        t.loss.backward()
        grads.append((t.loss.detach(), logp.grad.clone(), t.ratio, t.clipped, t.approx_kl))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    # a stale step: the weight pi_prox / pi_behaviour multiplies the row's term, truncated at the cap
    logp = old.clone().requires_grad_(True)
    behaviour = old - torch.tensor([0.1, 2.0] * 8)  # weights e^0.1 and e^2 > 2
    t = decoupled_ppo_loss(logp, old, behaviour, adv, 2e-4, 2.0)
    w = torch.tensor([float(np.exp(0.1)), 2.0] * 8)
    assert torch.allclose(t.loss, torch.mean(-adv * w)), (t.loss, torch.mean(-adv * w))


@pytest.mark.parametrize("sde_type", ["sde", "dance_sde", "cps"])
def test_the_behaviour_weight_is_the_ratio_of_the_two_policies_densities_of_the_window_step(sde_type):
    """A step sampled by one policy (velocity v_b) and rescored by another (v_prox): the weight is
    pi_prox(x' | x) / pi_behaviour(x' | x) of the Gaussian transition, computed independently here, although the
    recorded log-probs are means over the latent's elements (whose own ratio, its D-th root, is near 1)."""
    g = torch.Generator().manual_seed(0)
    B, shape = 6, (16, 8, 8)
    x, v_b = torch.randn(B, *shape, generator=g), torch.randn(B, *shape, generator=g)
    v_prox = v_b + 0.02 * torch.randn(B, *shape, generator=g)  # the next version: a small change of the velocity
    step = dict(sigma=0.7, sigma_next=0.6, noise_level=0.8, sde_type=sde_type)
    behaviour = sde_step(x, v_b, **step, generator=g)
    prox = sde_step(x, v_prox, **step, prev_sample=behaviour.prev_sample)
    true_log_w = [Normal(o.mean[i], o.std[i]).log_prob(behaviour.prev_sample[i]).double().sum()
                  for o in (prox, behaviour) for i in range(B)]
    true_w = torch.exp(torch.stack(true_log_w[:B]) - torch.stack(true_log_w[B:]))
    scale = density_log_ratio_scale(prox.std, [sde_type] * B, x[0].numel())
    t = decoupled_ppo_loss(prox.log_prob, prox.log_prob, behaviour.log_prob, torch.ones(B), 1e-4, 1e9,
                           log_ratio_scale=scale)
    assert torch.allclose(t.behaviour_ratio, true_w, rtol=1e-3), (t.behaviour_ratio, true_w)
    assert (true_w - 1).abs().max() > 0.1  # the densities differ ...
    assert (torch.exp(prox.log_prob - behaviour.log_prob) - 1).abs().max() < 0.01  # ... their mean log-probs barely
