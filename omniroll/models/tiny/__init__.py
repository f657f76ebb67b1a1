"""Deterministic random checkpoints of every supported family, built offline (tests, demos, benchmarks).

`build_tiny(family, path, seed=0)` writes a directory laid out like the family's real diffusers repo (so the
family's pipeline `from_pretrained(path)` loads it): random fp32 weights drawn from `seed`, tokenizers trained in
memory on a built-in word list, configs sized after diffusers' own pipeline tests. Same seed, same files; a
complete build is reused (marker file), concurrent builders wait on a lock. One file per family:

    sd3         Stable Diffusion 3 / 3.5 (`build_tiny_sd3`, with presets and overrides)
    flux        FLUX.1 (guidance-distilled)
    qwen-image  Qwen-Image (Qwen2.5-VL text encoder)
    wan         Wan 2.1 text-to-video
    wan2.2      Wan 2.2 A14B (two transformers switched at boundary_ratio)
"""

from __future__ import annotations

from omniroll.models.tiny._common import CLIP_MAX_LENGTH, MARKER_FILE
from omniroll.models.tiny.flux import build_tiny_flux
from omniroll.models.tiny.qwen_image import build_tiny_qwen_image
from omniroll.models.tiny.sd3 import PRESETS, build_tiny_sd3, resolve_config
from omniroll.models.tiny.wan import build_tiny_wan, build_tiny_wan22

#: family name -> the limits its tiny checkpoint's files state (`read_limits`), known without building it (a test
#: checks them against the built checkpoints), so validating a config that names a tiny model builds nothing.
TINY_LIMITS = {
    "sd3": (16, 1024, 512),
    "flux": (4, None, 512),
    "qwen-image": (8, None, 512),
    "wan": (16, None, 512),
    "wan2.2": (16, None, 512),
}

#: family name -> builder(path, seed) -> path
BUILDERS = {
    "sd3": build_tiny_sd3,
    "flux": build_tiny_flux,
    "qwen-image": build_tiny_qwen_image,
    "wan": build_tiny_wan,
    "wan2.2": build_tiny_wan22,
}
FAMILIES = tuple(BUILDERS)


def build_tiny(family: str, path: str, seed: int = 0) -> str:
    """Build (once) the tiny random checkpoint of `family` under `path`; returns `path`."""
    if family not in BUILDERS:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    return BUILDERS[family](path, seed=seed)


__all__ = ["BUILDERS", "CLIP_MAX_LENGTH", "FAMILIES", "MARKER_FILE", "PRESETS", "build_tiny", "build_tiny_sd3",
           "resolve_config"]
