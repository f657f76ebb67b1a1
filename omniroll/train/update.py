"""The training phase of one step, and the loss it minimises.

- GRPO's pure pieces, with flow_grpo's definitions: per-group advantages (`group_advantages`) and the PPO-clip / KL
  loss terms (`ppo_clip_loss`, `kl_to_reference`).
- The off-policy objective of the asynchronous trainer (decoupled PPO, as in AReaL) and what it needs: the weights of
  the last versions (`VersionStore`), the behaviour log-probs recomputed under the version that ran each window step,
  and the batch's staleness.
- `train_on_batch`: inner epochs over shuffled micro-batches and every recorded window step, PPO-clip loss (+ optional
  KL), gradient accumulation, grad-norm clip, optimizer step. Measures `ratio_max_abs_dev` before the step's first
  optimizer update.

Decoupled PPO, per window step k of a row (A: its advantage, eps: clip_range, c: behaviour_weight_cap):

    w     = min(pi_prox / pi_behaviour, c)              (no grad)
    r     = pi_theta / pi_prox
    loss  = mean_rows( w * max(-A r, -A clip(r, 1 - eps, 1 + eps)) )

pi_behaviour: the policy that sampled the step (the engine's recorded log-prob, or a recompute under its version);
pi_prox: the trainer's weights at the start of the step (recomputed without grad, in the rollout's execution mode);
pi_theta: the weights being trained. When every step ran with the trainer's current weights (max_staleness 0),
pi_prox == pi_behaviour bitwise, so w == 1.0 exactly and the loss is `ppo_clip_loss`'s, bit for bit.

w is the ratio of the two policies' densities of the step's transition. A recorded log-prob is Flow-GRPO's mean over
the latent's D elements, so w = exp(D * (mean log pi_prox - mean log pi_behaviour)) (`density_log_ratio_scale`; for
cps, whose log-prob is minus the mean squared error, D / (2 std^2)). The ratio of the means themselves, the D-th
root of w, stayed within 0.5 % of 1 on the demo one version apart while log w averaged 0.16-0.5 in absolute value and
w reached 414, so used as w it corrected nothing. r keeps Flow-GRPO's mean convention (clip_range is set for it).

With `behaviour_log_probs` (the asynchronous trainer) `train_on_batch`'s loss is decoupled PPO: the PPO anchor is the
proximal policy (the weights at the start of the step, recomputed without grad; when every micro-batch runs before
the first optimizer update, that is the first pass's own log-prob, detached, bitwise the same), and each window step
is weighted by min(pi_prox / pi_behaviour, behaviour_weight_cap) (the density ratio). Without it, the behaviour is
the anchor (plain PPO-clip against the recorded log-probs).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from omniroll.train.policy import Policy, TrajectoryBatch, recompute_log_probs


# ------------------------------------------------------------------------------------------ advantages and loss
@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] fp32, clipped to +-adv_clip_max
    tied_groups: int  # groups whose rewards all tie (zero advantage: they teach nothing)
    num_groups: int
    tied_rewards: list[float] = field(default_factory=list)  # each tied group's common reward


def group_advantages(rewards: torch.Tensor, groups: Sequence, global_std: bool = False, adv_clip_max: float = 5.0,
                     eps: float = 1e-4) -> Advantages:
    """(r - mean of the row's group) / (std + eps), std of the group (or of the whole batch with `global_std`, as
    flow_grpo's PerPromptStatTracker), clipped to [-adv_clip_max, adv_clip_max]. std is the population std."""
    r = rewards.detach().double().reshape(-1)
    if len(groups) != r.numel():
        raise ValueError(f"groups has {len(groups)} entries for {r.numel()} rewards")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or Inf")
    adv = torch.empty_like(r)
    ids: dict = {}
    for i, g in enumerate(groups):
        ids.setdefault(g, []).append(i)
    tied: list[float] = []
    global_sd = r.std(unbiased=False)
    for rows in ids.values():
        idx = torch.tensor(rows)
        vals = r[idx]
        if bool((vals == vals[0]).all()):
            tied.append(float(vals[0]))
        sd = global_sd if global_std else vals.std(unbiased=False)
        adv[idx] = (vals - vals.mean()) / (sd + eps)
    adv = adv.clamp(-adv_clip_max, adv_clip_max).float()
    return Advantages(adv, len(tied), len(ids), tied)


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, with grad
    policy_loss: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor  # [B] detached
    clipped: torch.Tensor  # [B] bool: |ratio - 1| > clip_range
    approx_kl: torch.Tensor  # scalar: 0.5 mean((logp - old)^2)
    behaviour_ratio: torch.Tensor | None = None  # [B] pi_prox / pi_behaviour before truncation (decoupled PPO only)


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                  kl: torch.Tensor | None = None, kl_beta: float = 0.0) -> LossTerms:
    """flow_grpo's loss for one window step: mean(max(-A r, -A clip(r, 1 +- eps))) + beta * KL."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped, clipped))
    kl_term = kl.mean() if kl is not None else torch.zeros((), dtype=policy_loss.dtype)
    loss = policy_loss + kl_beta * kl_term if kl is not None and kl_beta > 0 else policy_loss
    d = (log_prob - old_log_prob).detach()
    return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=ratio.detach(),
                     clipped=(ratio.detach() - 1.0).abs() > clip_range, approx_kl=0.5 * torch.mean(d * d))


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, dt: torch.Tensor,
                    sde_type: Sequence[str]) -> torch.Tensor:
    """flow_grpo's KL per row: mean((mu - mu_ref)^2) / (2 std_t^2), with std_t its `std_dev_t`: the transition std s
    for cps / dance_sde, s / sqrt(-dt) for sde (so, like flow_grpo, it omits |dt| for `sde`)."""
    B = mean.shape[0]
    sq = ((mean - ref_mean) ** 2).reshape(B, -1).mean(1)
    is_sde = torch.tensor([t == "sde" for t in sde_type])
    std_t = torch.where(is_sde, std / torch.sqrt(torch.clamp(-dt, min=1e-12)), std)
    return sq / (2 * torch.clamp(std_t, min=1e-12) ** 2)


# ------------------------------------------------------------------------------- the off-policy (decoupled) loss
def decoupled_ppo_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                       advantages: torch.Tensor, clip_range: float, behaviour_weight_cap: float,
                       kl: Optional[torch.Tensor] = None, kl_beta: float = 0.0,
                       log_ratio_scale: torch.Tensor | float = 1.0) -> LossTerms:
    """Decoupled PPO-clip for one window step (see the module doc). `ratio`, `clipped` and `approx_kl` are measured
    against pi_prox (the PPO anchor). log_ratio_scale ([B] or a float): turns prox_log_prob - behaviour_log_prob into
    the log of the density ratio pi_prox / pi_behaviour (1.0 for log densities; `density_log_ratio_scale` for the
    recorded mean log-probs)."""
    log_w = torch.as_tensor(log_ratio_scale, dtype=torch.float64) * (prox_log_prob - behaviour_log_prob).detach(
    ).double()  # fp64: a large ratio stays finite in the metrics
    behaviour_ratio = torch.exp(log_w)
    w = behaviour_ratio.clamp(max=behaviour_weight_cap).to(log_prob.dtype)
    ratio = torch.exp(log_prob - prox_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(w * torch.maximum(unclipped, clipped))
    kl_term = kl.mean() if kl is not None else torch.zeros((), dtype=policy_loss.dtype)
    loss = policy_loss + kl_beta * kl_term if kl is not None and kl_beta > 0 else policy_loss
    d = (log_prob - prox_log_prob).detach()
    return LossTerms(loss=loss, policy_loss=policy_loss.detach(), kl=kl_term.detach(), ratio=ratio.detach(),
                     clipped=(ratio.detach() - 1.0).abs() > clip_range, approx_kl=0.5 * torch.mean(d * d),
                     behaviour_ratio=behaviour_ratio)


def density_log_ratio_scale(std: torch.Tensor, sde_type: list[str], numel: int) -> torch.Tensor:
    """[B] factor from a difference of two policies' recorded log-probs of one window step (each the mean over the
    latent's `numel` elements, Flow-GRPO's convention, with the same std: it does not depend on the weights) to the log
    of their density ratio: numel for a Gaussian step (sde, dance_sde), numel / (2 std^2) for cps (whose recorded
    log-prob is minus the mean squared error)."""
    cps = torch.tensor([t == "cps" for t in sde_type])
    std = std.detach().double().reshape(-1)
    return torch.where(cps, numel / (2 * std.clamp(min=1e-12) ** 2), torch.full_like(std, float(numel)))


class VersionStore:
    """The trainable weights of the last `keep` versions (LoRA: the adapter; full: every trained weight), so a window
    step can be rescored under the version that ran it. Memory: `keep` copies of the trained weights (none when
    keep == 0, the synchronous trainer)."""

    def __init__(self, policy: "Policy", keep: int):
        self.policy, self.keep = policy, int(keep)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.current: Optional[int] = None

    def record(self, version: int) -> None:
        """The policy's weights now are `version` (call after each optimizer update's sync, and at start)."""
        self.current = int(version)
        if self.keep > 0:
            self.snapshots[self.current] = [p.detach().clone() for p in self.policy.parameters()]
            for v in [v for v in self.snapshots if v < self.current - self.keep]:
                del self.snapshots[v]

    def has(self, version: int) -> bool:
        return version == self.current or version in self.snapshots

    @contextlib.contextmanager
    def weights(self, version: int) -> Iterator[None]:
        """The policy holds `version`'s weights inside the block (exact copies), its current ones after."""
        if version == self.current:
            yield
            return
        if version not in self.snapshots:
            raise KeyError(f"weight version {version} is not kept (kept: {sorted(self.snapshots)}, current "
                           f"{self.current}); the trainer keeps max_staleness + 1 versions")
        params = self.policy.parameters()
        with torch.no_grad():
            for p, s in zip(params, self.snapshots[version]):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(params, self.snapshots[self.current]):
                    p.copy_(s)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """`versions.safetensors`: every kept version's weights (a resumed run regenerates in-flight batches with
        them)."""
        from safetensors.torch import save_file

        names = [n for n, _ in self.policy.named_parameters()]
        tensors = {f"{v}/{n}": t.contiguous() for v, snap in self.snapshots.items() for n, t in zip(names, snap)}
        if tensors:
            save_file(tensors, os.path.join(path, "versions.safetensors"))

    def load(self, path: str, current: int) -> None:
        from safetensors.torch import load_file

        f = os.path.join(path, "versions.safetensors")
        names = [n for n, _ in self.policy.named_parameters()]
        loaded = load_file(f) if os.path.isfile(f) else {}
        versions = sorted({int(k.split("/", 1)[0]) for k in loaded})
        self.snapshots = {v: [loaded[f"{v}/{n}"] for n in names] for v in versions if v >= current - self.keep}
        self.record(current)


