"""Row planning: what each row of an agent-loop batch is before anything generates: its uid (prompt group), its index
in the group, its seed, its request id and its sampling parameters (`plan_rows`), and whether it can share the output
batch (`rows_that_cannot_share`).

Input per row (non_tensor_batch): `raw_prompt` (required), `raw_negative_prompt`, `uid` (the prompt group; default: a
hash of the prompt), `data_source`, `agent_name`, `reward_model` ({"ground_truth"}), `extra_info`, `sampling_params`
(a per-row override dict), `_group_index` (set by the manager). meta_info: `global_steps` (required for training),
`rollout_seed`, `validate`, `sampling_params` (batch-level override).

Seeds: `derive_seed(rollout_seed, global_steps, uid, index)` where index is the row's position within its group (the
manager's `_group_index`, else the trainer's `_rollout_seed_global_idx % n`, else the order of appearance of the uid in
this batch; see `group_index_column`), so a sample's seed never depends on how the batch was chunked. Validation:
`derive_seed(val_kwargs.seed, 0, uid, index)` (the same images at every step), or `val_kwargs.seed` itself for every
row with `val_kwargs.seed_mode: shared` (VeRL-Omni's semantics); ODE (noise_level 0) and no log-probs. With
`algo.same_latent` a training row also gets `latent_seed = derive_group_seed(rollout_seed, global_steps, uid)`: the
group shares its initial noise and window. With `algo.tree` too, and the row is leaf `index` of its group's tree
(`tree_fields`): its seed is the root's noise seed, its `noise_seeds` its nodes' and `tree_path` its position.

`plan_batch` does all of it once per batch (a `RowPlan`): the manager plans the whole batch and hands each worker its
part (`RowPlan.part`); a worker called directly (verl's manager) plans its own batch.

Sampling parameters: every row of a batch is generated with the batch's sampling parameters (config, then
`meta_info["sampling_params"]`, `base_sampling`) plus its own `sampling_params` override (`row_sampling`). Its outputs
are stacked into one tensor per field, so rows that would give another shape (height, width, the number of recorded
SDE steps), another set of fields (CFG on or off: the `negative_*` embeddings; log-probs on or off) or another kind of
response (`output_type`) cannot share the batch. Such rows are found from the parameters alone, before anything is
generated (`rows_that_cannot_share`; the manager asks the same for the whole batch before splitting it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from pydantic import ValidationError

from omniroll.agent_loop.batch import DataBatch
from omniroll.config import OmniRollConfig, load_config
from omniroll.engine.params import SamplingParams, overlay_sampling, unencodable_reason
from omniroll.errors import format_validation_error
from omniroll.engine.tree import TreeSpec, check_tree
from omniroll.sampling.seeds import derive_group_seed, derive_seed, derive_tree_seed


def as_config(config: Any) -> OmniRollConfig:
    return config if isinstance(config, OmniRollConfig) else load_config(config)


def group_indices(uids: list[str]) -> list[int]:
    """Position of each row within its uid group, by order of appearance."""
    seen: dict[str, int] = {}
    out = []
    for u in uids:
        out.append(seen.get(u, 0))
        seen[u] = out[-1] + 1
    return out


def group_index_column(non_tensor_batch: dict, uids: list[str], n: int) -> list[int]:
    """Each row's index within its prompt group: `_group_index` when given; else from the trainer's global row index
    `_rollout_seed_global_idx` (VeRL-Omni: an arange over the batch after its n-fold interleaved repeat, so the
    index is `global % n`), which holds however the batch was chunked; else the order of appearance of the uid in
    THIS batch (right only for a whole batch, which is what omniroll's AgentLoopManager hands out)."""
    for key in ("_group_index", "_rollout_seed_global_idx"):
        if key in non_tensor_batch:
            values = [_batch_int(v, f"non_tensor_batch[{key!r}] of row {r}")
                      for r, v in enumerate(non_tensor_batch[key])]
            return values if key == "_group_index" else [g % n for g in values]
    return group_indices(uids)


def _batch_int(value: Any, what: str) -> int:
    """`value` as an int >= 0 (Python or numpy integer; a bool, float or string is refused, never coerced)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r} ({type(value).__name__})")
    return int(value)


def default_uid(raw_prompt: Any) -> str:
    return "prompt-" + hashlib.sha256(repr(raw_prompt).encode("utf-8")).hexdigest()[:16]


def row_uids(non_tensor_batch: dict, n: int) -> list[str]:
    """Each row's prompt group: `uid` as a string, or `default_uid(raw_prompt)` where missing. The one place that
    requires `raw_prompt` and defaults `uid` (the manager and every worker call it)."""
    if "raw_prompt" not in non_tensor_batch:
        raise ValueError(f"input batch has no non_tensor_batch['raw_prompt'] (fields: {sorted(non_tensor_batch)})")
    uids = [str(u) if u is not None else default_uid(p)
            for u, p in zip(non_tensor_batch.get("uid", [None] * n), non_tensor_batch["raw_prompt"])]
    for r, u in enumerate(uids):
        reason = unencodable_reason(u)
        if reason is not None:
            raise ValueError(f"non_tensor_batch['uid'] of row {r} {reason}")
    return uids


def plan_rows(config: OmniRollConfig, batch: DataBatch) -> list[dict]:
    """Per-row fields for the agent loop (uid, group index, seed, request_id, ...). Batch-level input errors raise
    ValueError naming the field."""
    nt, meta = batch.non_tensor_batch, batch.meta_info
    n = len(batch)
    uids = row_uids(nt, n)
    validate = bool(meta.get("validate", False))
    steps = meta.get("global_steps")
    if steps is None:
        if not validate:
            raise ValueError("meta_info['global_steps'] is required for training batches (it seeds the samples)")
        steps = 0
    steps = _batch_int(steps, "meta_info['global_steps']")
    if meta.get("rollout_seed") is not None:
        _batch_int(meta["rollout_seed"], "meta_info['rollout_seed']")
    group_size = config.val_kwargs.n if validate else config.n
    idx = group_index_column(nt, uids, group_size)
    seen: dict[tuple, int] = {}
    for r, key in enumerate(zip(uids, idx)):
        if key in seen:
            raise ValueError(f"rows {seen[key]} and {r} have the same (uid, _group_index) {key}: each sample of a "
                             f"group needs its own index (with _rollout_seed_global_idx the index is global % n, "
                             f"n = {group_size}: is n the batch's repeat count?)")
        seen[key] = r
    shared_val_seed = validate and config.val_kwargs.seed_mode == "shared"
    if validate:
        base, step_for_seed, tag = config.val_kwargs.seed, 0, "val"
    else:
        base = meta.get("rollout_seed", config.seed)
        step_for_seed, tag = int(steps), "train"
    rows = []
    for r in range(n):
        fields = {k: v[r] for k, v in nt.items()}
        seed = int(base) if shared_val_seed else derive_seed(base, step_for_seed, uids[r], idx[r])
        fields.update(uid=uids[r], _group_index=idx[r], seed=seed, request_id=f"{tag}/s{steps}/{uids[r]}/{idx[r]}")
        if (config.algo.same_latent or config.algo.tree is not None) and not validate:
            fields["latent_seed"] = derive_group_seed(base, step_for_seed, uids[r])
        if config.algo.tree is not None and not validate:
            fields.update(tree_fields(config.algo.tree, base, step_for_seed, uids[r], idx[r], r))
        rows.append(fields)
    return rows


def tree_fields(tree: TreeSpec, base: Any, step: int, uid: str, index: int, row: int) -> dict:
    """A training row's place in its group's tree (`algo.tree`): leaf `index` is the tree's `index`-th path; its
    `seed` is the root's noise seed and `noise_seeds` its nodes' (`derive_tree_seed`), `tree_path` its position."""
    paths = tree.leaf_paths()
    if index >= len(paths):
        raise ValueError(f"row {row}: group index {index} is not a leaf of algo.tree ({len(paths)} leaves, widths "
                         f"{list(tree.widths)})")
    path = paths[index]
    node_seed = lambda p: derive_tree_seed(base, step, uid, p)  # noqa: E731
    return {"seed": node_seed(()), "noise_seeds": tree.noise_seeds(path, node_seed), "tree_path": list(path)}


@dataclass
class RowPlan:
    """A batch as planned once: each row's fields (`plan_rows`), the batch's sampling dict (`base_sampling`), whether
    it is a validation batch, and the rows that cannot share its output batch (index -> reason)."""

    rows: list[dict]
    base_sampling: dict
    validate: bool
    rejected: dict[int, str]

    def part(self, start: int, stop: int) -> "RowPlan":
        """The plan of rows [start, stop) (a chunk of the batch), row numbers from 0."""
        return RowPlan(self.rows[start:stop], self.base_sampling, self.validate,
                       {i - start: why for i, why in self.rejected.items() if start <= i < stop})


def plan_batch(config: OmniRollConfig, batch: DataBatch, rows: Optional[list[dict]] = None) -> RowPlan:
    """Plan `batch` (`rows`: already planned, e.g. re-seeded by a worker subclass; default `plan_rows`). Batch-level
    input errors raise ValueError naming the field."""
    validate = bool(batch.meta_info.get("validate", False))
    rows = plan_rows(config, batch) if rows is None else rows
    base = base_sampling(config, batch.meta_info, validate)
    if config.algo.tree is not None and not validate:  # meta_info's sampling may move the schedule or the window
        check_tree(config.algo.tree, SamplingParams.model_validate(base), config.n, "algo.tree")
    rejected = rows_that_cannot_share(base, [f.get("sampling_params") for f in rows], validate)
    return RowPlan(rows, base, validate, rejected)


def failed_entries(rows: list[dict], errors: dict[int, str]) -> list[dict]:
    """`AgentLoopError.failed_rows` entries for these rows (index -> error)."""
    return [{"row": i, "uid": rows[i]["uid"], "request_id": rows[i]["request_id"], "error": e}
            for i, e in sorted(errors.items())]


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
    Raises ValueError naming the field when it is not valid, or when the model cannot take it (`model_problems`),
    before any request of the batch is sent."""
    override = meta.get("sampling_params") or None
    sp = overlay_sampling(config.sampling_params(validate=validate), override, validate,
                          name="meta_info['sampling_params']")
    try:
        p = SamplingParams.model_validate(sp)
    except ValidationError as e:
        raise ValueError("bad sampling params: " + format_validation_error(
            e, "meta_info.sampling_params", with_input=False, empty_loc="meta_info.sampling_params")) from None
    problems = model_problems(config.engine.model, p, set(override or ()), prefix="meta_info['sampling_params'].")
    if problems:
        raise ValueError("bad sampling params for the model: " + "; ".join(problems) + " (nothing was sent)")
    return sp


def model_problems(model: str, params: SamplingParams, fields: set[str], prefix: str) -> list[str]:
    """What of `fields` (resolution, text length) `model` cannot take, by the engine's own check (`ModelLimits`,
    read from the checkpoint's config files, no weights): the config's own values were checked when it loaded. Empty
    when the model's files cannot say here (an agent-loop worker on a node without the checkpoint): then the engine
    refuses such rows itself."""
    wanted = {k: getattr(params, k) if k in fields else None for k in ("height", "width", "max_sequence_length")}
    if not any(v is not None for v in wanted.values()):
        return []
    from omniroll.models import model_limits

    try:
        limits = model_limits(model)
    except (OSError, ValueError):
        return []
    return [] if limits is None else limits.problems(**wanted, prefix=prefix)


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
