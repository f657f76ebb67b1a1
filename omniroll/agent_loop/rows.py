"""Per-row sampling parameters, and which rows can share one output batch.

Every row of a batch is generated with the batch's sampling parameters (config, then `meta_info["sampling_params"]`)
plus its own `sampling_params` override. Its outputs are stacked into one tensor per field, so rows that would give
another shape (height, width, the number of recorded SDE steps), another set of fields (CFG on or off: the
`negative_*` embeddings; log-probs on or off) or another kind of response (`output_type`) cannot share the batch.
Such rows are found here, from the parameters alone, before anything is generated.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError

from omniroll.engine.params import SamplingParams, overlay_sampling
from omniroll.errors import format_validation_error

#: output-shaping quantity -> (the sampling field a user changes, why it matters)
_STACKED = {
    "height": ("height", "responses and latents are stacked"),
    "width": ("width", "responses and latents are stacked"),
    "recorded_steps": ("sde_window_size", "all_latents, log-probs and sigmas hold one entry per recorded SDE step; "
                                          "without sde_window_size that is num_inference_steps - 1"),
    "cfg": ("guidance_scale", "CFG on (> 1) or off (<= 1) adds or drops the negative_* embedding fields"),
    "logprobs": ("logprobs", "rollout_log_probs is one tensor for the batch"),
    "output_type": ("output_type", "responses are pixels or latents for the whole batch"),
}


def base_sampling(config: Any, meta: dict, validate: bool) -> dict:
    """The batch's sampling dict: the config's (training or validation), then `meta_info["sampling_params"]`.
    Raises ValueError naming the field when it is not valid."""
    sp = overlay_sampling(config.sampling_params(validate=validate), meta.get("sampling_params") or None, validate,
                          name="meta_info['sampling_params']")
    try:
        SamplingParams.model_validate(sp)
    except ValidationError as e:
        raise ValueError("bad sampling params: " + format_validation_error(
            e, "meta_info.sampling_params", with_input=False, empty_loc="meta_info.sampling_params")) from None
    return sp


def row_sampling(base_sp: dict, override: Any, validate: bool) -> dict:
    """One row's sampling dict: the batch's plus the row's override (validation keeps log-probs off)."""
    return overlay_sampling(base_sp, override, validate)


def output_signature(sp: dict) -> Optional[dict]:
    """What of a row's output must match its batch mates' (None when the parameters are invalid: that row fails
    on its own, with the validation error)."""
    try:
        p = SamplingParams.model_validate(sp)
    except ValidationError:
        return None
    lo, hi = p.window_range()
    # CFG rows carry negative-prompt embeddings; which scale adds them depends on the family (FLUX: true_cfg_scale),
    # so rows must agree on both
    return {"num_frames": p.num_frames, "height": p.height, "width": p.width,
            "recorded_steps": p.sde_window_size if p.sde_window_size is not None else hi - lo,
            "cfg": p.guidance_scale > 1.0, "true_cfg": p.true_cfg_scale > 1.0, "logprobs": p.logprobs,
            "output_type": p.output_type}


def rows_that_cannot_share(base_sp: dict, overrides: list[Any], validate: bool) -> dict[int, str]:
    """Rows (index -> reason) whose override gives an output that cannot be stacked with the batch's: compared with
    the batch's own sampling parameters, so every chunk of a batch decides the same way."""
    ref = output_signature(base_sp)
    bad: dict[int, str] = {}
    for r, override in enumerate(overrides):
        if override is None or ref is None:
            continue
        try:
            sig = output_signature(row_sampling(base_sp, override, validate))
        except ValueError:
            continue  # a malformed override fails its row on its own
        if sig is None:
            continue
        diffs = [k for k in _STACKED if sig[k] != ref[k]]
        if diffs:
            why = "; ".join(
                f"sampling_params.{_STACKED[k][0]} gives {k}={sig[k]!r} where the batch has {ref[k]!r} "
                f"({_STACKED[k][1]})" for k in diffs)
            bad[r] = (f"cannot share the output batch: {why}. Rows of one batch must agree on these; set them "
                      f"for the whole batch in meta_info['sampling_params'] (nothing was generated for this row)")
    return bad