def step_versions(batch, num_steps: int) -> torch.Tensor:
    """[B, W] weight version of every window step: the engine's `step_weight_versions` when the batch carries them,
    else each sample's `weight_version` repeated (exact when no sample spans a weight sync)."""
    nt = batch.non_tensor_batch
    if "step_weight_versions" in nt:
        rows = [list(map(int, v)) for v in nt["step_weight_versions"]]
        bad = [i for i, r in enumerate(rows) if len(r) != num_steps]
        if bad:
            raise ValueError(f"step_weight_versions of rows {bad[:8]} do not have {num_steps} entries (one per "
                             f"recorded window step)")
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), num_steps)
    if "weight_version" not in nt:
        raise ValueError("the batch carries no weight versions (weight_version / step_weight_versions): its samples "
                         "cannot be trained on")
    return torch.tensor([int(v) for v in nt["weight_version"]], dtype=torch.long)[:, None].repeat(1, num_steps)


def staleness_stats(versions: torch.Tensor, current: int) -> dict:
    """staleness (current - version) of every window step, and the largest version span within one sample."""
    if versions.numel() == 0:
        return {"staleness_min": 0, "staleness_mean": 0.0, "staleness_max": 0, "version_span_max": 0}
    s = (current - versions).double()
    span = versions.max(1).values - versions.min(1).values
    return {"staleness_min": int(s.min()), "staleness_mean": float(s.mean()), "staleness_max": int(s.max()),
            "version_span_max": int(span.max())}


