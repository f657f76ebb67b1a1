"""`DataRegularizer`: the flow-matching loss on the task world's own renders, added to every optimizer step of the
update at `trainer.data_regularizer.weight`: DDRL's idea (arXiv 2512.04332: regularise toward data rather than toward
a reference model), with the world's renderer as the data (unlimited, and right by construction).

Optimizer step u of training step s draws `batch` of the run's training prompts (uniformly, with replacement) and
one render seed for each from (seed, s, u), renders them (`omniroll.tasks.renders.render_task_prompt`), encodes each
render with the model's VAE (`encode_pixels`: the posterior mean, in the denoiser's normalisation) and its prompt
with the text encoders (kept per prompt: they are not trained), and scores the policy's conditional velocity (CFG
off, the rollout's execution mode) at a noised point of the rollout's own schedule:

    t   = one of the sampling sigmas after the first (uniform),  eps ~ N(0, I)
    x_t = (1 - t) x0 + t eps
    loss = weight * mean((v_theta(x_t, t) - (eps - x0))^2)

The loss is backpropagated once per optimizer step, after the algorithm's terms and before the gradient clip, so it
adds to every optimizer step the same pull, whatever the micro-batching. The metric `data_loss` is its unweighted
mean over the step's optimizer steps: how well the policy still draws the world's own pictures.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from omniroll.tasks.renders import render_task_prompt, task_render_size

class DataRegularizer:
    """adapter: the policy's model; task: its world (`omniroll.models.model_task`); prompts: the run's training
    prompts; pipeline: the `pipeline` config section (the rollout's size, steps, text length, guidance); weight,
    batch, seed: `trainer.data_regularizer.weight` / `.batch` and `trainer.seed`. The config has checked that the
    world renders, at the rollout's size (`omniroll.tasks.renders.check_render_size`)."""

    def __init__(self, adapter, task: str, prompts: list[str], pipeline, weight: float, batch: int, seed: int):
        side, frames = task_render_size(task)
        self.adapter, self.task, self.prompts = adapter, task, list(prompts)
        self.pipeline, self.weight, self.batch, self.seed = pipeline, float(weight), int(batch), int(seed)
        self.sigmas = adapter.sigmas(pipeline.num_inference_steps, side, side, frames).float()
        self._cond: dict = {}  # prompt -> its Conditioning (the text encoders are frozen)

    def renders(self, step: int, update: int) -> tuple[list[str], np.ndarray]:
        """(prompts, uint8 pixels [batch, ...]) of optimizer step `update` of `step`: the same for the same pair."""
        rng = np.random.default_rng([self.seed, step, update])
        prompts = [self.prompts[int(i)] for i in rng.integers(len(self.prompts), size=self.batch)]
        seeds = rng.integers(0, 2 ** 62, size=self.batch)
        return prompts, np.stack([render_task_prompt(self.task, p, int(s)) for p, s in zip(prompts, seeds)])

    def rows(self, prompts: list[str], pixels: np.ndarray, execution: dict):
        """A CleanBatch (on the CPU) of the pixels' latents, their prompts' conditioning and the rollout's schedule."""
        from omniroll.models.base import stack_conditioning
        from omniroll.train.clean_batch import CleanBatch

        with torch.no_grad():
            x0 = self.adapter.encode_pixels(torch.from_numpy(pixels).float() / 127.5 - 1.0)
            missing = [p for p in dict.fromkeys(prompts) if p not in self._cond]
            if missing:
                conds = self.adapter.encode_prompts(missing, self.pipeline.max_sequence_length)
                self._cond.update({p: c.to("cpu") for p, c in zip(missing, conds)})
        n = len(prompts)
        return CleanBatch(x0=x0.cpu(), sigmas=self.sigmas.expand(n, -1).clone(),
                          guidance_scale=torch.full((n,), float(self.pipeline.guidance_scale)),
                          cond=stack_conditioning([self._cond[p] for p in prompts]), execution=dict(execution))

    def loss_of(self, rows, step: int, update: int) -> torch.Tensor:
        """The unweighted flow-matching loss of `rows` (module doc), its timesteps and noise drawn from (seed, step,
        update); with autograd."""
        g = torch.Generator().manual_seed(int(np.random.default_rng([self.seed, step, update, 1]).integers(2 ** 62)))
        n, T = len(rows), rows.num_steps
        k = torch.randint(1, T, (n,), generator=g) if T > 1 else torch.zeros(n, dtype=torch.long)
        t = rows.sigmas[torch.arange(n), k.to(rows.sigmas.device)]
        eps = torch.randn(rows.x0.shape, generator=g).to(rows.x0.device)
        view = (n,) + (1,) * (rows.x0.dim() - 1)
        x_t = (1 - t.view(view)) * rows.x0 + t.view(view) * eps
        v = rows.velocity(self.adapter, x_t, t)
        return ((v.float() - (eps - rows.x0)) ** 2).mean()

    def loss(self, step: int, update: int, execution: dict, device) -> torch.Tensor:
        """The unweighted loss of optimizer step `update` of `step`: its renders' rows on `device`, scored."""
        return self.loss_of(self.rows(*self.renders(step, update), execution).to(device), step, update)

    def term(self, step: int, execution: dict, device) -> Callable[[int], torch.Tensor]:
        """What the update calls at each optimizer step u (`UpdatePlan.data_term`): (weighted loss, unweighted)."""
        def at(update: int):
            raw = self.loss(step, update, execution, device)
            return self.weight * raw, float(raw.detach())

        return at


def data_regularizer(config: Any, adapter, prompts: list[str]) -> Optional[DataRegularizer]:
    """The run's regulariser (`trainer.data_regularizer`), None when off."""
    section = config.trainer.data_regularizer
    if section is None:
        return None
    from omniroll.models import model_task

    return DataRegularizer(adapter, model_task(config.engine.model), prompts, config.pipeline, section.weight,
                           section.batch, config.trainer.seed)
