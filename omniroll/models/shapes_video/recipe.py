"""The recipe of the shapes-video model: every setting of `omniroll pretrain shapes-video`, one JSON-able object
written beside the checkpoint it made (`recipe.json`) and into the resume directory (a rerun must use the same one).
`FULL` is the recipe `make shapes-video-model` runs; `TOY` a few steps of tiny parts (tests, smoke runs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from omniroll.models.shapes_video.dit import VideoDitRecipe
from omniroll.models.shapes_video.text import ENCODERS, TEXT_LENGTH, VideoTextRecipe
from omniroll.models.shapes_video.vae import VideoVaeRecipe
from omniroll.tasks.moving_shapes.scene import TWO_MOTIONS_LAYOUTS
from omniroll.tasks.moving_shapes.world import DEFAULT_MOVING_WORLD


@dataclass(frozen=True)
class VideoSamplingDefaults:
    """What the model samples with unless told otherwise (written to `omniroll_defaults.json`)."""

    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    shift: float = 3.0  # the scheduler's


@dataclass(frozen=True)
class ShapesVideoRecipe:
    vae: VideoVaeRecipe = field(default_factory=VideoVaeRecipe)
    text: VideoTextRecipe = field(default_factory=VideoTextRecipe)
    dit: VideoDitRecipe = field(default_factory=VideoDitRecipe)
    sampling: VideoSamplingDefaults = field(default_factory=VideoSamplingDefaults)
    category_weights: dict = field(default_factory=lambda: {"direction": 1.0, "two_motions": 1.0, "order": 1.0,
                                                            "change": 1.0})
    frames: int = DEFAULT_MOVING_WORLD.frames  # the world's; recorded, not a knob
    size: int = DEFAULT_MOVING_WORLD.picture.size
    vae_data_seed: int = 10
    latent_data_seed: int = 11
    #: where the transformer's two-motion training clips put their objects (`moving_shapes.scene`'s layouts; the VAE's
    #: clips always "any", so `--vae-from` takes a VAE whatever this is)
    two_motions_layout: str = "any"
    check_seed: int = 12
    check_clips: int = 240  # VAE check: held-out clips reconstructed and judged (the ceiling)
    resume_every: int = 100  # steps between saves of a phase's state to <out>/resume/
    torch_threads: int = 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ShapesVideoRecipe":
        def build(kind, values):
            known = {f.name: f for f in dataclasses.fields(kind)}
            bad = sorted(set(values) - set(known))
            if bad:
                raise ValueError(f"recipe: unknown {kind.__name__} field(s) {bad}; known: {sorted(known)}")
            return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

        parts = {"vae": VideoVaeRecipe, "text": VideoTextRecipe, "dit": VideoDitRecipe,
                 "sampling": VideoSamplingDefaults}
        d = {**d, "text": {"encoder": "umt5", **d.get("text", {})}}  # written before the BERT: the UMT5's
        out = build(cls, {k: v for k, v in d.items() if k not in parts})
        out = dataclasses.replace(out, **{k: build(kind, d[k]) for k, kind in parts.items() if k in d})
        out.check()
        return out

    def check(self) -> None:
        """ValueError naming the field when the recipe cannot run (before any work)."""
        world = DEFAULT_MOVING_WORLD
        if (self.frames, self.size) != (world.frames, world.picture.size):
            raise ValueError(f"frames / size: the moving-shapes world's clips are {world.frames} frames of "
                             f"{world.picture.size} px, got {self.frames} / {self.size}")
        for name, value, least in (("vae.image_steps", self.vae.image_steps, 0),
                                   ("vae.clip_steps", self.vae.clip_steps, 0),
                                   ("vae.foreground_steps", self.vae.foreground_steps, 0),
                                   ("dit.steps", self.dit.steps, 1),
                                   ("dit.num_latents", self.dit.num_latents, 1), ("check_clips", self.check_clips, 1),
                                   ("resume_every", self.resume_every, 1), ("torch_threads", self.torch_threads, 1)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if not isinstance(self.vae.foreground_weight, (int, float)) or not self.vae.foreground_weight >= 1.0:
            raise ValueError(f"vae.foreground_weight must be a number >= 1.0, got {self.vae.foreground_weight!r}")
        threshold = self.vae.foreground_threshold
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 2.0:
            raise ValueError(f"vae.foreground_threshold must be a number in [0, 2), got "
                             f"{self.vae.foreground_threshold!r}")
        if self.two_motions_layout not in TWO_MOTIONS_LAYOUTS:
            raise ValueError(f"two_motions_layout must be one of {list(TWO_MOTIONS_LAYOUTS)}, got "
                             f"{self.two_motions_layout!r}")
        if self.text.encoder not in ENCODERS:
            raise ValueError(f"text.encoder must be one of {list(ENCODERS)}, got {self.text.encoder!r}")
        heads = self.text.num_heads
        if not isinstance(heads, int) or heads < 1 or self.text.d_model % heads:
            raise ValueError(f"text.num_heads must be an int >= 1 dividing text.d_model = {self.text.d_model}, got "
                             f"{self.text.num_heads!r}")
        if (self.frames - 1) % self.vae.scale_factor_temporal:
            raise ValueError(f"vae.temporal_downsample: {self.frames} frames need a temporal factor dividing "
                             f"{self.frames - 1}, got {self.vae.scale_factor_temporal}")

    def sampling_defaults(self) -> dict:
        """`omniroll_defaults.json`: the config keys the model fixes (clip size, frames, text length) or prefers, and
        its task world (what `omniroll eval` judges it with: `omniroll.models.checkpoint.read_task`)."""
        s = self.sampling
        pipeline = {"height": self.size, "width": self.size, "num_frames": self.frames,
                    "max_sequence_length": TEXT_LENGTH, "num_inference_steps": s.num_inference_steps,
                    "guidance_scale": s.guidance_scale}
        return {"task": "moving_shapes", "pipeline": pipeline}


#: the shipped model's recipe: each two-motion training clip draws its first-named object on the left (with the
#: world's own layout the transformer drew 2.5 % of held-out two-motion clips right; with this one, 22.5 %)
FULL = ShapesVideoRecipe(two_motions_layout="first_left")

#: a few steps of tiny parts: the whole pipeline in about a minute on 2 cores (tests, smoke runs)
TOY = ShapesVideoRecipe(
    vae=VideoVaeRecipe(base_dim=4, z_dim=4, image_steps=2, clip_steps=2, foreground_steps=2, image_batch=2,
                       clip_batch=1, warmup_steps=1),
    text=VideoTextRecipe(d_model=16, num_layers=1, num_heads=2, d_ff=16),
    dit=VideoDitRecipe(num_layers=1, num_heads=2, head_dim=12, ffn_dim=32, freq_dim=16, steps=4, batch_size=2,
                       warmup_steps=1, num_latents=4),
    check_clips=4, resume_every=1)