@torch.no_grad()
def log_probs_under_versions(store: VersionStore, traj: TrajectoryBatch, versions: torch.Tensor,
                             micro_batch_size: int) -> torch.Tensor:
    """[B, W] log-prob of every recorded window step under the version that ran it (no grad; the rollout's
    execution mode). Rows are scored in micro-batches of one version per step (batch invariance makes the grouping
    irrelevant to the values)."""
    B, W = versions.shape
    out = torch.empty(B, W, dtype=torch.float32)
    for v in sorted(set(versions.flatten().tolist())):
        with store.weights(v):
            for k in range(W):
                rows = (versions[:, k] == v).nonzero().flatten()
                for chunk in rows.split(micro_batch_size) if len(rows) else ():
                    out[chunk, k] = recompute_log_probs(store.policy.adapter, traj.rows(chunk), k).log_prob.float()
    return out


def behaviour_and_replay(store: VersionStore, traj: TrajectoryBatch, versions: torch.Tensor, *, old_log_prob: str,
                         decoupled: bool, micro_batch_size: int,
                         replay_rows: int) -> tuple[Optional[torch.Tensor], float]:
    """The behaviour log-probs the loss uses (None: plain PPO-clip against the recorded ones) and
    `behaviour_replay_max_abs_dev`: the first `replay_rows` rows' recorded log-probs against their recompute under
    the versions that ran them (with `old_log_prob: recompute` that recompute is the behaviour itself)."""
    sub = list(range(min(replay_rows, len(traj))))
    if old_log_prob == "recompute":
        behaviour = log_probs_under_versions(store, traj, versions, micro_batch_size)
        replay = behaviour[sub]
    else:
        replay = log_probs_under_versions(store, traj.rows(sub), versions[sub], micro_batch_size)
        behaviour = traj.log_probs if decoupled else None
    return behaviour, float((replay - traj.log_probs[sub]).abs().max()) if sub else 0.0


