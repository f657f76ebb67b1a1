"""`DiffusionAgentLoopWorker`: plans every row of a batch (uid, group index, seed, request id, sampling parameters,
whether it can share the output batch), runs each row as its own asyncio task in its agent loop, streams finished
samples to reward workers, and stacks the results (`loop.assemble`).

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
group shares its initial noise and window.

Failures: a row that fails (bad input, generation failed after the client's retries, reward status "failed") never
disappears: by default the worker raises ONE `AgentLoopError` listing every failed row and carrying the rows that
succeeded (`error.batch`, assembled as usual, and `error.succeeded_rows`), so a caller can keep them; with
`agent.on_failure: mark` it returns the batch with those rows marked (status "failed", zero tensors, `failed` mask,
`error` column). Rows whose override cannot share the output batch (another height, width, number of recorded SDE
steps, CFG on/off, log-probs on/off, output_type: see below) are refused before anything is generated: in raise
mode the whole call fails at once, naming each such row and field; in mark mode only they are marked failed.

Sampling parameters: every row of a batch is generated with the batch's sampling parameters (config, then
`meta_info["sampling_params"]`, `base_sampling`) plus its own `sampling_params` override (`row_sampling`). Its outputs
are stacked into one tensor per field, so rows that would give another shape (height, width, the number of recorded
SDE steps), another set of fields (CFG on or off: the `negative_*` embeddings; log-probs on or off) or another kind of
response (`output_type`) cannot share the batch. Such rows are found from the parameters alone, before anything is
generated (`rows_that_cannot_share`; the manager asks the same for the whole batch before splitting it).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Optional

import numpy as np
from pydantic import ValidationError

from omniroll.agent_loop.batch import DataBatch, to_object_array
from omniroll.agent_loop.loop import RowResult, assemble, embed_length_error, get_agent_loop_class, prompt_text
from omniroll.config import OmniRollConfig, load_config
from omniroll.engine.params import SamplingParams, overlay_sampling, unencodable_reason
from omniroll.errors import format_validation_error
from omniroll.sampling.seeds import derive_group_seed, derive_seed


class AgentLoopError(RuntimeError):
    """One or more rows failed. `failed_rows`: [{"row", "uid", "request_id", "error"}, ...]; `batch`: the rows that
    succeeded, assembled like a normal output (a DataBatch in input order; None when none did); `succeeded_rows`:
    their row numbers in the input batch. All three survive pickling (e.g. across Ray)."""

    def __init__(self, message: str, failed_rows: Optional[list] = None, batch: Optional[DataBatch] = None,
                 succeeded_rows: Optional[list[int]] = None):
        super().__init__(message, failed_rows or [], batch, list(succeeded_rows or []))
        self.message, self.failed_rows = message, failed_rows or []
        self.batch, self.succeeded_rows = batch, list(succeeded_rows or [])

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_rows(cls, failed_rows: list[dict], total: int, batch: Optional[DataBatch] = None,
                  succeeded_rows: Optional[list[int]] = None, note: str = "") -> "AgentLoopError":
        lines = "\n".join(f"  row {f['row']} (uid={f['uid']!r}, request_id={f['request_id']!r}): {f['error']}"
                          for f in failed_rows)
        kept = (f"\n{len(batch)} row(s) succeeded: AgentLoopError.batch holds them (rows {succeeded_rows})"
                if batch is not None and len(batch) else "")
        return cls(f"{len(failed_rows)} of {total} rows failed{note}:\n{lines}{kept}", failed_rows, batch,
                   succeeded_rows)


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
        if config.algo.same_latent and not validate:
            fields["latent_seed"] = derive_group_seed(base, step_for_seed, uids[r])
        rows.append(fields)
    return rows


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


class DiffusionAgentLoopWorker:
    """Diffusion agent loop worker: takes a batch of prompts and runs each row in an agent loop.

    config: the whole config (OmniRollConfig, dict or DictConfig). llm_client: a `RolloutClient` (or a list of replica
    handles, wrapped in one). teacher_client: unused (kept for verl's signature). reward_loop_worker_handles: reward
    workers (Ray handles or in-process `RewardLoopWorker`s) for streaming scoring.
    """

    def __init__(self, config: Any, llm_client: Any, teacher_client: Optional[dict] = None,
                 reward_loop_worker_handles: Optional[list] = None):
        self.config = as_config(config)
        if isinstance(llm_client, (list, tuple)):
            from omniroll.rollout.client import RolloutClient

            llm_client = RolloutClient(llm_client, timeout_s=self.config.timeout_s,
                                       max_retries=self.config.max_retries)
        self.client = llm_client
        self.teacher_client = teacher_client
        self.reward_pool = None
        if reward_loop_worker_handles:
            from omniroll.reward import RewardWorkerPool

            self.reward_pool = RewardWorkerPool(reward_loop_worker_handles)
        self._loops: dict[str, Any] = {}

    def _agent_loop(self, name: str) -> Any:
        loop = self._loops.get(name)
        if loop is None:  # built once per worker per agent name, never per sample
            cls = get_agent_loop_class(name)
            loop = cls(trainer_config=self.config, server_manager=self.client, tokenizer=None, processor=None,
                       dataset_cls=None, data_config=None)
            self._loops[name] = loop
        return loop

    def plan(self, batch: DataBatch) -> list[dict]:
        return plan_rows(self.config, batch)

    async def generate_sequences(self, batch: DataBatch) -> DataBatch:
        """Generate one sample per row. Returns the output batch described in `loop.py` (`assemble`)."""
        t0 = time.perf_counter()
        rerun = int(batch.meta_info.get("_rerun", 0))  # the manager re-runs a lost worker's chunk (see manager.py)
        if rerun:
            batch = DataBatch(batch.batch, batch.non_tensor_batch,
                              {k: v for k, v in batch.meta_info.items() if k != "_rerun"}, len(batch))
        validate = bool(batch.meta_info.get("validate", False))
        base_sp = base_sampling(self.config, batch.meta_info, validate)
        rows = self.plan(batch)
        mark = self.config.agent.on_failure == "mark"
        rejected = rows_that_cannot_share(base_sp, [f.get("sampling_params") for f in rows], validate)
        if rejected and not mark:
            raise AgentLoopError.from_rows(failed_entries(rows, rejected), len(rows),
                                           note=" before generation (nothing was generated)")
        tasks = {i: asyncio.create_task(self._run_row(i, f, base_sp, validate, rerun))
                 for i, f in enumerate(rows) if i not in rejected}
        try:
            done = dict(zip(tasks, await asyncio.gather(*tasks.values())))
        except BaseException:
            for t in tasks.values():
                t.cancel()
            raise
        results: list[RowResult] = [
            done[i] if i in done else RowResult(index=i, request_id=f["request_id"], seed=f["seed"], error=rejected[i])
            for i, f in enumerate(rows)]
        failed = {r.index: r.error for r in results if r.status == "failed"}
        if failed and not mark:
            ok = [r for r in results if r.status != "failed"]
            partial = self._assemble(ok, batch[[r.index for r in ok]], [rows[r.index] for r in ok], False) if ok \
                else None
            raise AgentLoopError.from_rows(failed_entries(rows, failed), len(results), batch=partial,
                                           succeeded_rows=[r.index for r in ok])
        out = self._assemble(results, batch, rows, mark)
        out.meta_info["worker_seconds"] = time.perf_counter() - t0
        return out

    def _assemble(self, results: list[RowResult], inputs: DataBatch, rows: list[dict], mark: bool) -> DataBatch:
        out = assemble(results, inputs, prompt_length=self.config.prompt_length,
                       max_prompt_embed_length=self.config.max_prompt_embed_length, mark_failed=mark,
                       scored=self.reward_pool is not None)
        out.non_tensor_batch["uid"] = to_object_array(f["uid"] for f in rows)
        out.non_tensor_batch["_group_index"] = to_object_array(f["_group_index"] for f in rows)
        return out

    async def _run_row(self, i: int, fields: dict, base_sp: dict, validate: bool, rerun: int = 0) -> RowResult:
        res = RowResult(index=i, request_id=fields["request_id"], seed=fields["seed"])
        try:
            base = base_sp if fields.get("latent_seed") is None else {**base_sp, "latent_seed": fields["latent_seed"]}
            sp = row_sampling(base, fields.get("sampling_params"), validate)
            loop = self._agent_loop(fields.get("agent_name") or self.config.agent.default_agent_loop)
            row_kwargs = {k: v for k, v in fields.items() if k != "sampling_params"}
            if rerun:  # the lost worker's requests may still run on the replicas under the row's own id
                row_kwargs["request_id"] = f"{fields['request_id']}~rerun{rerun}"
            out = await loop.run(sp, **row_kwargs)
            err = embed_length_error(out, self.config.max_prompt_embed_length)
            if err is not None:
                raise ValueError(err)
            if len(out.prompt_ids) > self.config.prompt_length:  # a model the config load could not look into
                raise ValueError(f"the prompt has {len(out.prompt_ids)} token ids (the tokenizer's padded length), "
                                 f"more than prompt_length={self.config.prompt_length}")
        except Exception as e:  # this row fails; the others carry on
            res.error = f"{type(e).__name__}: {e}"
            return res
        res.out = out
        if self.reward_pool is not None:
            await self._score(res, fields)
        return res

    async def _score(self, res: RowResult, fields: dict) -> None:
        from omniroll.reward import RewardSample

        out = res.out
        t0 = time.perf_counter()
        res.score_started_at = time.time()
        try:
            rm = fields.get("reward_model") or {}
            sample = RewardSample(
                sample_id=res.request_id, image=out.response_diffusion_output.numpy(),
                prompt=prompt_text(fields["raw_prompt"]), data_source=str(fields.get("data_source") or ""),
                ground_truth=rm.get("ground_truth") if isinstance(rm, dict) else None,
                extra_info=dict(fields.get("extra_info") or {}),
            )
            result = await self.reward_pool.score(sample)
        except Exception as e:  # never a silent 0: the row is failed with the reason
            res.error = f"reward: {type(e).__name__}: {e}"
        else:
            res.reward = result
            out.reward_score = result.score
            if result.status == "failed":
                res.error = f"reward failed: {result.error}"
        out.metrics.compute_score = time.perf_counter() - t0
