"""The recipe of the shapes model: every setting of `omniroll pretrain shapes`, kept as one JSON-able object and
written beside the checkpoint it made (`recipe.json`). `SHIPPED` is the recipe of the checkpoint in the package."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from omniroll.models.shapes.data import CATEGORY_WEIGHTS
from omniroll.models.shapes.dit import DitRecipe
from omniroll.models.shapes.distill import DistillRecipe
from omniroll.models.shapes.text import TEXT_LENGTH, TextRecipe
from omniroll.models.shapes.vae import VaeRecipe


@dataclass(frozen=True)
class SamplingDefaults:
    """What the model samples with unless told otherwise (written to `omniroll_defaults.json`)."""

    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    shift: float = 3.0  # the scheduler's


@dataclass(frozen=True)
class ShapesRecipe:
    vae: VaeRecipe = field(default_factory=VaeRecipe)
    text: TextRecipe = field(default_factory=TextRecipe)
    dit: DitRecipe = field(default_factory=DitRecipe)
    distill: DistillRecipe = field(default_factory=DistillRecipe)  # steps 0: none (the shipped model is guided)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    category_weights: dict = field(default_factory=lambda: dict(CATEGORY_WEIGHTS))
    vae_data_seed: int = 10
    latent_data_seed: int = 11
    check_pictures: int = 1200  # VAE check: held-out pictures reconstructed and judged (the ceiling)
    eval_seeds: int = 4
    torch_threads: int = 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ShapesRecipe":
        def build(kind, values):
            known = {f.name: f for f in dataclasses.fields(kind)}
            bad = sorted(set(values) - set(known))
            if bad:
                raise ValueError(f"recipe: unknown {kind.__name__} field(s) {bad}; known: {sorted(known)}")
            return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

        parts = {"vae": VaeRecipe, "text": TextRecipe, "dit": DitRecipe, "distill": DistillRecipe,
                 "sampling": SamplingDefaults}
        top = {k: v for k, v in d.items() if k not in parts}
        out = build(cls, top)
        return dataclasses.replace(out, **{k: build(kind, d[k]) for k, kind in parts.items() if k in d})

    def sampling_defaults(self) -> dict:
        """`omniroll_defaults.json`: the config keys the model fixes (resolution, text length) or prefers (a
        guidance-distilled model samples CFG-free: guidance 1.0)."""
        s = self.sampling
        guidance = 1.0 if self.distill.steps > 0 else s.guidance_scale
        return {"pipeline": {"height": 64, "width": 64, "max_sequence_length": TEXT_LENGTH,
                             "num_inference_steps": s.num_inference_steps, "guidance_scale": guidance}}


SHIPPED = ShapesRecipe()