def off_policy_metrics(stats, versions: torch.Tensor, prox_version: int, replay_dev: float) -> dict:
    """A step's staleness and exactness metrics (README "Asynchronous training")."""
    return {**staleness_stats(versions, prox_version), "behaviour_replay_max_abs_dev": replay_dev,
            "prox_ratio_max_abs_dev": stats.ratio_max_abs_dev, "behaviour_ratio_mean": stats.behaviour_ratio_mean,
            "behaviour_ratio_max_abs_dev": stats.behaviour_ratio_max_abs_dev,
            "behaviour_weight_capped_frac": stats.behaviour_weight_capped_frac}


# --------------------------------------------------------------------------------------------- the inner epochs
@dataclass
class UpdateStats:
    ratio_max_abs_dev: float
    clip_frac: float
    approx_kl: float
    loss: float
    policy_loss: float
    kl: float
    grad_norm: float
    optimizer_steps: int
    behaviour_ratio_mean: float = 1.0  # pi_prox / pi_behaviour over every (row, window step, epoch); 1.0 when plain
    behaviour_ratio_max_abs_dev: float = 0.0  # max |pi_prox / pi_behaviour - 1|
    behaviour_weight_capped_frac: float = 0.0  # share of (row, window step) terms truncated at behaviour_weight_cap


