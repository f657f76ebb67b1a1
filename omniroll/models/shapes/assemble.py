"""Putting the shapes model together: the trained VAE and transformer, the text stack and SD3's scheduler as a
`StableDiffusion3Pipeline` (in memory, or saved as a diffusers checkpoint directory that `--model` loads).

The directory also carries `omniroll_defaults.json`: the sampling settings the model was trained for (its resolution
and text length, which are also its limits, and the steps, guidance and shift it was evaluated with). omniroll reads
them as the defaults of every sampling key the user does not set.
"""

from __future__ import annotations

import json
import os

DEFAULTS_FILE = "omniroll_defaults.json"


def assemble_pipeline(transformer, vae, text: dict, shift: float):
    """A `StableDiffusion3Pipeline` of the given modules and a `FlowMatchEulerDiscreteScheduler(shift=shift)`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=transformer.eval(), vae=vae.eval(), scheduler=FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=shift), **text)


def save_checkpoint(pipeline, path: str, defaults: dict) -> str:
    """Write `pipeline` (fp32 safetensors) and its sampling `defaults` to `path`; returns `path`."""
    os.makedirs(path, exist_ok=True)
    pipeline.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, DEFAULTS_FILE), "w") as f:
        json.dump(defaults, f, indent=2, sort_keys=True)
        f.write("\n")
    return path
