"""`omniroll export --check`: an export, loaded by diffusers itself, against omniroll's engine with the checkpoint.

One picture on each side at the same prompt, seed and deterministic sampler (the ODE: noise level 0; the same steps,
CFG, size and text length; the same initial noise, drawn as the engine draws it, `make_generator(seed)`, and passed to
the diffusers pipeline as `latents=`). The reference is the engine as `omniroll eval` builds it (a LoRA through the
engine's `add_lora`, full weights copied in), fp32 on CPU with plain kernels (`batch_invariant=False`: diffusers'
own, so the engine itself adds no difference); the candidate is `DiffusionPipeline.from_pretrained(export)` for a
merged export, the base pipeline plus `load_lora_weights(export)` for a LoRA. The result: the largest absolute
difference of the final latents and of the uint8 pixels, and whether both are within `TOLERANCE` for that export.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the largest differences `--check` accepts (fp32 on CPU), per export: a LoRA file computes exactly what the
#: engine's LoRA computes (bitwise, measured); a merge rounds W + (alpha / r) B A once per weight, which moved the tiny
#: SD3's final latents by 1.2e-6 to 1.9e-6 in 4 steps (docs/export.md has the table); a LoRA at half its scale moved
#: them by 0.29.
TOLERANCE = {"lora": {"latent": 0.0, "pixel": 0}, "merged": {"latent": 1e-4, "pixel": 1}}
#: the family pipelines `--check` knows how to feed the same initial noise (their `latents=` is the engine's latent)
CHECKED_PIPELINES = ("StableDiffusion3Pipeline",)


@dataclass(frozen=True)
class CheckResult:
    export: str  # "lora" or "merged": which TOLERANCE applies
    latent_diff: float  # max |latent_engine - latent_diffusers|
    pixel_diff: int  # max |pixel_engine - pixel_diffusers|, uint8 levels
    prompt: str
    seed: int
    sampling: dict

    @property
    def passed(self) -> bool:
        tol = TOLERANCE[self.export]
        return self.latent_diff <= tol["latent"] and self.pixel_diff <= tol["pixel"]

    def line(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        s, tol = self.sampling, TOLERANCE[self.export]
        return (f"check {verdict} ({self.export} export vs the engine): max |latent diff| {self.latent_diff:.3g} "
                f"(tolerance {tol['latent']:g}), max |pixel diff| {self.pixel_diff} (tolerance {tol['pixel']}) of "
                f"255; prompt "
                f"{self.prompt!r}, seed {self.seed}, {s['height']}x{s['width']}, {s['num_inference_steps']} ODE steps, "
                f"guidance {s['guidance_scale']}")


def check_sampling(source) -> tuple[str, int, dict]:
    """The check's prompt, seed and sampling: the run's first validation prompt (else its first prompt), seed
    `val_kwargs.seed`, the run's validation sampling made deterministic (noise level 0, the ODE)."""
    from omniroll.config import load_config
    from omniroll.train.checkpoint import read_trainer_state

    raw = read_trainer_state(source.checkpoint, flag="CKPT").get("config") or {}
    cfg = load_config(raw, overrides=[f"engine.model={source.model_dir}"])
    sp = cfg.sampling_params(validate=True)
    sampling = {k: sp[k] for k in ("height", "width", "num_inference_steps", "guidance_scale",
                                   "max_sequence_length")}
    prompts = [*cfg.trainer.val_prompts, *(cfg.trainer.prompts or [])] if cfg.trainer is not None else []
    return (prompts[0] if prompts else "a photo of a cat"), int(cfg.val_kwargs.seed), sampling


def require_checkable(source, dtype: str = "float32") -> tuple[str, int, dict]:
    """The check's (prompt, seed, sampling) (`check_sampling`); ValueError naming --check when `check_export` cannot
    compare this export: a family it cannot feed the same noise, a dtype other than float32 (its tolerances are
    fp32's), or a run config it cannot read the sampling from."""
    if source.pipeline_class not in CHECKED_PIPELINES:
        raise ValueError(f"--check: {source.pipeline_class} is not checked yet (supported: {list(CHECKED_PIPELINES)}); "
                         f"export without --check")
    if dtype != "float32":
        raise ValueError(f"--check compares float32 exports (its tolerances are fp32's: bitwise, or a merge's "
                         f"rounding), got --dtype {dtype}; export without --check")
    try:
        return check_sampling(source)
    except ValueError as e:
        raise ValueError(f"--check: cannot read the run's sampling from {source.checkpoint}/trainer_state.pt: "
                         f"{(str(e).splitlines() or [''])[0]}") from None


def check_export(source, export_dir: str, merged: bool) -> CheckResult:
    """Generate once with the engine and once with diffusers from `export_dir`; compare (fp32, CPU)."""
    import torch

    from omniroll import GenerationRequest, SamplingParams
    from omniroll.engine.config import EngineConfig
    from omniroll.engine.engine import DiffusionEngine
    from omniroll.engine.output_assembly import quantize_pixels
    from omniroll.evaluation.checkpoints import add_lora_checkpoint, load_full_weights
    from omniroll.models import load_adapter
    from omniroll.models.base import load_pipeline
    from omniroll.sampling import make_generator

    prompt, seed, sampling = require_checkable(source)
    adapter = load_adapter(source.model_dir)
    if source.kind == "full":
        load_full_weights(adapter, source.checkpoint)
    engine = DiffusionEngine(adapter, EngineConfig(device="cpu", dtype=torch.float32, batch_invariant=False))
    try:
        if source.kind == "lora":
            add_lora_checkpoint(engine, source.checkpoint)
        params = SamplingParams(**sampling, noise_level=0.0, sde_type="ode", logprobs=False, output_type="both")
        ref = engine.generate([GenerationRequest(request_id="export-check", prompt=prompt, seed=seed,
                                                 sampling_params=params)])[0]
        init = torch.randn(adapter.latent_shape(sampling["height"], sampling["width"]),
                           generator=make_generator(seed), dtype=torch.float32)[None]
    finally:
        engine.shutdown()
    del adapter
    if merged:
        pipe = load_pipeline(source.pipeline_class, export_dir)
    else:
        pipe = load_pipeline(source.pipeline_class, source.model_dir)
        pipe.load_lora_weights(export_dir)
    with torch.no_grad():
        latents = pipe(prompt=prompt, latents=init, output_type="latent", **sampling).images
        vae = pipe.vae
        pixels = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    latent_diff = (ref.extra_fields["latents"] - latents[0].float()).abs().max().item()
    pixel_diff = (ref.diffusion_output.int() - quantize_pixels(pixels[0]).int()).abs().max().item()
    return CheckResult("merged" if merged else "lora", latent_diff, int(pixel_diff), prompt, seed, sampling)


__all__ = ["CHECKED_PIPELINES", "CheckResult", "TOLERANCE", "check_export", "check_sampling", "require_checkable"]
