"""The trajectory file: one layout for every command (`generate`, `rollout`, and what `train` / `serve` write).

`trajectories.safetensors` is the rollout batch on disk: the same keys as the `DataBatch` (verl `DataProto`) the
agent loop returns, so a file row and a batch row read the same, and a trainer can recompute every log-prob from the
file alone (no config, no engine state). `write_trajectories(batch, path, run)` writes it; `read_trajectories(path)`
gives the DataBatch back (`meta_info["run"]` holds what made it). Files are written atomically, mode 0644.

Tensors (N rows; W recorded SDE steps; C, h, w the latent; L text tokens padded to the batch's longest; P the
pooled width; absent keys are absent for the whole file):

| key | shape | dtype | meaning |
|---|---|---|---|
| `responses` | [N, 3, H, W] | uint8 | the images (fp32 latents [N, C, h, w] for `output_type: latent`) |
| `rollout_log_probs` | [N, W] | fp32 | log-prob of each recorded step's sample under the SDE step (absent with `logprobs` off) |
| `all_latents` | [N, W+1, C, h, w] | fp32 | latent before the first recorded step, then after each |
| `all_timesteps` | [N, W] | fp32 | the denoiser's timestep at each recorded step (sigma x 1000) |
| `sigmas`, `sigmas_next` | [N, W] | fp32 | sigma at each recorded step and the next one |
| `step_indices` | [N, W] | int64 | which denoising steps were recorded |
| `sde_window` | [N, 2] | int64 | [start, end) of the SDE window |
| `noise_level`, `sigma_max`, `guidance_scale` | [N] | fp32 | per-row SDE noise level (0 for ODE), the `sde` step's sigma_max, the requested guidance |
| `cfg_scale` | [N] | fp64 | the scale of the CFG mix `uncond + cfg_scale * (cond - uncond)` (0: no CFG rows); equals `guidance_scale` for SD3, `true_cfg_scale` for guidance-distilled models |
| `prompt_embeds` (+ `_mask`) | [N, L, D] (+ [N, L] int64) | model dtype | text conditioning (mask 1 = real token) |
| `pooled_prompt_embeds` | [N, P] | model dtype | pooled text conditioning |
| `negative_prompt_embeds` (+ `_mask`), `negative_pooled_prompt_embeds` | as above | | the unconditional branch (CFG rows only) |
| `prompts`, `attention_mask` | [N, prompt_length] | int64 | prompt token ids (right-padded with 0), mask 1 on real tokens |
| `rm_scores` | [N, 1] | fp32 | reward (when every row was scored) |
| `failed` | [N] | bool | row failed (`on_failure: mark`); its tensors are zeros |

Metadata (safetensors string metadata, JSON values): `format` ("omniroll.trajectory/1"); `non_tensor_batch` (per-row
lists: `raw_prompt`, `uid`, `_group_index`, `request_id`, `seed`, `sde_type`, `sampling_params` (each row's
SamplingParams as given), `weight_version`, `step_weight_versions` (W ints: the weight version that ran each
recorded step; recompute step k under it), `min_weight_version`, `max_weight_version`, `status`, `error`, reward
info, ...); `meta_info` (the batch's
JSON-able meta, e.g. `global_steps`, weight versions); `run` (command, model, device, dtype, batch invariance,
seed base, package versions: `omniroll.files.run_info`).

To recompute row i's step k (see docs/concepts.md): CFG rows are [uncond, cond] with the masked embeddings,
`v = v_uncond + cfg_scale[i] * (v_cond - v_uncond)` from the model at `all_latents[i, k]`,
`all_timesteps[i, k]`, then `sde_step(x, v, sigmas[i, k], sigmas_next[i, k], noise_level[i], sde_type[i],
prev_sample=all_latents[i, k + 1], sigma_max=sigma_max[i]).log_prob`.
"""

from __future__ import annotations

import json
from typing import Optional

from omniroll.files import jsonable, write_bytes

FORMAT = "omniroll.trajectory/1"
FILE_NAME = "trajectories.safetensors"

#: keys the layout documents (a `*_mask` of a documented embedding key is documented with it)
DOCUMENTED_KEYS = frozenset({
    "responses", "rollout_log_probs", "all_latents", "all_timesteps", "sigmas", "sigmas_next", "step_indices",
    "sde_window", "noise_level", "sigma_max", "guidance_scale", "cfg_scale", "prompt_embeds", "pooled_prompt_embeds",
    "negative_prompt_embeds", "negative_pooled_prompt_embeds", "prompts", "attention_mask", "rm_scores", "failed",
    "latents",
})