def shuffle_generator(seed: int, step: int, epoch: int) -> torch.Generator:
    """Shuffling depends only on (seed, step, epoch): a resumed run shuffles exactly as a straight one."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) * 1009 + int(epoch))


def perm_rows_before_first_update(B: int, seed: int, step: int, micro_batch_size: int, per_update: int) -> set:
    """The rows of epoch 0 scored before its first optimizer update (the first `per_update` micro-batches)."""
    perm = torch.randperm(B, generator=shuffle_generator(seed, step, 0))
    return set(perm[: per_update * micro_batch_size].tolist())


def train_on_batch(policy: Policy, optimizer: torch.optim.Optimizer, traj: TrajectoryBatch, advantages: torch.Tensor,
                   *, step: int, seed: int, num_inner_epochs: int, micro_batch_size: int,
                   micro_batches_per_update: int | None, clip_range: float, kl_beta: float,
                   max_grad_norm: float, behaviour_log_probs: torch.Tensor | None = None,
                   behaviour_weight_cap: float = 2.0, prox_check_rows: int = 0) -> UpdateStats:
    B, W = len(traj), traj.num_steps
    if advantages.shape != (B,):
        raise ValueError(f"advantages must be [{B}], got {tuple(advantages.shape)}")
    params = policy.parameters()
    n_micro = (B + micro_batch_size - 1) // micro_batch_size
    per_update = micro_batches_per_update or n_micro
    dev, clipped, total, kls, approx, losses, plosses, norms = 0.0, 0, 0, [], [], [], [], []
    b_sum, b_dev, capped = 0.0, 0.0, 0
    updates = 0
    prox = None
    if behaviour_log_probs is not None:  # decoupled PPO: pi_prox of every row and step, filled before the first update
        prox = torch.full((B, W), float("nan"))
        # rows seen after the first update, and the check rows (whose anchor is a true no-grad recompute, so
        # ratio_max_abs_dev measures it), are recomputed now
        first = perm_rows_before_first_update(B, seed, step, micro_batch_size, per_update)
        need = sorted((set(range(B)) - first) | set(range(min(prox_check_rows, B))))
        if need:
            with torch.no_grad():
                for chunk in torch.tensor(need).split(micro_batch_size):
                    for k in range(W):
                        prox[chunk, k] = recompute_log_probs(policy.adapter, traj.rows(chunk), k).log_prob.float()
    optimizer.zero_grad(set_to_none=True)
    for epoch in range(num_inner_epochs):
        perm = torch.randperm(B, generator=shuffle_generator(seed, step, epoch))
        chunks = perm.split(micro_batch_size)
        for c, rows in enumerate(chunks):
            mb = traj.rows(rows)
            adv = advantages[rows]
            group_start = (c // per_update) * per_update
            group_size = min(per_update, len(chunks) - group_start)
            for k in range(W):
                out = recompute_log_probs(policy.adapter, mb, k)
                kl = None
                if kl_beta > 0:
                    with torch.no_grad(), policy.reference() as ref:
                        ref_out = recompute_log_probs(ref, mb, k)
                    kl = kl_to_reference(out.mean, ref_out.mean, out.std, mb.sigmas_next[:, k] - mb.sigmas[:, k],
                                         mb.sde_type)
                if prox is None:
                    terms = ppo_clip_loss(out.log_prob, mb.log_probs[:, k], adv, clip_range, kl, kl_beta)
                else:
                    p = prox[rows, k]
                    if updates == 0:  # before the first update: unset rows take this very pass's value
                        p = torch.where(torch.isnan(p), out.log_prob.detach().float(), p)
                        prox[rows, k] = p
                    terms = decoupled_ppo_loss(out.log_prob, p, behaviour_log_probs[rows, k], adv, clip_range,
                                               behaviour_weight_cap, kl, kl_beta,
                                               density_log_ratio_scale(out.std, mb.sde_type, mb.latents[0, k].numel()))
                (terms.loss / (group_size * W)).backward()
                if updates == 0:
                    dev = max(dev, float((terms.ratio - 1.0).abs().max()))
                clipped += int(terms.clipped.sum())
                if terms.behaviour_ratio is not None:
                    b_sum += float(terms.behaviour_ratio.double().sum())
                    b_dev = max(b_dev, float((terms.behaviour_ratio - 1.0).abs().max()))
                    capped += int((terms.behaviour_ratio > behaviour_weight_cap).sum())
                total += len(rows)
                approx.append(float(terms.approx_kl))
                losses.append(float(terms.loss.detach()))
                plosses.append(float(terms.policy_loss))
                kls.append(float(terms.kl))
            if (c + 1) % per_update == 0 or c == len(chunks) - 1:
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                updates += 1

    def mean(x):
        return sum(x) / max(len(x), 1)

    return UpdateStats(ratio_max_abs_dev=dev, clip_frac=clipped / max(total, 1), approx_kl=mean(approx),
                       loss=mean(losses), policy_loss=mean(plosses), kl=mean(kls), grad_norm=mean(norms),
                       optimizer_steps=updates,
                       behaviour_ratio_mean=b_sum / max(total, 1) if prox is not None else 1.0,
                       behaviour_ratio_max_abs_dev=b_dev, behaviour_weight_capped_frac=capped / max(total, 1))
