"""`LearningSignalCheck`: whether a run's batches still carry a GRPO learning signal, read from each step's metrics.

A prompt group is tied when all its rewards are equal: its advantages are 0 and it teaches nothing. A run whose every
group is tied trains on nothing; it happens when a learning rate too high collapsed the policy to one output (every
sample of a prompt looks the same), when the reward cannot tell the samples apart (a constant, a saturated or a
zero-weight reward), or when the groups are too small (`n`). Fed every step's metrics (`step`, `tied_groups`,
`num_groups`, `reward_mean`, `reward_std`), with `trainer.signal_check`:

- tells solved groups from the others: a group tied at (or above) the best reward any sample of the run has had so
  far (`reward_max` of the steps, `tied_rewards` of this one), in a run whose mean reward has been below that best,
  has every sample right; it teaches nothing either, but that is success, not collapse. When at least
  `tied_warn_frac` of a step's groups are solved it says so once (the prompts are learned: harder prompts or a larger
  `n` give more signal);
- warns, one line through the trainer's `log`, when at least `tied_warn_frac` of a step's groups are tied below
  the best reward, once per episode (again only after the share fell below it);
- warns when the reward has fallen far below its start: the mean of the step rewards of the last `reward_window`
  steps is more than `reward_drop_stds` standard errors below that of the first `reward_window` steps. The standard
  error of that difference comes from how much the step rewards vary from step to step in the two windows (each step
  draws other prompts), floored by a step mean's own sampling noise (`reward_std` / sqrt(`num_samples`)), so the test
  is in the reward's own units: it works for a reward of any sign and scale, and flags a steady slide (0.6 to 0.35
  over 20 steps of a partial-credit reward whose samples spread +- 0.3) as well as a collapse. Once per episode (a
  new one starts when the drop is back under half the threshold);
- warns when the step's update is mostly noise: the gradient-signal meter (`grad_cos`, omniroll/train/grad_signal.py:
  the cosine between the gradients of two halves of a step's prompt groups) averaged over its last `grad_cos_window`
  readings (`grad_cos_mean`), plus twice the standard error of that mean, is below `grad_cos_warn`: the halves do not
  agree, so each optimizer step goes in a direction the next batch would not confirm. Once per episode; an episode
  ends when the window's mean itself reaches `grad_cos_warn`, not when only its upper bound does (a meter reading
  about +0.02 +- 0.03, as the demo's does at 24 samples per half, would otherwise warn again every few steps);
- raises `NoLearningSignal` when every group has been tied, and not every one solved, for `stop_after_tied_steps`
  consecutive steps (0: never).
  The trainer then writes the checkpoint of the last completed step and re-raises; `omniroll train` exits 1 with the
  exception's `problems`, one line each.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


class NoLearningSignal(RuntimeError):
    """Every GRPO group of the last `trainer.signal_check.stop_after_tied_steps` steps had tied rewards: the run was
    stopped (after the checkpoint of its last completed step). `problems`: what was measured, the likely causes and
    what to change, one line each; `steps`: those steps' metrics."""

    def __init__(self, problems: list[str], steps: list[dict]):
        self.problems, self.steps = list(problems), list(steps)
        super().__init__("\n".join(self.problems))