def batch_from_outputs(outputs: list, prompts: list[str], n: int, rows: Optional[list[int]] = None,
                       prompt_length: Optional[int] = None, max_prompt_embed_length: Optional[int] = None,
                       meta_info: Optional[dict] = None):
    """Engine outputs (DiffusionOutput) of `n` samples per prompt -> the agent loop's DataBatch, so a command that
    runs an engine directly writes the same layout as the agent loop. `rows`: which of the len(prompts) * n rows the
    outputs are (default: all, in order; fewer when some did not finish). The rows are `agent_loop.batch.prompt_batch`'s
    (uid = `batch_prompt_uid(prompt index)`, data_source "cli"), as `omniroll generate` and `rollout` build them."""
    from omniroll.agent_loop.batch import prompt_batch
    from omniroll.agent_loop.output_batch import RowResult, assemble, fit_error
    from omniroll.agent_loop.outputs import agent_loop_output
    from omniroll.sampling.seeds import batch_prompt_uid

    rows = list(range(len(prompts) * n)) if rows is None else list(rows)
    inputs = prompt_batch(prompts, n, batch_prompt_uid, data_source="cli", meta_info=meta_info)[rows]
    if prompt_length is None:
        prompt_length = max([len(o.extra_fields.get("prompt_ids") or []) for o in outputs] + [1])
    results = [RowResult(index=k, request_id=str(o.extra_fields.get("request_id")), seed=int(o.extra_fields["seed"]),
                         out=agent_loop_output(o, float(o.extra_fields.get("generate_seconds", 0.0))))
               for k, o in enumerate(outputs)]
    for r in results:
        err = fit_error(r.out, prompt_length, max_prompt_embed_length)
        if err is not None:
            raise ValueError(f"row {rows[r.index]} ({r.request_id}): {err}")
    return assemble(results, inputs, prompt_length=prompt_length, max_prompt_embed_length=max_prompt_embed_length,
                    mark_failed=False, scored=False)


def trajectory_bytes(batch, run: dict) -> bytes:
    """A DataBatch as the bytes of a trajectory file (what `write_trajectories` writes)."""
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().contiguous() for k, v in batch.batch.items()}
    nt = {k: [jsonable(v) for v in vals] for k, vals in batch.non_tensor_batch.items()}
    meta = {k: v for k, v in batch.meta_info.items() if k != "metrics"}
    metadata = {"format": FORMAT, "non_tensor_batch": json.dumps(nt), "meta_info": json.dumps(jsonable(meta)),
                "run": json.dumps(jsonable(run))}
    return save(tensors, metadata=metadata)


def trajectory_file(outputs: list, prompts: list[str], n: int, run: dict) -> bytes:
    """Completed engine outputs (`n` per prompt, in order) -> the bytes of a trajectory file (what `omniroll serve`'s
    `/v1/rollout` returns)."""
    return trajectory_bytes(batch_from_outputs(outputs, prompts, n), run)


def write_trajectories(batch, path: str, run: dict) -> str:
    """Write a DataBatch (the agent loop's output, or `omniroll generate`'s) to `path` in the documented layout."""
    return write_bytes(path, trajectory_bytes(batch, run))


def read_trajectories(path_or_bytes):
    """The DataBatch in a trajectory file (a path, or the bytes `/v1/rollout` returns); `meta_info["run"]` is what
    made it. ValueError if it is not one."""
    from safetensors import safe_open
    from safetensors.torch import load

    from omniroll.agent_loop.batch import DataBatch

    if isinstance(path_or_bytes, (bytes, bytearray)):
        tensors = load(bytes(path_or_bytes))
        metadata = _metadata_of_bytes(bytes(path_or_bytes))
        where = "these bytes"
    else:
        with safe_open(path_or_bytes, "pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        where = str(path_or_bytes)
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{where} is not an omniroll trajectory file (format {metadata.get('format')!r}, "
                         f"expected {FORMAT!r})")
    meta = json.loads(metadata["meta_info"])
    meta["run"] = json.loads(metadata["run"])
    return DataBatch.from_dict(tensors=tensors, non_tensors=json.loads(metadata["non_tensor_batch"]), meta_info=meta)


def _metadata_of_bytes(data: bytes) -> dict:
    """The string metadata of safetensors bytes (its JSON header's `__metadata__`)."""
    header_len = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + header_len]).get("__metadata__") or {}
