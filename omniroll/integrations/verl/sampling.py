"""VeRL-Omni's sampling dict (its `rollout.pipeline.*` and `rollout.algo.*` fields, flattened, plus `logprobs`,
`global_steps` and `seed`) mapped to omniroll's `SamplingParams`.

- same name: `height`, `width`, `num_frames`, `num_inference_steps`, `max_sequence_length`, `true_cfg_scale`,
  `noise_level`, `sde_type`, `sde_window_size`, `sde_window_range`, `logprobs` (the model checks what it supports, e.g.
  `num_frames` > 1 for video models only); a window size without a range gets VeRL-Omni's SD3 default range (0, 5),
  capped at T - 1; `solver` (omniroll's `pipeline.solver`: euler or dpmpp_2m, the deterministic steps' solver);
- translated: `frame_rate` -> `fps` (rounded); `guidance_scale: null` -> 0.0 (no CFG); `output_type: image` -> `pixel`;
- `seed` -> the request's seed; absent (VeRL-Omni with `rollout.seed: null`): a fresh random seed;
- dropped: `global_steps` (a sample carries the weight version it was generated with), `video_flow_shift` and
  `aspect_ratio` (the model's scheduler config and `height` / `width` decide them), `sde_contiguous: true`,
  `sample_strategy: random`, `iters_per_group`, `sde_window_seed` (omniroll's windows are contiguous and drawn per
  sample from its seed), `temperature`, `top_k`, `top_p`, `n`, `do_sample` (LLM knobs of verl's `val_kwargs`);
- refused: `sde_contiguous: false`, `sample_strategy: progressive` (MixGRPO), and any other key.

Errors name the key. Dropped keys are named in the result (and logged once each).
"""

from __future__ import annotations

import logging
import numbers
import secrets
from typing import Any, Optional

from pydantic import ValidationError

from omniroll.engine.params import SamplingParams

logger = logging.getLogger(__name__)

SAME_NAME = ("height", "width", "num_frames", "num_inference_steps", "max_sequence_length", "guidance_scale",
             "true_cfg_scale", "output_type", "noise_level", "sde_type", "sde_window_size", "sde_window_range",
             "logprobs", "fps", "latent_seed", "solver", "noise_seeds")
DROPPED = ("global_steps", "video_flow_shift", "aspect_ratio",
           "sde_contiguous", "sample_strategy", "iters_per_group", "sde_window_seed",
           "temperature", "top_k", "top_p", "n", "do_sample")
OUTPUT_TYPES = {"image": "pixel", "pixel": "pixel", "latent": "latent", "both": "both"}
VERL_OMNI_WINDOW_RANGE = (0, 5)
_logged: set[str] = set()


def flatten(pipeline: Optional[dict] = None, algo: Optional[dict] = None) -> dict:
    """VeRL-Omni's config sections as the one flat dict its agent loop sends (underscore keys are config internals)."""
    out: dict[str, Any] = {}
    for section in (pipeline or {}, algo or {}):
        out.update({str(k): v for k, v in dict(section).items() if not str(k).startswith("_")})
    return out


def map_sampling_params(sampling: dict) -> tuple[dict, Optional[int], list[str]]:
    """VeRL-Omni's flat sampling dict -> (omniroll SamplingParams fields, seed or None, dropped keys).

    Raises ValueError naming the key for an unknown key, a value with no omniroll equivalent, or a bad value."""
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling_params must be a dict, got {type(sampling).__name__}")
    unknown = sorted(k for k in sampling if k not in SAME_NAME + DROPPED + ("seed", "frame_rate"))
    if unknown:
        raise ValueError(f"sampling_params: unknown key(s) {unknown}; omniroll understands {sorted(SAME_NAME)}, "
                         f"'seed', and drops {sorted(DROPPED)}")
    if sampling.get("sde_contiguous") is False:
        raise ValueError("sampling_params.sde_contiguous: false has no omniroll equivalent (windows are contiguous)")
    if sampling.get("sample_strategy") not in (None, "random"):
        raise ValueError(f"sampling_params.sample_strategy: {sampling['sample_strategy']!r} (MixGRPO) has no omniroll "
                         f"equivalent; only 'random' (a window drawn per sample) is supported")
    out = {k: sampling[k] for k in SAME_NAME if k in sampling}
    if sampling.get("frame_rate") is not None:
        out["fps"] = int(round(float(sampling["frame_rate"])))
    if "guidance_scale" in out and out["guidance_scale"] is None:
        out["guidance_scale"] = 0.0
    if "output_type" in out:
        if out["output_type"] not in OUTPUT_TYPES:
            raise ValueError(f"sampling_params.output_type must be one of {sorted(OUTPUT_TYPES)}, "
                             f"got {out['output_type']!r}")
        out["output_type"] = OUTPUT_TYPES[out["output_type"]]
    if out.get("sde_window_size") is not None and out.get("sde_window_range") is None:
        steps = int(out.get("num_inference_steps", SamplingParams.model_fields["num_inference_steps"].default))
        out["sde_window_range"] = (VERL_OMNI_WINDOW_RANGE[0], min(VERL_OMNI_WINDOW_RANGE[1], max(steps - 1, 1)))
    if out.get("sde_window_range") is not None:
        out["sde_window_range"] = tuple(int(v) for v in out["sde_window_range"])
    for k in ("height", "width", "num_frames", "num_inference_steps", "max_sequence_length"):
        if k in out and out[k] is not None:
            out[k] = int(out[k])
    try:
        SamplingParams.model_validate(out)
    except ValidationError as e:
        raise ValueError("sampling_params: " + "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<all>'}: {err['msg']}" for err in e.errors())) from None
    seed = sampling.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**63:
            raise ValueError(f"sampling_params.seed must be an int in [0, 2**63), got {seed!r}")
        seed = int(seed)
    dropped = sorted(k for k in sampling if k in DROPPED)
    for k in dropped:
        if k not in _logged and k != "global_steps":
            _logged.add(k)
            logger.info("omniroll drops VeRL-Omni sampling key %r (no meaning here)", k)
    return out, seed, dropped


def fresh_seed() -> int:
    return secrets.randbelow(2**63)