class LearningSignalCheck:
    """See the module doc. `settings`: a `trainer.signal_check` section; `hints`: config values the stop message
    names (e.g. {"trainer.lr": 0.006, "n": 8}); `earlier`: the metrics of this run's steps before this process (a
    resumed run), whose first steps are the reward's start."""

    def __init__(self, settings: Any, log: Callable[[str], None] = print, hints: Optional[dict] = None,
                 earlier: Sequence[dict] = ()):
        self.tied_warn_frac = float(settings.tied_warn_frac)
        self.stop_after = int(settings.stop_after_tied_steps)
        self.window = int(settings.reward_window)
        self.drop_stds = float(settings.reward_drop_stds)
        self.cos_window = int(settings.grad_cos_window)
        self.cos_warn = float(settings.grad_cos_warn)
        self.warned_noise = False
        self.log, self.hints = log, dict(hints or {})
        self.rewards = [self._point(m) for m in earlier if "reward_mean" in m and "reward_std" in m]
        self.tied_streak: list[dict] = []  # the consecutive all-tied steps up to now
        self.best = max((float(m["reward_max"]) for m in earlier if "reward_max" in m), default=float("-inf"))
        self.warned_tied = False
        self.warned_drop = False
        self.said_solved = False

    @classmethod
    def for_config(cls, config: Any, log: Callable[[str], None], earlier: Sequence[dict] = ()) -> "LearningSignalCheck":
        """From an OmniRollConfig with a trainer section."""
        return cls(config.trainer.signal_check, log, {"trainer.lr": config.trainer.lr, "n": config.n}, earlier)

    def observe(self, m: dict) -> None:
        """One step's metrics: warn (module doc), raise `NoLearningSignal` on the stop condition."""
        tied, groups = int(m.get("tied_groups", 0)), int(m.get("num_groups", 0))
        self.rewards.append(self._point(m))
        self.best = max(self.best, float(m.get("reward_max", float("-inf"))))
        varied = self.best > min(r for r, _ in self.rewards)  # a reward that never varied solves nothing
        solved = sum(v >= self.best for v in m.get("tied_rewards", ())) if varied else 0
        if groups and solved / groups >= self.tied_warn_frac and not self.said_solved:
            self.log(f"step {m['step']}: {solved}/{groups} prompt groups are solved (every sample at the run's best "
                     f"reward, {self.best:+.4g}): they teach nothing more; harder prompts or a larger n give more "
                     f"signal")
            self.said_solved = True
        share = (tied - solved) / groups if groups else 0.0
        if share >= self.tied_warn_frac and not self.warned_tied:
            self.log(f"warning: step {m['step']}: {tied - solved}/{groups} prompt groups have tied rewards below the "
                     f"best seen (all equal within the group: zero advantage, nothing to learn from them): a collapsed "
                     f"policy (learning rate too high), a reward that cannot tell the samples apart, or a group size "
                     f"too small?")
        self.warned_tied = share >= self.tied_warn_frac
        drop = self.reward_drop()
        if drop is not None and not self.warned_drop:
            self.log(f"warning: step {m['step']}: {drop}: the policy may be collapsing (a learning rate too high?)")
            self.warned_drop = True
        elif drop is None and self.reward_drop(self.drop_stds / 2) is None:  # recovered by a margin: a new episode
            self.warned_drop = False
        if m.get("grad_cos_mean") is not None:
            noise = self.gradient_noise(m)
            if noise is not None and not self.warned_noise:
                self.log(f"warning: step {m['step']}: {noise}")
                self.warned_noise = True
            elif self.warned_noise and self.halves_agree(m):  # recovered: a new episode
                self.warned_noise = False
        self.tied_streak = self.tied_streak + [m] if groups and tied == groups and solved < groups else []
        if self.stop_after and len(self.tied_streak) >= self.stop_after:
            raise NoLearningSignal(self.stop_message(self.tied_streak[-self.stop_after:]), self.tied_streak)

    @staticmethod
    def _point(m: dict) -> tuple[float, float]:
        """(a step's mean reward, the sampling noise of that mean: reward_std / sqrt(num_samples), 0 unknown)."""
        n = int(m.get("num_samples", 0) or 0)
        return float(m["reward_mean"]), float(m["reward_std"]) / n ** 0.5 if n > 0 else 0.0

    def reward_drop(self, stds: Optional[float] = None) -> Optional[str]:
        """What the reward-drop warning says, when the reward has fallen more than `stds` (default:
        `reward_drop_stds`) standard errors below its start (else None)."""
        stds = self.drop_stds if stds is None else stds
        w = self.window
        if len(self.rewards) < 2 * w:
            return None
        first, last = self.rewards[:w], self.rewards[-w:]
        start = sum(r for r, _ in first) / w
        now = sum(r for r, _ in last) / w

        def var(points):  # step-to-step variance of the step means, floored by their own sampling noise
            mean = sum(r for r, _ in points) / w
            between = sum((r - mean) ** 2 for r, _ in points) / (w - 1) if w > 1 else 0.0
            return max(between, sum(e * e for _, e in points) / w)

        se = ((var(first) + var(last)) / w) ** 0.5
        if not start - now > stds * se:
            return None
        n = len(self.rewards)
        return (f"the mean reward of steps {n - w + 1}-{n} ({now:+.4g}) is {start - now:.3g} below that of steps 1-{w} "
                f"({start:+.4g}), more than {stds:g} x the standard error of that difference ({se:.3g}, "
                f"from the step rewards' spread)")

    def gradient_noise(self, m: dict) -> Optional[str]:
        """What the noise warning says, when the meter's window (`grad_cos_mean` +- `grad_cos_se` over
        `grad_cos_readings` readings, omniroll/train/grad_signal.py's SignalWindow) is full and confidently below
        `grad_cos_warn` (else None)."""
        from omniroll.train.grad_signal import samples_for_cos, snr_from_cos

        k, mean, se = int(m.get("grad_cos_readings", 0)), float(m["grad_cos_mean"]), float(m["grad_cos_se"])
        if not self.window_full(m) or not mean + 2 * se < self.cos_warn:
            return None
        n = float(m.get("grad_cos_rows", 0))
        need = samples_for_cos(snr_from_cos(mean + 2 * se, n))
        need_text = f"more than {need:,.0f}" if need < float("inf") else "far more"
        return (f"the step's update is mostly noise: grad_cos (the cosine between the gradients of two halves of "
                f"the step's prompt groups) read {mean:+.3f} +- {se:.3f} over the last {k} steps at {n:.0f} "
                f"samples per half, so two updates of this size would agree with cosine 0.5 only at {need_text} "
                f"samples each. A small signal can still add up over many steps (measure it at larger batches with "
                f"benchmarks/grad_signal.py before tuning the learning rate); for more per step: more samples per "
                f"update (prompts_per_step, n), a KL term (trainer.kl_beta) against the random walk, or another "
                f"estimator (trainer.algorithm)")

    def halves_agree(self, m: dict) -> bool:
        """Whether the meter's full window reads its mean itself at or above `grad_cos_warn`: the end of a noise
        episode. Only the mean, not the mean plus its noise: a window whose upper bound merely touches the threshold
        (AWM's demo reads +0.02 +- 0.03 at 24 samples per half) is the same episode, and says nothing again."""
        return self.window_full(m) and float(m["grad_cos_mean"]) >= self.cos_warn

    def window_full(self, m: dict) -> bool:
        """Whether the meter's window holds `grad_cos_window` readings: both noise verdicts wait for it."""
        return int(m.get("grad_cos_readings", 0)) >= self.cos_window

    def stop_message(self, steps: list[dict]) -> list[str]:
        """The lines `NoLearningSignal` carries: what was measured, the likely causes, what to change."""
        first, last = steps[0]["step"], steps[-1]["step"]
        ties = ", ".join(f"{m['tied_groups']}/{m['num_groups']}" for m in steps)
        rewards = ", ".join(f"{m['reward_mean']:+.4g} +- {m['reward_std']:.3g}" for m in steps)
        drop = self.reward_drop()
        lr, n = self.hints.get("trainer.lr"), self.hints.get("n")
        return [
            f"no learning signal: every prompt group had tied rewards (all equal within the group: zero advantage) "
            f"for {len(steps)} consecutive steps, {first}-{last}: tied_groups/num_groups {ties}; reward mean +- std "
            f"{rewards}" + (f"; {drop}" if drop else ""),
            "likely cause: a learning rate too high that collapsed the policy to one output"
            + (f" (trainer.lr={lr:g})" if lr is not None else "") + ", a reward that cannot tell the samples apart "
            "(constant, saturated or weighted 0), or a group size too small" + (f" (n={n})" if n is not None else ""),
            "what to change: lower trainer.lr (e.g. 10x) and start again (or --resume a checkpoint from before the "
            "reward fell); check that the reward differs between samples of one prompt; raise n; "
            "trainer.signal_check.stop_after_tied_steps=0 trains on regardless",
        ]
